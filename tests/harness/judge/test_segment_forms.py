"""Which form the segmented reductions take (harness/judge/segments.py `Segments.per_tensor`: a
loop over the tensors from PER_TENSOR_FROM elements in all, or from PER_TENSOR_MEAN per tensor on
average, as a slice of a large tensor judged as one piece is) and that both forms give the same
results on such pieces: first maxima (NaN first, ties), maxima, counts, the judge's outcomes and
the sign test's counts."""

from __future__ import annotations

import pytest
import torch

from harness.judge import segments
from harness.judge.segments import Segments, judge_segments, sign_counts


def test_the_form_follows_the_elements_in_all_and_per_tensor():
    mean = segments.PER_TENSOR_MEAN
    assert Segments([torch.Size([mean])]).per_tensor
    assert Segments([torch.Size([mean, 2]), torch.Size([1])]).per_tensor
    assert not Segments([torch.Size([mean - 1])]).per_tensor
    assert not Segments([torch.Size([300])] * 30).per_tensor
    assert not Segments([]).per_tensor
    assert Segments([torch.Size([8])] * (segments.PER_TENSOR_FROM // 8)).per_tensor


def _piece(seed: int, sizes: list[int]):
    g = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    actual = torch.randn(total, generator=g, dtype=torch.float64)
    expected = actual + torch.randn(total, generator=g, dtype=torch.float64) * 1e-3
    expected[:: 7] = expected[0]  # runs of equal values
    tol = torch.full((total,), 2e-3, dtype=torch.float64)
    ratio_probe = torch.rand(total, generator=g, dtype=torch.float64).round(decimals=1)  # ties of the maximum
    if seed % 2:
        actual[total // 3] = float("nan")
        ratio_probe[total // 2] = float("nan")
    return Segments([torch.Size([n]) for n in sizes]), actual, expected, tol, ratio_probe


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("sizes", [[5000], [3000, 1, 2000], [7, 0, 4096]])
def test_both_forms_give_the_same_results(monkeypatch, seed, sizes):
    seg, actual, expected, tol, probe = _piece(seed, sizes)
    before = torch.randn(seg.total, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    results = {}
    for form, mean in (("batched", 1 << 62), ("per_tensor", 1)):
        monkeypatch.setattr(segments, "PER_TENSOR_MEAN", mean)
        assert seg.per_tensor == (form == "per_tensor")
        results[form] = (seg.argmax(probe).tolist(), seg.max(probe).tolist(), seg.counts(probe > 0.5),
                         judge_segments(seg, actual, expected, tol),
                         sign_counts(seg, actual - expected, expected, before))
    batched, per_tensor = results["batched"], results["per_tensor"]
    assert batched[0] == per_tensor[0]
    assert str(batched[1]) == str(per_tensor[1])  # NaN in the same places
    assert batched[2:] == per_tensor[2:] or str(batched[2:]) == str(per_tensor[2:])
