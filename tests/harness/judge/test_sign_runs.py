"""The sign test's runs of equal values found by their bits ([Note: Runs of equal values by their
bits] in harness/judge/segments.py): the counts are those of the definition, computed here element
by element in Python (each distinct exact value, and input, counted once, at its first position;
-0.0 equal to 0.0; a NaN equal to nothing), batched, per tensor and by slices, on values with runs
of equal ones, signed zeros and NaNs, with float64, float32 and bfloat16 inputs."""

from __future__ import annotations

import math

import pytest
import torch

from harness.judge import segments
from harness.judge.segments import SignCounts, Segments, kept_for_signs, sign_counts, sign_counts_of_kept


def _by_definition(diff: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor | None) -> SignCounts:
    """The counts, element by element: a run is a key of Python floats (0.0 and -0.0 one key, as
    they are equal), a NaN a key of its own (it equals nothing), counted at its first position."""
    def key(x: float | None, i: int):
        return ("nan", i) if x is not None and math.isnan(x) else x

    seen, up, differing, along, nonzero = set(), 0, 0, 0, 0
    ins = [None] * diff.numel() if inputs is None else inputs.tolist()
    for i, (d, v, x) in enumerate(zip(diff.tolist(), expected.tolist(), ins)):
        if not (d != 0 and math.isfinite(d)) or (key(v, i), key(x, i)) in seen:
            continue
        seen.add((key(v, i), key(x, i)))
        differing += 1
        up += d > 0
        if v != 0:
            nonzero += 1
            along += (d > 0) == (v > 0)
    return SignCounts(up, differing, along, nonzero)


def _planted(seed: int, n: int = 600) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    expected = torch.randn(n, generator=g, dtype=torch.float64)
    expected[::7] = expected[3]  # a run of equal values across the tensor
    expected[5::13] = 0.0
    expected[6::13] = -0.0  # equal to 0.0: one run with them
    expected[[40, 41, 300]] = float("nan")  # equal to nothing
    diff = torch.randn(n, generator=g, dtype=torch.float64)
    diff[::9] = 0.0  # not read
    diff[[11, 12]] = float("inf")
    inputs = torch.randn(n, generator=g, dtype=torch.float64).float().double()
    inputs[::14] = inputs[1]  # runs of equal inputs, some beside equal values
    inputs[8::26] = -0.0
    inputs[21::26] = 0.0
    inputs[77] = float("nan")
    return diff, expected, inputs


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_counts_are_the_definitions(monkeypatch, seed, per_tensor):
    if per_tensor:
        monkeypatch.setattr(segments, "PER_TENSOR_FROM", 0)
    diff, expected, inputs = _planted(seed)
    sizes = [torch.Size([250]), torch.Size([0]), torch.Size([350])]
    seg = Segments(sizes)
    for given in (None, inputs, inputs.float(), inputs.to(torch.bfloat16)):
        got = sign_counts(seg, diff, expected, None if given is None else given)
        for (a, b), counts in zip(seg.ranges(), got):
            want = _by_definition(diff[a:b], expected[a:b], None if given is None else given[a:b].double())
            assert counts == want, (given is None or given.dtype, a, b)


@pytest.mark.parametrize("seed", [0, 1])
def test_counts_by_slices_are_the_definitions(seed):
    diff, expected, inputs = _planted(seed)
    for given in (None, inputs):
        args = (diff, expected, given)
        kept = [kept_for_signs(*(None if t is None else t[a:a + 64] for t in args)) for a in range(0, diff.numel(), 64)]
        assert sign_counts_of_kept(kept) == _by_definition(diff, expected, given)


def test_signed_zeros_are_one_run_and_nans_none():
    # Three elements of values 0.0, -0.0, 0.0 and one input: one run, its first element's sign.
    diff = torch.tensor([-1.0, 1.0, 1.0, 2.0, -2.0], dtype=torch.float64)
    expected = torch.tensor([0.0, -0.0, 0.0, float("nan"), float("nan")], dtype=torch.float64)
    inputs = torch.tensor([-0.0, 0.0, -0.0, 1.0, 1.0], dtype=torch.float64)
    for given in (None, inputs):
        counts = sign_counts(Segments([torch.Size([5])]), diff, expected, given)[0]
        assert counts == SignCounts(upward=1, num_differing=3, along=1, num_nonzero=2)
