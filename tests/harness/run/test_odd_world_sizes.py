"""World sizes that are not powers of two ([Note: the run's global batch] in harness/run/plan.py
`_split_batches`): at W = 3 the standard and feature cases split a global batch grown to 24, and
the verdicts hold there as they do at W = 2, 4.

Planted in impl/ at the reduction seams (impl/_faults.py): gradients divided by W before the
reduction in the parameter dtype (bfloat16 under mixed precision), not after it in the reduce dtype.
At W = 2 the division is exact and the cell is bitwise the honest one; at W = 3 every term takes a
bfloat16 rounding the fp32 reduction was configured to avoid, and the gradient check fails."""

from __future__ import annotations

import pytest
import torch

from harness.judge.verdict import evaluate
from harness.run.orchestrate import run_plan
from harness.run.plan import build_plan

FAULT = "grad_predivide_param_dtype"
pytestmark = pytest.mark.slow  # the extended tier: a launch at W = 2 and 3 (about 20 s)


@pytest.fixture(scope="module")
def odd_run(tmp_path_factory):
    plan = build_plan(cases=("transformer", "mixed_precision"), impls=("ours", "fsdp2"), world_sizes=(2, 3),
                      data_modes=("split",), steps=3, out_dir=tmp_path_factory.mktemp("odd") / "run",
                      fault_copies=(FAULT,))
    torch.set_num_threads(1)
    cells, _, _ = evaluate(plan, run_plan(plan))
    return {r.cell.cell_id: r for r in cells}


def test_honest_cells_pass_at_w3_on_the_grown_batch(odd_run):
    honest = [r for r in odd_run.values() if not r.cell.faults]
    assert {r.cell.case for r in honest} == {"transformer@batch=24", "mixed_precision@batch=24"}
    assert {(r.cell.impl, r.cell.world_size) for r in honest} == {(i, w) for i in ("ours", "fsdp2") for w in (2, 3)}
    for r in honest:
        assert str(r.verdict) == "pass", r.cell.cell_id
        for opt in r.optimizers.values():
            # the honest ceiling at W = 3 is K / (K + 1) < 1 (docs/error_model.md)
            assert opt.margins["grad"] < 1, (r.cell.cell_id, opt.margins)
    assert all(opt.margins["grad"] > 0 for r in honest if r.cell.world_size == 3 for opt in r.optimizers.values())


def test_a_predivision_in_bf16_fails_at_w3_and_is_exact_at_w2(odd_run):
    r = odd_run[f"mixed_precision@batch=24.ours.w3.split.{FAULT}"]
    first = r.first_divergence
    assert str(r.verdict) == "fail" and (first.step, first.check) == (1, "grad"), first and first.describe(r.cell.cell_id)
    assert first.ratio > 100
    # Dividing by 2 is exact: the planted cell is the honest one, bit for bit.
    planted, honest = odd_run[f"mixed_precision@batch=24.ours.w2.split.{FAULT}"], odd_run["mixed_precision@batch=24.ours.w2.split"]
    assert str(planted.verdict) == "pass"
    assert planted.optimizers["adamw"].margins == honest.optimizers["adamw"].margins
