"""A model judged in many pieces gets the verdict it gets in one ([Note: The judge by pieces] in
harness/judge/diff.py): every violation in its order, margin, statistic, per-step worst element,
first divergence and its neighbourhood, on honest cells and on cells with planted faults that
fail the grad, param, bias, padding and nonfinite checks; with tied weights (the transformer),
frozen parameters, parameters without a gradient and clipping (judged in one piece).

One launch, judged in the parent from its snapshots twice: as it is (every catalog model is one
piece) and with PIECE_ELEMENTS lowered so that every tensor above 64 elements is a piece of its
own and the small ones share pieces."""

from __future__ import annotations

import pytest
import torch

from harness.judge import diff
from harness.judge.verdict import evaluate
from harness.run.orchestrate import run_plan
from harness.run.plan import build_plan

from test_judged_on_ranks import _assert_same_results

CASES = ("mlp", "transformer", "frozen_params", "unused_head", "clip_grad_norm")
FAULTS = ("grad_scale_1e-5", "grad_padding_garbage", "grad_shift_one_ulp", "grad_nan_one_element")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    plan = build_plan(cases=CASES, impls=("ours",), world_sizes=(2,), data_modes=None, steps=3,
                      out_dir=tmp_path_factory.mktemp("pieces"), fault_copies=FAULTS, judge_on="parent")
    torch.set_num_threads(1)  # as `harness run` judges
    return plan, run_plan(plan)


def _judged(plan, outcome) -> dict:
    cells, references, _ = evaluate(plan, outcome)
    return {r.cell.cell_id: r for r in references + cells}


def _in_pieces(monkeypatch, elements: int) -> list[int]:
    """Lower PIECE_ELEMENTS; returns the list that the number of pieces of every judged step joins."""
    counts: list[int] = []
    pieces = diff.CellJudge.pieces

    def counted(self, tensors):
        out = pieces(self, tensors)
        counts.append(len(out))
        return out

    monkeypatch.setattr(diff, "PIECE_ELEMENTS", elements)
    monkeypatch.setattr(diff.CellJudge, "pieces", counted)
    return counts


def test_many_pieces_give_the_verdict_of_one(launched, monkeypatch):
    plan, outcome = launched
    whole = _judged(plan, outcome)
    counts = _in_pieces(monkeypatch, 64)
    pieces = _judged(plan, outcome)
    assert max(counts) >= 5  # the models were judged in pieces
    _assert_same_results(whole, pieces)
    verdicts = {str(r.verdict) for r in whole.values()}
    assert verdicts == {"pass", "fail"}, verdicts
    failed = {v.check for r in whole.values() for o in r.optimizers.values() for v in o.violations}
    assert failed >= {"grad", "param", "bias", "padding", "nonfinite"}, failed


def test_a_piece_left_out_is_seen(launched, monkeypatch):
    """The comparison can fail: pieces that skip a tensor judge fewer elements."""
    plan, outcome = launched
    whole = _judged(plan, outcome)
    pieces = diff.CellJudge.pieces
    monkeypatch.setattr(diff, "PIECE_ELEMENTS", 64)
    monkeypatch.setattr(diff.CellJudge, "pieces", lambda self, tensors: [p[1:] or p for p in pieces(self, tensors)])
    with pytest.raises(AssertionError):
        _assert_same_results(whole, _judged(plan, outcome))
