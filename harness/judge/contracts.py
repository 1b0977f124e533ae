"""The contract check: each configured feature did what it promises to the collectives.

[Note: Contracts]
The value checks prove a run is the unsharded run; they cannot see a feature that was silently not
applied while the numbers stayed legal (gradient accumulation that syncs every micro-batch, a
NO_SHARD mesh read as a sharded one, reshard_after_forward=False that re-gathers in backward).
Users choose those features for their memory and traffic, so each one active in a cell is a
contract, held at every step to what the collective ledger counted on every rank ([Note:
Collective ledger] in harness/run/collectives.py):
- `gradient_sync_off`: with M > 1 micro-batches and gradient sync off until the last, no backward
  pass before the last reduces as many floating elements as the model has trainable ones (a
  gradient sync reduces each of them at least once; the reductions a model makes itself, such as
  a synchronised norm's statistics, are far smaller). A sync of only some units is not seen.
- `no_gather_in_backward`: with reshard_after_forward=False, no all-gather inside backward.
- `unsharded`: under NO_SHARD (a (W, 1) mesh), no all-gather or reduce-scatter on a group of more
  than one rank: gradients are all-reduced and parameters stay whole.
A contract applies where its feature is on at a world size that can show it (W > 1), and only to
implementations whose adapter declares it keeps it (Adapter.contracts): a library whose
collectives the seam does not see, or that reduces on a schedule of its own, declares none.
Each broken contract is a Violation of the check "contract" naming the contract, the step, the
rank, what was counted and the limit (ratio inf: no tolerance).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Callable

from cases.features import Features
from harness.judge.result import Violation


@dataclass(frozen=True)
class LedgerStep:
    """One training step's collectives on groups of more than one rank (this rank's view)."""

    backward_passes: int
    # the most floating elements any backward pass before the last reduced (sum or average)
    reduced_before_last_pass: int
    gathers_in_backward: int  # all-gathers issued inside a backward pass
    sharded_collectives: int  # all-gathers and reduce-scatters, any phase

    def to_row(self) -> tuple[float, ...]:
        return tuple(float(x) for x in astuple(self))

    @classmethod
    def from_row(cls, row) -> LedgerStep:
        return cls(*(int(x) for x in row))


LEDGER_WIDTH = len(LedgerStep.__dataclass_fields__)


@dataclass(frozen=True)
class Contract:
    name: str
    promise: str  # what the feature promises, as a report states it
    applies: Callable[[Features, int], bool]  # (features, world size)
    # (one rank's step, trainable elements) -> (what was counted, its limit), or None: kept
    broken: Callable[[LedgerStep, int], tuple[int, int] | None]


CONTRACTS: dict[str, Contract] = {c.name: c for c in (
    Contract("gradient_sync_off",
             "with gradient sync off, a backward pass before the last reduces fewer elements than the model "
             "has trainable ones",
             lambda f, w: f.grad_accum > 1 and w > 1,
             lambda s, n: (s.reduced_before_last_pass, n) if s.reduced_before_last_pass >= n else None),
    Contract("no_gather_in_backward",
             "with reshard_after_forward=False, no all-gather inside backward",
             lambda f, w: not f.reshard_after_forward and w > 1,
             lambda s, n: (s.gathers_in_backward, 0) if s.gathers_in_backward else None),
    Contract("unsharded",
             "under NO_SHARD, no all-gather or reduce-scatter over more than one rank",
             lambda f, w: f.mesh == "no_shard" and w > 1,
             lambda s, n: (s.sharded_collectives, 0) if s.sharded_collectives else None),
)}


def active_contracts(features: Features, world_size: int, kept: frozenset[str]) -> tuple[str, ...]:
    """The contracts a cell is held to: its features' at its world size, of those its adapter keeps."""
    return tuple(name for name, c in CONTRACTS.items() if name in kept and c.applies(features, world_size))


def contract_violations(optimizer: str, step: int, names: tuple[str, ...], rows, trainable: int
                        ) -> list[Violation]:
    """The broken contracts of one step: `rows` holds every rank's LedgerStep as a row."""
    out = []
    for rank, row in enumerate(rows):
        ledger = LedgerStep.from_row(row)
        for name in names:
            broken = CONTRACTS[name].broken(ledger, trainable)
            if broken is not None:
                counted, limit = broken
                out.append(Violation(optimizer, step, "contract", name, float("inf"), float(counted - limit),
                                     float(limit), float(counted), float(limit), rank=rank,
                                     num_violating=counted))
    return out
