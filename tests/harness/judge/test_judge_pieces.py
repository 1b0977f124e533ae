"""A model judged in many pieces gets the verdict it gets in one ([Note: The judge by pieces] in
harness/judge/diff.py): every violation in its order, margin, statistic, per-step worst element,
first divergence and its neighbourhood, on honest cells and on cells with planted faults that
fail the init, grad, param, bias, padding and nonfinite checks; with tied weights (the transformer),
frozen parameters, parameters without a gradient and clipping (judged in one piece).

One launch, judged in the parent from its snapshots twice: as it is (every catalog model is one
piece) and with PIECE_ELEMENTS lowered to 64, so that small tensors share pieces and every
tensor above 64 elements is cut into slices of 64, each a piece (its outcomes and sign counts
merged after its last slice). The merges themselves are held to the whole tensor's figures on
planted values below: NaN, inf, ties, zeros, more than 4096 sampled values."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.judge import diff
from harness.judge.diff import CheckStats
from harness.judge.segments import (Segments, judge_segments, kept_for_signs, merge_outcomes, sign_counts,
                                    sign_counts_of_kept)
from harness.judge.verdict import evaluate
from harness.run.orchestrate import run_plan
from harness.run.plan import build_plan

from tests.harness.run.test_judged_on_ranks import _assert_same_results

CASES = ("mlp", "transformer", "frozen_params", "unused_head", "clip_grad_norm")
FAULTS = ("grad_scale_1e-5", "grad_padding_garbage", "grad_shift_one_ulp", "grad_nan_one_element",
          "shard_offset_off_by_one")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    plan = build_plan(cases=CASES, impls=("ours",), world_sizes=(2,), data_modes=None, steps=3,
                      out_dir=tmp_path_factory.mktemp("pieces"), fault_copies=FAULTS, judge_on="parent")
    torch.set_num_threads(1)  # as `harness run` judges
    return plan, run_plan(plan)


@pytest.fixture(scope="module")
def whole(launched) -> dict:
    """Every cell judged with every catalog model in one piece (judged once for the module)."""
    return _judged(*launched)


def _judged(plan, outcome) -> dict:
    cells, references, _ = evaluate(plan, outcome)
    return {r.cell.cell_id: r for r in references + cells}


def _in_pieces(monkeypatch, elements: int) -> list[list[str]]:
    """Lower PIECE_ELEMENTS; returns the list that every judged step's parameter pieces join."""
    seen: list[list[str]] = []
    param_pieces = diff.CellJudge.param_pieces

    def recorded(self, tensors):
        out = param_pieces(self, tensors)
        seen.extend(out)
        return out

    monkeypatch.setattr(diff, "PIECE_ELEMENTS", elements)
    monkeypatch.setattr(diff.CellJudge, "param_pieces", recorded)
    return seen


def test_many_pieces_give_the_verdict_of_one(launched, whole, monkeypatch):
    plan, outcome = launched
    seen = _in_pieces(monkeypatch, 64)
    pieces = _judged(plan, outcome)
    assert any(len(p) > 1 for p in seen)  # small tensors shared pieces
    assert any("[" in p[0] for p in seen)  # and big ones were sliced
    _assert_same_results(whole, pieces)
    verdicts = {str(r.verdict) for r in whole.values()}
    assert verdicts == {"pass", "fail"}, verdicts
    failed = {v.check for r in whole.values() for o in r.optimizers.values() for v in o.violations}
    assert failed >= {"init", "grad", "param", "bias", "padding", "nonfinite"}, failed


def test_a_piece_left_out_is_seen(launched, whole, monkeypatch):
    """The comparison can fail: pieces that skip a tensor judge fewer elements (the mlp's cells
    judged so, its honest one and its planted ones, against their judgement in one piece)."""
    plan, outcome = launched
    mlp = dataclasses.replace(plan, cells=tuple(c for c in plan.cells if c.case == "mlp"),
                              references=tuple(c for c in plan.references if c.case == "mlp"))
    assert {f for c in mlp.cells for f in c.faults} == set(FAULTS), mlp.cells
    pieces = diff.CellJudge.pieces
    monkeypatch.setattr(diff, "PIECE_ELEMENTS", 64)
    monkeypatch.setattr(diff.CellJudge, "pieces", lambda self, tensors: [p[1:] or p for p in pieces(self, tensors)])
    skipped = _judged(mlp, outcome)
    with pytest.raises(AssertionError):
        _assert_same_results({k: whole[k] for k in skipped}, skipped)


def _planted(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    expected = torch.randn(n, generator=g, dtype=torch.float64)
    expected[::7] = 0.0
    expected[5::11] = expected[4::11][: expected[5::11].numel()]  # repeated values: one coin each
    actual = expected + torch.randn(n, generator=g, dtype=torch.float64) * 1e-6
    actual[::5] = expected[::5]  # equal elements
    tol = torch.full((n,), 2e-6, dtype=torch.float64)
    return actual, expected, tol


@pytest.mark.parametrize("plant", ["none", "nan", "inf", "tie"])
def test_slices_merge_to_the_whole_tensors_figures(plant):
    n, width = 20000, 3000
    actual, expected, tol = _planted(n, 3)
    if plant == "nan":
        actual[[4100, 9000]] = float("nan")
    elif plant == "inf":
        actual[12345] = float("inf")
    elif plant == "tie":
        actual[[100, 7000, 15000]] = expected[[100, 7000, 15000]] + 1.0  # three equal worst ratios
    whole = judge_segments(Segments([torch.Size([n])]), actual, expected, tol)[0]
    starts = range(0, n, width)
    parts = [(a, judge_segments(Segments([torch.Size([min(n, a + width) - a])]), actual[a:a + width],
                                expected[a:a + width], tol[a:a + width])[0]) for a in starts]
    assert repr(merge_outcomes(parts)) == repr(whole)
    inputs = expected * 3 + 1
    one = Segments([torch.Size([n])])
    # Inputs a float32 holds (a float32 parameter's), runs of equal ones included; and the same with
    # two inputs of one float32 rounding but distinct in float64, beside equal expected values: kept
    # narrow, they would be one coin, not two (and one slice keeps float64 inputs, the others not).
    exact = inputs.float().double()
    exact[6::11] = exact[4::11][: exact[6::11].numel()]
    close = exact.clone()
    close[27] = exact[26] * (1 + 2.0 ** -40)
    assert close[27] != close[26] and close[27].float() == close[26].float() and expected[27] == expected[26]
    assert bool((actual[26:28] != expected[26:28]).all())  # both differ: both read by the sign test
    for args in ((actual - expected, expected, None), (actual - expected, expected, inputs),
                 (actual - expected, expected, exact), (actual - expected, expected, close)):
        kept = [kept_for_signs(*(None if t is None else t[a:a + width] for t in args)) for a in starts]
        assert sign_counts_of_kept(kept) == sign_counts(one, *args)[0]
    assert {kept_for_signs(actual - expected, expected, t)[2].dtype for t in (inputs, exact, close)} == \
        {torch.float64, torch.float32}
    value = torch.where(expected == 0, 0.0, expected.abs() + 1)
    by_whole, by_slices = CheckStats(), CheckStats()
    by_whole.add_samples(one, tol, value)
    seen, nonzero = 0, int(value.count_nonzero())
    for a in starts:
        seen = by_slices.add_slice_samples(tol[a:a + width], value[a:a + width], seen, nonzero)
    assert seen == nonzero > 4096
    assert torch.equal(torch.cat(by_whole.rel_tol_samples), torch.cat(by_slices.rel_tol_samples))
