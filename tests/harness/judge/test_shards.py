"""Each rank's raw shard summarised where it lives ([Note: Shards judged where they live] in
harness/judge/shards.py): the summaries say what the rows say, and a row or a set of ranks that
cannot be read by one layout is an error naming it, never a pass."""

from __future__ import annotations

import math

import pytest
import torch

from harness.judge.layouts import LayoutError, check_step_layouts
from harness.judge.shards import GRAD_SUFFIX, summarize_row, summarize_rows

LAYOUT = {"w": {"kind": "flat", "flat_key": "unit/flat", "offset": 0, "shard_numel": 4, "world_size": 2}}


def _rec(rows: torch.Tensor, full: torch.Tensor, intervals) -> dict:
    return {"step": 1, "shards": {"unit/flat": rows}, "shard_grads": {}, "params": {"w": full},
            "padding_intervals": {"unit/flat": intervals}}


def test_padding_of_an_unspecified_convention_is_not_read_and_declared_zero_padding_is():
    row = torch.tensor([1.0, math.nan, 2.0, 5.0])  # element 1 is padding
    loose = summarize_row(row, 0, [(1, 2)], padding_judged=False)
    assert (loose.numel, loose.padding, loose.nonfinite, loose.nonzero_padding) == (4, 1, None, None)
    strict = summarize_row(row, 0, [(1, 2), (3, 4)], padding_judged=True)
    assert (strict.nonfinite.index, strict.nonfinite.count) == (1, 1) and math.isnan(strict.nonfinite.value)
    assert (strict.nonzero_padding.index, strict.nonzero_padding.count) == (1, 2)  # NaN and 5.0
    assert summarize_row(torch.tensor([0.0, math.inf]), 0, [], True).nonfinite.index == 1


def test_a_layout_slice_split_over_ranks_names_its_first_differing_element_and_counts_them_all():
    full = torch.arange(7, dtype=torch.float32)
    rows = torch.cat([full, torch.zeros(1)]).view(2, 4).clone()
    rows[1, 1] = -1.0  # the parameter's element 5
    rows[1, 2] = -2.0  # and 6
    (mismatch,) = check_step_layouts(_rec(rows, full, [[], [[3, 4]]]), LAYOUT, {"w": torch.Size([7])}, 2)
    assert (mismatch.name, mismatch.index, mismatch.full, mismatch.shard, mismatch.rank, mismatch.count) == \
        ("w", 5, 5.0, -1.0, 1, 2)
    rows[0, 3] = 9.0  # element 3, on rank 0: now the first
    (mismatch,) = check_step_layouts(_rec(rows, full, [[], [[3, 4]]]), LAYOUT, {"w": torch.Size([7])}, 2)
    assert (mismatch.index, mismatch.rank, mismatch.count) == (3, 0, 3)
    # the same answers from the ranks' own summaries
    slices = [("w", 0, 2, full)]
    summaries = {"unit/flat": summarize_rows(rows, [[], [[3, 4]]], True, slices)}
    rec = {**_rec(rows, full, [[], [[3, 4]]]), "shards": {}, "shard_summaries": summaries, "layout_digests": ["a", "a"]}
    assert check_step_layouts(rec, LAYOUT, {"w": torch.Size([7])}, 2) == [mismatch]


def test_ranks_that_disagree_on_a_shard_size_or_their_layouts_or_an_interval_past_the_shard_are_errors():
    full = torch.arange(7, dtype=torch.float32)
    rows = torch.cat([full, torch.zeros(1)]).view(2, 4)
    summaries = {"unit/flat": summarize_rows(rows, [[], [[3, 4]]], True, [("w", 0, 2, full)])}
    base = {**_rec(rows, full, [[], [[3, 4]]]), "shards": {}, "shard_summaries": summaries, "layout_digests": ["a", "a"]}
    with pytest.raises(LayoutError, match="rank 1 reports other layouts"):
        check_step_layouts({**base, "layout_digests": ["a", "b"]}, LAYOUT, {"w": torch.Size([7])}, 2)
    short = summarize_rows(rows[:, :3], [[], []], True)
    with pytest.raises(LayoutError, match="rank 1's raw shard 'unit/flat' holds 3 elements, rank 0's 4"):
        check_step_layouts({**base, "shard_summaries": {"unit/flat": summaries["unit/flat"][:1] + short[1:]}},
                           LAYOUT, {"w": torch.Size([7])}, 2)
    assert "outside the shard's 4 elements" in summarize_row(rows[1], 1, [(3, 5)], True).error


def test_the_judge_raises_a_summary_that_could_not_be_read(tmp_path):
    from harness.judge.diff import CellJudge

    judge = CellJudge.__new__(CellJudge)
    judge.padding = {"params": "zero", "grads": "zero"}
    bad = summarize_row(torch.zeros(4), 1, [(2, 9)], True)
    rec = {"step": 3, "shard_summaries": {"unit/flat" + GRAD_SUFFIX: [summarize_row(torch.zeros(4), 0, [], True), bad]}}
    with pytest.raises(LayoutError, match=r"step 3: rank 1's raw shard 'unit/flat \(grad\)': padding interval \[2, 9\)"):
        judge.shard_summaries(rec)
