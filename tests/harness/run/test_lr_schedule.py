"""Parameter groups and an LR scheduler in the catalog (cases/catalog.py `lr_schedule`): the replay
steps its own scheduler, so an implementation's loop that steps the learning rate otherwise is a
different training run.

Planted in the training loop the harness drives (harness/faults.py, layer "loop"; its seam in harness/run/dist_faults.py scheduler_steps), for any
implementation: the scheduler stepped twice after every optimizer step. Step 1's learning rate is
the same; from step 2 every parameter moves with another one, and the parameter check fails there.
A cell whose optimizer has no scheduler cannot show the fault: an error, never a pass."""

from __future__ import annotations

import pytest
import torch

from harness.errors import PlanError
from harness.judge.verdict import evaluate
from harness.faults import check_faults
from harness.run.orchestrate import run_plan
from harness.run.plan import build_plan

FAULT = "lr_scheduler_stepped_twice"


@pytest.fixture(scope="module")
def scheduled_run(tmp_path_factory):
    plan = build_plan(cases=("lr_schedule", "mlp"), impls=("ours", "fsdp2"), world_sizes=(2,), data_modes=("split",),
                      steps=3, out_dir=tmp_path_factory.mktemp("lr") / "run", fault_copies=(FAULT,))
    torch.set_num_threads(1)
    cells, _, _ = evaluate(plan, run_plan(plan))
    return {r.cell.cell_id: r for r in cells}


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ours", "fsdp2"])
def test_groups_and_a_schedule_pass_and_a_scheduler_stepped_twice_fails(scheduled_run, impl):
    assert str(scheduled_run[f"lr_schedule.{impl}.w2.split"].verdict) == "pass"
    r = scheduled_run[f"lr_schedule.{impl}.w2.split.{FAULT}"]
    first = r.first_divergence
    assert str(r.verdict) == "fail" and (first.step, first.check) == (2, "param"), first and first.describe(r.cell.cell_id)
    # a case without a scheduler cannot show it: no verdict
    plain = scheduled_run[f"mlp.{impl}.w2.split.{FAULT}"]
    assert str(plain.verdict) == "error" and "never acted" in plain.error


def test_verbs_that_drive_their_own_loop_refuse_a_loop_fault():
    check_faults((FAULT,), ("fsdp2",))
    with pytest.raises(PlanError, match="act in the training loop"):
        check_faults((FAULT,), ("ours",), loop=False)
