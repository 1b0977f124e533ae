"""Assertions that a harness run judged what it claims (not a test module: pytest collects test_*.py).

A cell that passes with zero steps, an optimizer missing or a check that compared nothing would
pass "bitwise" vacuously; verdict-level tests call `assert_judged` on every cell they expect.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
from pathlib import Path

import torch

from cases.catalog import get_case
from harness.adapters.registry import resolve_impl
from harness.judge.contracts import active_contracts
from harness.judge.diff import check_snapshot
from harness.judge.checks import CHECK_ORDER
from harness.judge.result import Violation


# Checks with a tolerance: steps.csv names, per step, the element nearest it (harness/report/build.py), so
# a step where such a check compared nothing has an empty margin there.
PER_STEP_CHECKS = ("grad", "param", "trajectory")


def steps_recorded(out: Path) -> dict[tuple[str, str], dict[str, list[int]]]:
    """(cell id, optimizer) -> 'loss' or a check of PER_STEP_CHECKS -> the steps >= 1 of
    out/steps.csv where the cell's loss, or that check's margin, is present."""
    recorded: dict[tuple[str, str], dict[str, list[int]]] = {}
    with open(Path(out) / "steps.csv", newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            if step < 1:
                continue
            per = recorded.setdefault((row["cell_id"], row["optimizer"]), {})
            for column, key in [("loss", "loss")] + [(f"{c}_margin", c) for c in PER_STEP_CHECKS]:
                if row[column] != "":
                    per.setdefault(key, []).append(step)
    return recorded


def assert_judged(out: Path, cell: dict, steps: int, padding: bool) -> None:
    """`cell` (a summary.json row of the run in `out`) was judged with every optimizer of its case
    on steps 1..`steps` (a loss and every tolerance check at each step), and every check compared
    elements (buffers: when the case's model has any; clip: when the case clips; contract: when a
    feature of the case at its world size is a contract its adapter keeps). `padding`: whether the cell has padded raw shards (impl=ours and its subclasses,
    except ZeRO-1, whose parameters stay whole); fsdp2 and the plain module expose none, and there
    the padding check must have compared nothing. A cell whose bias check the judge turned off from
    step 1 (its `bias_not_applied` note: a reordered local backward) compared nothing there."""
    kinds = sorted(o.kind for o in get_case(cell["case"]).optimizers)
    bias_off = (cell.get("bias_not_applied") or "").startswith("bias check off from step 1:")
    has_buffers = any(True for _ in get_case(cell["case"]).build_model().buffers())
    clips = get_case(cell["case"]).features.clip_norm_type is not None
    held = active_contracts(get_case(cell["case"]).features, int(cell["world_size"]), resolve_impl(cell["impl"]).contracts)
    assert sorted(cell["optimizers"]) == kinds and sorted(cell["checks"]) == kinds, (cell["cell_id"], cell["optimizers"])
    recorded = steps_recorded(out)
    for kind in kinds:
        checks = cell["checks"][kind]
        assert set(checks) == set(CHECK_ORDER), (cell["cell_id"], kind, sorted(checks))
        for check in CHECK_ORDER:
            elements = checks[check]["elements"]
            if check == "padding" and not padding:
                assert elements == 0, (cell["cell_id"], kind, "padding compared elements it should not have")
            elif check == "bias" and bias_off:
                assert elements == 0, (cell["cell_id"], kind, "bias compared elements after the judge turned it off")
            elif check == "buffers" and not has_buffers:
                assert elements == 0, (cell["cell_id"], kind, "buffers compared elements of a model without any")
            elif check == "clip" and not clips:
                assert elements == 0, (cell["cell_id"], kind, "clip compared elements of a case that does not clip")
            elif check == "contract" and not _judged_contracts(held, get_case(cell["case"]).optimizer(kind)):
                assert elements == 0, (cell["cell_id"], kind, "contract compared elements of a cell held to none")
            else:
                assert elements > 0, (cell["cell_id"], kind, check, "compared nothing")
        per_step = recorded.get((cell["cell_id"], kind), {})
        for key in ("loss",) + PER_STEP_CHECKS:
            assert per_step.get(key) == list(range(1, steps + 1)), (cell["cell_id"], kind, key, per_step)


def _judged_contracts(held: tuple[str, ...], spec) -> tuple[str, ...]:
    """The contracts of `held` that judge something under optimizer `spec`: `sharded_state` only
    where the optimizer keeps elementwise state (plain SGD keeps none)."""
    p = torch.nn.Parameter(torch.ones(2))
    optim = dataclasses.replace(spec, param_groups=(), lr_scheduler=None).build([p])  # its kind's state
    p.grad = torch.ones(2)
    optim.step()
    keeps = any(torch.is_tensor(t) and t.dim() > 0 for st in optim.state.values() for t in st.values())
    return tuple(c for c in held if c != "sharded_state" or keeps)


def judge_violations(evidence, damage=None) -> list[Violation]:
    """The violations `check_snapshot` finds in (snap, ref, init) `evidence`, first divergence first,
    after `damage(snap)` on a copy (the evidence itself is left as it was); the judgement must
    reach a verdict."""
    snap, ref, init = evidence
    snap = copy.deepcopy(snap)
    if damage is not None:
        damage(snap)
    result = check_snapshot(snap, init, ref)
    assert result.error is None, result.error
    return sorted(result.violations, key=Violation.sort_key)
