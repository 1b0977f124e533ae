"""Bugs that wait: a fault that acts from step 6 on (impl/_faults.py grad_scale_from_step_6, a
gradient scale of 1 + 1e-5 from each unit's 6th reduction, as a buffer captured after a warm-up).
Five steps show nothing (the first divergence is at step 6, on the gradient check). The
standard cases' default of steps (cases/catalog.py) is long enough to reach it."""

from __future__ import annotations

import pytest
import torch

from cases.catalog import get_case
from harness.judge.verdict import evaluate
from harness.run.orchestrate import run_plan
from harness.run.plan import build_plan

FAULT = "grad_scale_from_step_6"


@pytest.fixture(scope="module")
def late_run(tmp_path_factory):
    plan = build_plan(cases=("transformer",), impls=("ours",), world_sizes=(2,), data_modes=("split",), steps=7,
                      out_dir=tmp_path_factory.mktemp("late") / "run", fault_copies=(FAULT,))
    torch.set_num_threads(1)
    cells, _, _ = evaluate(plan, run_plan(plan))
    return {r.cell.cell_id: r for r in cells}


def test_a_fault_from_step_6_is_silent_for_five_steps_and_fails_at_the_sixth(late_run):
    honest, planted = late_run["transformer.ours.w2.split"], late_run[f"transformer.ours.w2.split.{FAULT}"]
    assert str(honest.verdict) == "pass"
    first = planted.first_divergence
    assert str(planted.verdict) == "fail" and (first.step, first.check) == (6, "grad"), first and first.describe(
        planted.cell.cell_id)


def test_the_standard_cases_run_long_enough_by_default():
    assert all(get_case(name).steps >= 6 for name in ("mlp", "transformer"))
