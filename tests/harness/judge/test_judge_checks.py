"""Each check of the judge fails on its own planted fault, naming the check, the step, the
parameter and the element (fast tier, one process).

The evidence is a real run: mlp through impl=ours at W = 1 (no process group; its flat
parameters have alignment padding) and its reference, produced by the rank code in this process.
Each test damages one value of that evidence and judges it with `check_snapshot`; the honest
evidence passes with every check having compared something. Planted values are far outside the
tolerances (their tightness is pinned in test_tolerance_bounds.py), so a test fails only when its
check stops reporting (see tests/judge_mutants.py).
"""

from __future__ import annotations


import pytest
import torch

from cases.catalog import get_case
from harness.judge.diff import check_snapshot
from harness.judge.checks import CHECK_ORDER
from harness.judge.result import Violation
from harness.adapters import RankContext
from harness.run.orchestrate import write_init_states
from harness.run.plan import build_plan
from harness.run.snapshot import load_init
from harness.run.worker import run_cell
from tests.support.judged import judge_violations

STEPS = 3


@pytest.fixture(scope="module")
def evidence(tmp_path_factory):
    out = tmp_path_factory.mktemp("judge-checks") / "out"
    plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(1,), data_modes=("identical",), steps=STEPS,
                      out_dir=out)
    write_init_states(plan)
    init, _ = load_init(plan.init_dir / "mlp.pt", plan.run_id)
    spec = get_case("mlp").optimizer("sgd")
    (ref_cell,), (cell,) = plan.references, plan.cells
    ctx = RankContext(0, 1, None)
    ref = run_cell(ref_cell, spec, init, ctx, out / "scratch")
    snap = run_cell(cell, spec, init, ctx, out / "scratch")
    return snap, ref, init


def _only(violations: list[Violation], check: str) -> Violation:
    """The first violation, which must be of `check`, and every violation of that check."""
    assert violations, f"no violation: the {check} check did not report the planted fault"
    first = violations[0]
    assert first.check == check, [v.describe("planted") for v in violations[:5]]
    return first


def test_the_honest_evidence_passes_and_every_check_compared_something(evidence):
    snap, ref, init = evidence
    result = check_snapshot(snap, init, ref)
    assert result.violations == [] and result.error is None
    assert set(result.checks) == set(CHECK_ORDER)
    empty = [c for c, st in result.checks.items() if not st["elements"] > 0]
    # mlp has no buffers (tests/harness/judge/test_buffers.py), does not clip (tests/harness/judge/test_clip_check.py) and
    # configures no feature that is a contract (tests/harness/judge/test_contracts.py)
    assert empty == ["buffers", "clip", "contract"], f"checks that compared nothing: {empty}"
    assert len(snap["steps"]) == STEPS


def _next(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.tensor(float("inf"), dtype=x.dtype))


def test_init_one_ulp_off_fails_at_step_0(evidence):
    def damage(snap):
        p = snap["init"]["params"]["layers.1.weight"]
        p.view(-1)[7] = _next(p.view(-1)[7])

    first = _only(judge_violations(evidence, damage), "init")
    assert (first.step, first.name, first.index, first.coords) == (0, "layers.1.weight", 7, (0, 7))


def test_loss_one_ulp_off_fails_at_its_step_on_its_rank(evidence):
    def damage(snap):
        loss = snap["steps"][1]["loss"]
        loss[0] = _next(loss[0])

    first = _only(judge_violations(evidence, damage), "loss")
    assert (first.step, first.name, first.rank) == (2, "<loss>", 0)


def test_a_gradient_element_off_by_1e_4_fails_the_grad_check(evidence):
    def damage(snap):
        g = snap["steps"][2]["grads"]["layers.0.weight"]
        g.view(-1)[5] *= 1 + 1e-4

    violations = judge_violations(evidence, damage)
    first = _only(violations, "grad")
    assert (first.step, first.name, first.index, first.rank) == (3, "layers.0.weight", 5, 0)
    assert first.num_violating == 1 and first.ratio > 1


def test_a_parameter_element_off_by_1e_4_fails_the_param_check(evidence):
    def damage(snap):
        p = snap["steps"][0]["params"]["layers.2.bias"]
        p.view(-1)[1] *= 1 + 1e-4

    first = _only(judge_violations(evidence, damage), "param")
    assert (first.step, first.name, first.index, first.rank) == (1, "layers.2.bias", 1, 0)


def test_a_frozen_style_exact_parameter_is_judged_even_without_a_gradient(evidence):
    """A parameter with no gradient is compared exactly (no arithmetic touched it)."""
    def damage(snap):
        rec = snap["steps"][1]
        del rec["grads"]["layers.3.bias"], rec["shadow"]["grads"]["layers.3.bias"]
        del rec["shadow"]["abs_grads"]["layers.3.bias"]
        rec["params"]["layers.3.bias"] = _next(rec["shadow"]["params"]["layers.3.bias"])

    first = _only(judge_violations(evidence, damage), "param")
    assert (first.step, first.name, first.tol) == (2, "layers.3.bias", 0.0)


def test_a_replica_that_differs_on_one_rank_fails_the_replicas_check(evidence):
    def damage(snap):
        replicas = snap["steps"][1]["replicas"]
        digests = replicas["digests"]
        other = digests.clone()
        column = replicas["names"].index("layers.1.bias (grad)")
        other[0, column] += 1
        replicas["digests"] = torch.cat([digests, digests, other])  # ranks 0 and 1 agree, rank 2 not

    first = _only(judge_violations(evidence, damage), "replicas")
    assert (first.step, first.name, first.rank) == (2, "layers.1.bias (grad)", 2)


@pytest.mark.parametrize("grad", [False, True], ids=["shard", "shard_grad"])
def test_a_non_zero_padding_element_fails_the_padding_check(evidence, grad):
    snap = evidence[0]
    key = "layers.0/_flat_param"
    (start, end), = snap["steps"][0]["padding_intervals"][key][0]

    def damage(snap):
        rows = (snap["steps"][1]["shard_grads"] if grad else snap["steps"][1]["shards"])[key]
        rows[0, end - 1] = 0.5

    first = _only(judge_violations(evidence, damage), "padding")
    assert (first.step, first.name, first.index, first.rank, first.in_padding) == (
        2, key + (" (grad)" if grad else ""), end - 1, 0, True)
