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
- `shard_group`: where parameters are sharded over S > 1 ranks (the whole team, or HSDP's shard
  groups of a (R, S) mesh: ranks r // S * S ... + S - 1), every all-gather and reduce-scatter runs
  over exactly the ranks of this rank's shard group (a mesh read with its dimensions swapped shards
  over the replicate group instead: legal numbers, another layout than the one configured).
- `sharded_state`: where the optimizer state is sharded over S > 1 ranks (ZeRO-3, ZeRO-1, HSDP's
  shard groups), the elementwise optimizer state every rank holds after the step, summed over the
  ranks and divided by the replicas, is below twice the unsharded state (k elementwise tensors per
  parameter, the replay's k, times every parameter's elements). Any partition (flat shards, dim-0
  chunks, whole parameters per rank) sums to the unsharded state plus its padding, which stays
  below it unless the units are smaller than the world; a state kept whole on every rank sums to S
  times it (S >= 2). Counted after the optimizer step, from the optimizer the adapter built
  (Adapter.local_optimizer_state_elements: its tensors' local parts). Not applied to a case that
  reloads its checkpoint over fewer ranks mid-run (Features.checkpoint_reshard_at): its sharding
  changes by design (found by the golden comparison: state_dict_reshard unshards at W = 2).
A broken contract explains a layout the adapter reports that no longer matches the raw shards (the
implementation sharded otherwise than configured): where a step breaks one, the layouts are not
validated at that step, and the cell fails naming the contract instead of being an `error` that
blames the adapter (`broken_at`).
A contract applies where its feature is on at a world size that can show it (W > 1), and only to
implementations whose adapter declares it keeps it (Adapter.contracts): a library whose
collectives the seam does not see, or that reduces on a schedule of its own, declares none.
Each broken contract is a Violation of the check "contract" naming the contract, the step, the
rank (none for `sharded_state`, a sum over the ranks), what was counted and the limit (ratio inf:
no tolerance).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Callable

from cases.features import Features
from harness.judge.result import Violation


@dataclass(frozen=True)
class LedgerStep:
    """One training step on one rank: its collectives on groups of more than one rank, and the
    optimizer state it holds after the step."""

    backward_passes: int
    # the most floating elements any backward pass before the last reduced (sum or average)
    reduced_before_last_pass: int
    gathers_in_backward: int  # all-gathers issued inside a backward pass
    sharded_collectives: int  # all-gathers and reduce-scatters, any phase
    optimizer_state_elements: int = 0  # elements of this rank's elementwise optimizer state (its own shard)
    sharded_off_group: int = 0  # all-gathers and reduce-scatters over another group than the mesh's shard group

    def to_row(self) -> tuple[float, ...]:
        return tuple(float(x) for x in astuple(self))

    @classmethod
    def from_row(cls, row) -> LedgerStep:
        return cls(*(int(x) for x in row))


@dataclass(frozen=True)
class ModelSize:
    """What a contract's limits are stated in, from the replay of the step."""

    trainable: int  # elements of the parameters with a gradient
    state: int  # elements of the unsharded optimizer's elementwise state, every parameter counted
    replicas: int  # copies of the sharded state the mesh keeps (HSDP: its replicate size)


# (rank or None: over the ranks, what was counted, the limit) of each breach
Breaches = list[tuple[int | None, int, int]]


def _per_rank(broken: Callable[[LedgerStep, ModelSize], tuple[int, int] | None]
              ) -> Callable[[list[LedgerStep], ModelSize], Breaches]:
    def every_rank(steps: list[LedgerStep], size: ModelSize) -> Breaches:
        return [(rank, *b) for rank, s in enumerate(steps) if (b := broken(s, size)) is not None]
    return every_rank


def _state_partitioned(steps: list[LedgerStep], size: ModelSize) -> Breaches:
    held = sum(s.optimizer_state_elements for s in steps) // size.replicas
    return [(None, held, 2 * size.state)] if size.state and held >= 2 * size.state else []


@dataclass(frozen=True)
class Contract:
    name: str
    promise: str  # what the feature promises, as a report states it
    applies: Callable[[Features, int], bool]  # (features, world size)
    broken: Callable[[list[LedgerStep], ModelSize], Breaches]  # every rank's step -> its breaches
    judges: Callable[[ModelSize], bool] = lambda size: True  # False: nothing to hold it to this step


CONTRACTS: dict[str, Contract] = {c.name: c for c in (
    Contract("gradient_sync_off",
             "with gradient sync off, a backward pass before the last reduces fewer elements than the model "
             "has trainable ones",
             lambda f, w: f.grad_accum > 1 and w > 1,
             _per_rank(lambda s, m: (s.reduced_before_last_pass, m.trainable)
                       if s.reduced_before_last_pass >= m.trainable else None)),
    Contract("no_gather_in_backward",
             "with reshard_after_forward=False, no all-gather inside backward",
             lambda f, w: not f.reshard_after_forward and w > 1,
             _per_rank(lambda s, m: (s.gathers_in_backward, 0) if s.gathers_in_backward else None)),
    Contract("unsharded",
             "under NO_SHARD, no all-gather or reduce-scatter over more than one rank",
             lambda f, w: f.mesh == "no_shard" and w > 1,
             _per_rank(lambda s, m: (s.sharded_collectives, 0) if s.sharded_collectives else None)),
    Contract("shard_group",
             "every all-gather and reduce-scatter runs over the shard group the mesh defines (its ranks)",
             lambda f, w: f.mesh != "no_shard" and f.mesh_shape(w)[1] > 1 and not f.checkpoint_reshard_at,
             _per_rank(lambda s, m: (s.sharded_off_group, 0) if s.sharded_off_group else None)),
    Contract("sharded_state",
             "with the optimizer state sharded (ZeRO-1, ZeRO-3, HSDP within a replica), the ranks of a replica "
             "hold fewer than twice the unsharded state's elements together",
             # a case that reloads its checkpoint over fewer ranks mid-run changes its sharding by design
             lambda f, w: f.mesh != "no_shard" and f.mesh_shape(w)[1] > 1 and not f.checkpoint_reshard_at,
             _state_partitioned, lambda size: size.state > 0),  # plain SGD keeps no state
)}


def model_size(shadow: dict, features: Features, world_size: int) -> ModelSize:
    """The contracts' units at a step, from its replay: the trainable elements, and the elementwise
    optimizer state per parameter (the most tensors any parameter has) over every parameter."""
    per_param = max((sum(1 for t in st.values() if t.dim() > 0) for st in shadow["state"].values()), default=0)
    return ModelSize(sum(g.numel() for g in shadow["grads"].values()),
                     per_param * sum(p.numel() for p in shadow["params"].values()),
                     features.mesh_shape(world_size)[0])


def broken_at(names: tuple[str, ...], rec: dict, features: Features, world_size: int) -> bool:
    """Whether step record `rec` breaks one of the contracts `names` (False without its ledger)."""
    if not names or rec.get("collectives") is None:
        return False
    violations, _ = contract_violations("", int(rec["step"]), names, rec["collectives"].tolist(),
                                        model_size(rec["shadow"], features, world_size))
    return bool(violations)


def active_contracts(features: Features, world_size: int, kept: frozenset[str]) -> tuple[str, ...]:
    """The contracts a cell is held to: its features' at its world size, of those its adapter keeps."""
    return tuple(name for name, c in CONTRACTS.items() if name in kept and c.applies(features, world_size))


def contract_violations(optimizer: str, step: int, names: tuple[str, ...], rows, size: ModelSize
                        ) -> tuple[list[Violation], int]:
    """The broken contracts of one step (`rows`: every rank's LedgerStep as a row), and how many
    (contract, rank) pairs were judged."""
    steps = [LedgerStep.from_row(row) for row in rows]
    judged = [name for name in names if CONTRACTS[name].judges(size)]
    violations = [Violation(optimizer, step, "contract", name, float("inf"), float(counted - limit), float(limit),
                            float(counted), float(limit), rank=rank, num_violating=counted)
                  for name in judged for rank, counted, limit in CONTRACTS[name].broken(steps, size)]
    return violations, len(judged) * len(steps)
