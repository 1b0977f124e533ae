"""The replay's float64 sums taken a chunk at a time (harness/reference/tolerance.py
`accumulate_in_chunks`, `promoted_sum_in_chunks`; shadow.py `_added`): the bits of the whole-tensor
promotion and addition, for tensors of less than one chunk, of several and of a ragged last one."""

from __future__ import annotations

import pytest
import torch

from harness.reference import tolerance
from harness.reference.shadow import _added

SIZES = [(1,), (5, 7), (tolerance.CHUNK_ELEMENTS + 3,), (3, tolerance.CHUNK_ELEMENTS // 2 + 1)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64)


def _values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    flat = t.view(-1)
    flat[:: 97] = -0.0
    flat[1:: 131] = float("nan")
    flat[2:: 173] = float("-inf")
    return t.to(dtype)


@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("absolute", [False, True])
def test_a_promoted_sum_is_the_whole_tensor_promotion_and_addition(shape, dtypes, absolute):
    total, term = _values(shape, dtypes[0], 1), _values(shape, dtypes[1], 2)
    expected = total.double() + (term.double().abs() if absolute else term.double())
    got = tolerance.promoted_sum_in_chunks(total, term, absolute)
    assert got.dtype == torch.float64 and got.shape == total.shape
    assert torch.equal(_bits(got), _bits(expected))
    via_added = _added(total, term, absolute)  # a float32 total: a new float64 one, the term added
    assert via_added.data_ptr() != total.data_ptr() and torch.equal(_bits(via_added), _bits(expected))


@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("absolute", [False, True])
def test_an_accumulation_adds_in_place_the_bits_of_one_addition(shape, absolute):
    total, term = _values(shape, torch.float64, 3), _values(shape, torch.float32, 4)
    expected = total + (term.double().abs() if absolute else term.double())
    ptr = total.data_ptr()
    got = _added(total, term, absolute)
    assert got.data_ptr() == ptr and torch.equal(_bits(got), _bits(expected))


def test_sizes_that_differ_are_refused():
    with pytest.raises(ValueError, match="elements into"):
        tolerance.promoted_sum_in_chunks(torch.zeros(4), torch.zeros(5))
