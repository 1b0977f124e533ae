"""Non-finite values never pass (fast tier): every check compares `not (|diff| <= tol)`, a NaN or
Inf in the cell is a failure of its own check naming the first occurrence, and a non-finite
reference is an error (the case diverged), never a verdict on the implementation.

Snapshots come from a real W = 1 run of a small drawn model through impl=ours (the fuzzer's rank
code, in this process), with values planted afterwards."""

from __future__ import annotations

import math

import pytest

from harness.judge.diff import ReferenceDiverged, check_snapshot
from harness.fuzz.strategies import OPTIMIZERS
from harness.fuzz.check import assemble_snapshot
from harness.fuzz.spec import BlockSpec, ModelSpec, as_case, init_state
from harness.fuzz.worker import run_example
from harness.run.snapshot import decode, encode
from harness.adapters import RankContext

_SPEC = ModelSpec(1, 3, 2, (BlockSpec(width=2, gain=True, aux_numel=3),), OPTIMIZERS[0], steps=2)


@pytest.fixture(scope="module")
def honest():
    init = init_state(_SPEC)
    reply = decode(encode(run_example(_SPEC, frozenset(), init, RankContext(0, 1, None))))
    return assemble_snapshot(_SPEC, (), [reply], init), init


def _judge(snap, init):
    return check_snapshot(snap, {n: init[n] for n in snap["init"]["params"]}, None, case=as_case(_SPEC))


def _fresh(honest):
    snap, init = honest
    return {**snap, "steps": [{**rec, "grads": {n: t.clone() for n, t in rec["grads"].items()},
                               "params": {n: t.clone() for n, t in rec["params"].items()},
                               "loss": rec["loss"].clone(),
                               "shadow": {**rec["shadow"], "grads": dict(rec["shadow"]["grads"])}}
                              for rec in snap["steps"]]}, init


def test_the_honest_snapshot_passes_every_check(honest):
    result = _judge(*honest)
    assert result.violations == [] and result.error is None
    assert all(result.checks[c]["elements"] > 0 for c in ("init", "loss", "grad", "param", "padding"))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_gradient_element_is_the_first_divergence(honest, value):
    snap, init = _fresh(honest)
    name = sorted(snap["steps"][1]["grads"])[0]
    snap["steps"][1]["grads"][name].view(-1)[0] = value
    result = _judge(snap, init)
    first = min(result.violations, key=lambda v: v.sort_key())
    assert (first.check, first.step, first.name, first.index) == ("nonfinite", 2, name, 0)
    assert "is not finite" in first.describe("cell")
    # The gradient check fails on the same element too: NaN never compares as "within tolerance".
    assert any(v.check == "grad" and v.name == name and v.index == 0 for v in result.violations)
    assert math.isinf(result.margins["grad"])


def test_inf_in_both_the_cell_and_the_reference_is_an_error_not_a_pass(honest):
    snap, init = _fresh(honest)
    name = sorted(snap["steps"][0]["grads"])[0]
    snap["steps"][0]["grads"][name].view(-1)[0] = math.inf
    snap["steps"][0]["shadow"]["grads"][name] = snap["steps"][0]["shadow"]["grads"][name].clone()
    snap["steps"][0]["shadow"]["grads"][name].view(-1)[0] = math.inf
    with pytest.raises(ReferenceDiverged, match="not finite at step 1"):
        _judge(snap, init)


def test_a_nan_loss_on_a_rank_fails_the_loss_check_on_that_rank(honest):
    snap, init = _fresh(honest)
    snap["steps"][0]["loss"][0] = math.nan
    checks = {(v.check, v.rank) for v in _judge(snap, init).violations}
    assert ("nonfinite", 0) in checks and ("loss", 0) in checks


def test_a_missing_step_is_an_error_not_a_shorter_pass(honest):
    snap, init = _fresh(honest)
    truncated = {**snap, "steps": snap["steps"][:1]}
    with pytest.raises(ValueError, match="steps"):
        check_snapshot(truncated, {n: init[n] for n in snap["init"]["params"]}, snap, case=as_case(_SPEC))


def test_a_tied_parameter_counts_one_term_per_use():
    """Its gradient is a sum over uses that an implementation may associate differently across
    micro-batches (a W=2 fuzz counterexample, seed 181), so each use is a term of the bound."""
    from harness.reference.shadow import Shadow

    spec = ModelSpec(2, 4, 1, (BlockSpec(width=2, tied=True),), OPTIMIZERS[0], accumulation=2, batch_per_rank=4,
                     sync_every_micro=False, seed=181)
    case = as_case(spec)
    shadow = Shadow(case, spec.optimizer, init_state(spec), num_micro=spec.accumulation)
    rec = shadow.step(init_state(spec), case.make_batch(case.seed, 1, case.global_batch), "split", 2)
    tied = "blocks.0.mix.weight"
    assert rec["num_terms"][tied] == 2 * 2 * 2 and rec["num_terms"]["blocks.0.lin.weight"] == 2 * 2
    assert (rec["abs_grads"][tied] >= rec["grads"][tied].abs()).all()
    assert shadow.plain.blocks[0].mix_t.weight is shadow.plain.blocks[0].mix.weight  # tied again after the step
