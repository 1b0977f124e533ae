"""Reductions the judge takes over a big model a tensor or a chunk at a time give what they give
over the whole: which tensors hold a non-finite value (per tensor from PER_TENSOR_FROM elements
on, batched below), and the rows' largest difference (max |a - b| by chunks of CHUNK_ELEMENTS),
NaN and infinities included; and the ratios' one-pass quotient, where every tolerance is positive
and nothing is NaN, is the masked quotient bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from harness.judge import diff, segments


def _tensors(plant: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = [torch.randn(shape, generator=g) for shape in [(7, 5), (0,), (300,), (2, 3, 4), (1,)]]
    if plant == "nan":
        out[2][17] = math.nan
    elif plant == "inf":
        out[3][1, 2, 3] = -math.inf
        out[4][0] = math.inf
    return out


@pytest.mark.parametrize("plant", ["none", "nan", "inf"])
def test_nonfinite_tensors_found_per_tensor_as_batched(monkeypatch, plant):
    tensors = _tensors(plant)
    batched = diff._nonfinite_segments(tensors)
    monkeypatch.setattr(segments, "PER_TENSOR_FROM", 0)
    assert diff._nonfinite_segments(tensors) == batched
    assert batched == {"none": [], "nan": [2], "inf": [3, 4]}[plant]


@pytest.mark.parametrize("plant", ["none", "nan", "inf"])
def test_largest_difference_by_chunks_is_the_whole(monkeypatch, plant):
    a, b = torch.randn(1000, dtype=torch.float32), torch.randn(1000, dtype=torch.float32)
    if plant == "nan":
        b[999] = math.nan  # in the last chunk
    elif plant == "inf":
        a[3] = math.inf
    whole = (a.double() - b.double()).abs().max()
    monkeypatch.setattr(diff, "CHUNK_ELEMENTS", 64)
    got = diff.max_abs_difference(a, b)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert (math.isnan(whole) and math.isnan(got)) or got.item() == whole.item()


def _ratios_with_masks(diff: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """The ratios' definition with every mask applied (segments.ratios' general path)."""
    ratio = diff / tol.clamp(min=1e-300)
    ratio.masked_fill_((~(diff <= tol) & (tol == 0)) | diff.isnan(), math.inf)
    return ratio.masked_fill_(diff == 0, 0.0)


@pytest.mark.parametrize("plant", ["none", "zero_diff", "zero_tol", "tiny_tol", "nan", "inf_diff", "inf_tol"])
def test_ratios_are_the_masked_quotient_bit_for_bit(plant):
    g = torch.Generator().manual_seed(5)
    diff = torch.rand(500, generator=g, dtype=torch.float64) * 1e-6
    tol = torch.rand(500, generator=g, dtype=torch.float64) * 1e-6 + 1e-9
    diff[::7] = 0.0  # passes exactly: +0.0 either way
    if plant == "zero_diff":
        diff[:] = 0.0
    elif plant == "zero_tol":
        tol[[3, 14]] = 0.0  # 3 differs there: inf; 14 does not (a |diff| of 0): 0
        diff[3] = 1e-7
    elif plant == "tiny_tol":
        tol[10] = 1e-310  # below the clamp: the quotient is taken against 1e-300
    elif plant == "nan":
        diff[42] = math.nan
    elif plant == "inf_diff":
        diff[9] = math.inf
    elif plant == "inf_tol":
        tol[11] = math.inf
        diff[11] = math.inf
    got, want = segments.ratios(diff, tol), _ratios_with_masks(diff, tol)
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))  # the same bits, NaN included
