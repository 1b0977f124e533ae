"""Hypothesis strategies for flat-parameter layouts: world sizes, sizes and the numels that break sharding.

Sharding bugs live at a few numels: fewer elements than ranks (whole shards of padding), W*k - 1,
W*k and W*k + 1 (a full shard of padding minus one, none, or one element spilling into a new
shard), primes (never divisible by W > 1), and parameters that are empty, 0-d or of size 1. A
uniform draw rarely lands there, so these strategies aim at them on purpose.

Every public function checks its arguments when it is called, so an impossible combination
raises `InvalidArgument` at once instead of quietly generating nothing.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from impl._flat_param import FlatLayout

MAX_WORLD_SIZE = 64
PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 61, 67, 97, 127, 251, 257, 509, 521, 1021)
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


def seeds() -> st.SearchStrategy[int]:
    """Seeds for a `torch.Generator`: tensor contents are explicit data of the example."""
    return st.integers(0, 2**32 - 1)


def float_dtypes() -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(FLOAT_DTYPES)


def world_sizes(min_value: int = 1, max_value: int = MAX_WORLD_SIZE) -> st.SearchStrategy[int]:
    """Any W in [min_value, max_value], powers of two (the common case) drawn more often."""
    _require(1 <= min_value <= max_value, f"need 1 <= min_value <= max_value, got min_value={min_value} max_value={max_value}")
    powers_of_two = [2**i for i in range(7) if min_value <= 2**i <= max_value]
    ints = st.integers(min_value, max_value)
    return st.one_of(ints, st.sampled_from(powers_of_two)) if powers_of_two else ints


def sizes(max_dims: int = 3, max_side: int = 6) -> st.SearchStrategy[tuple[int, ...]]:
    """Any shape: 0-d, size-1 and empty (a zero side) shapes included."""
    _require(max_dims >= 0 and max_side >= 0, f"need max_dims >= 0 and max_side >= 0, got max_dims={max_dims} max_side={max_side}")
    return st.lists(st.integers(0, max_side), max_size=max_dims).map(tuple)


def sizes_with_numel(numel: int, max_dims: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    """A shape whose product is exactly `numel`: 0-d or (1, 1) for one element, (k, 0) for none."""
    _require(numel >= 0, f"numel={numel} must be >= 0")
    _require(max_dims >= 1 or numel == 1, f"numel={numel} needs max_dims >= 1 (only numel=1 has a 0-d shape), got max_dims={max_dims}")
    return _sizes_with_numel(numel, max_dims)


@st.composite
def _sizes_with_numel(draw, numel: int, max_dims: int) -> tuple[int, ...]:
    if numel == 0:
        others = draw(st.lists(st.integers(0, 4), max_size=max_dims - 1))
        at = draw(st.integers(0, len(others)))
        return tuple(others[:at] + [0] + others[at:])
    divisors = [d for d in range(1, math.isqrt(numel) + 1) if numel % d == 0]
    d = draw(st.sampled_from(divisors))
    factors = [f for f in (d, numel // d) if f != 1]  # empty for numel=1: a 0-d shape
    if len(factors) > max_dims:
        factors = [numel]
    num_ones = draw(st.integers(0, max_dims - len(factors)))
    size = factors + [1] * num_ones
    return tuple(draw(st.permutations(size))) if len(size) > 1 else tuple(size)


def hard_numels(world_size: int, max_numel: int = 4096) -> st.SearchStrategy[int]:
    """A numel in [0, max_numel] aimed at the boundaries of `world_size`-way sharding."""
    _require(world_size >= 1, f"world_size={world_size} must be >= 1")
    _require(max_numel >= 0, f"max_numel={max_numel} must be >= 0")
    return _hard_numels(world_size, max_numel)


@st.composite
def _hard_numels(draw, world_size: int, max_numel: int) -> int:
    kind = draw(st.sampled_from(["below_world_size", "near_multiple", "prime", "any"]))
    if kind == "below_world_size":
        numel = draw(st.integers(0, world_size - 1))
    elif kind == "near_multiple":
        k = draw(st.integers(1, max(1, max_numel // world_size)))
        numel = world_size * k + draw(st.sampled_from([-1, 0, 1]))
    elif kind == "prime":
        numel = draw(st.sampled_from(PRIMES))
    else:
        numel = draw(st.integers(0, max_numel))
    # A target past the cap (a large W with a small cap) falls back to any allowed numel.
    return numel if numel <= max_numel else draw(st.integers(0, max_numel))


def size_lists(world_size: int, max_params: int = 5, max_numel: int = 1024) -> st.SearchStrategy[list[tuple[int, ...]]]:
    """Parameter sizes for one flat parameter of at most `max_numel` elements.

    Usually the total numel is a hard numel for `world_size`, split into parameters at random cut
    points (so empty parameters appear); otherwise the sizes are free and so is the total.
    """
    _require(world_size >= 1, f"world_size={world_size} must be >= 1")
    _require(max_params >= 1, f"max_params={max_params} must be >= 1")
    _require(max_numel >= 0, f"max_numel={max_numel} must be >= 0")
    return _size_lists(world_size, max_params, max_numel)


@st.composite
def _size_lists(draw, world_size: int, max_params: int, max_numel: int) -> list[tuple[int, ...]]:
    if draw(st.booleans()):
        free = draw(st.lists(sizes(), min_size=1, max_size=max_params))
        if sum(math.prod(s) for s in free) <= max_numel:
            return free
    total = draw(hard_numels(world_size, max_numel))
    num_params = draw(st.integers(1, max_params))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=num_params - 1, max_size=num_params - 1)))
    numels = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    return [draw(sizes_with_numel(n)) for n in numels]


def flat_layouts(
    min_world_size: int = 1, max_world_size: int = MAX_WORLD_SIZE, max_params: int = 5, max_numel: int = 1024
) -> st.SearchStrategy[FlatLayout]:
    """A `FlatLayout` over a drawn world size, with parameters named p0, p1, ..."""
    world_sizes(min_world_size, max_world_size)  # validates the range now, not at draw time
    _require(max_params >= 1, f"max_params={max_params} must be >= 1")
    _require(max_numel >= 0, f"max_numel={max_numel} must be >= 0")
    return _flat_layouts(min_world_size, max_world_size, max_params, max_numel)


@st.composite
def _flat_layouts(draw, min_world_size: int, max_world_size: int, max_params: int, max_numel: int) -> FlatLayout:
    world_size = draw(world_sizes(min_world_size, max_world_size))
    param_sizes = draw(size_lists(world_size, max_params, max_numel))
    align_numel = draw(align_numels())
    named = [((f"p{i}",), torch.Size(s)) for i, s in enumerate(param_sizes)]
    if align_numel > 1 and draw(st.booleans()):
        # Alignment gaps move the tail off the hard numel the sizes aimed at: one more parameter,
        # starting at the next aligned offset, puts the aligned numel back on a hard numel.
        start = FlatLayout.build(named + [(("probe",), torch.Size([1]))], world_size, align_numel).slots[-1].offset
        target = draw(hard_numels(world_size, max_numel))
        if target > start:
            named.append(((f"p{len(named)}",), torch.Size(draw(sizes_with_numel(target - start)))))
    return FlatLayout.build(named, world_size, align_numel)


def align_numels() -> st.SearchStrategy[int]:
    """Alignment steps in elements: 1 (dense, every slot boundary a hard numel) and the steps that
    256 bytes gives in fp64 / fp32 / bf16 and fp16 ([Note: Alignment])."""
    return st.sampled_from([1, 32, 64, 128, 3])  # 3: not a power of two, the arithmetic is general


def numels_and_world_sizes(max_world_size: int = MAX_WORLD_SIZE, max_numel: int = 4096) -> st.SearchStrategy[tuple[int, int]]:
    """(unpadded_numel, world_size) pairs, the numel aimed at that world size's boundaries."""
    world_sizes(1, max_world_size)
    _require(max_numel >= 0, f"max_numel={max_numel} must be >= 0")
    return _numels_and_world_sizes(max_world_size, max_numel)


@st.composite
def _numels_and_world_sizes(draw, max_world_size: int, max_numel: int) -> tuple[int, int]:
    world_size = draw(world_sizes(1, max_world_size))
    return draw(hard_numels(world_size, max_numel)), world_size
