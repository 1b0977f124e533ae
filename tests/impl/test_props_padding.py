"""Properties of alignment and uniform padding (see [Note: Alignment] and [Note: Uniform padding] in
impl/_flat_param.py).

For any parameter sizes, alignment steps and any W in 1..64, simulated in one process with W fake
ranks: every slot starts aligned, the padding intervals are exactly the elements no slot covers,
shards are uniform, the tail padding is shorter than W, flatten -> shard -> gather -> unflatten is bitwise the
identity, views alias the padded buffer, a reduce-scatter of per-rank gradients is the summed
gradient sliced, and an optimizer step leaves the padding exactly zero. The same checks run under
hypothesis and on a fixed grid of boundary numels.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import tests.support.strategies as strategies
from impl._flat_param import FlatLayout, flatten_padded, shard_numel_for, shard_of, unflatten_views

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1, foreach=True),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, foreach=True),
}


def padding_violation(unpadded_numel: int, world_size: int, shard_numel: int) -> str | None:
    """Why `shard_numel` is not a valid uniform shard for this flat parameter, or None if it is."""
    padding_numel = shard_numel * world_size - unpadded_numel
    if padding_numel < 0:
        return f"shards drop {-padding_numel} elements: unpadded_numel={unpadded_numel} world_size={world_size} shard_numel={shard_numel}"
    if padding_numel >= world_size:
        return f"padding_numel={padding_numel} >= world_size={world_size} (unpadded_numel={unpadded_numel} shard_numel={shard_numel})"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t`, flattened, so that equality is bitwise (-0.0 != 0.0, NaN == NaN)."""
    return t.reshape(-1).view(_INT_OF_WIDTH[t.element_size()])


def _random_params(layout: FlatLayout, seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(slot.size, generator=gen, dtype=torch.float32).to(dtype) for slot in layout.slots]


def _padding_of_shard(shard: torch.Tensor, layout: FlatLayout, rank: int) -> torch.Tensor:
    return torch.cat([shard[a:b] for a, b in layout.local_padding_intervals(rank)] + [shard[:0]])


def _slot_mask(layout: FlatLayout) -> torch.Tensor:
    """(padded_numel,) True where an element belongs to a slot, computed from the slots alone."""
    mask = torch.zeros(layout.padded_numel, dtype=torch.bool)
    for slot in layout.slots:
        assert not mask[slot.offset : slot.end].any(), f"'{slot.fqn}' overlaps another slot"
        mask[slot.offset : slot.end] = True
    return mask


def check_alignment(layout: FlatLayout) -> None:
    ends = [0] + [s.end for s in layout.slots]
    for slot, prev_end in zip(layout.slots, ends):
        assert slot.offset >= prev_end, f"'{slot.fqn}' starts before the previous slot ends"
        if slot.numel:
            assert slot.offset % layout.align_numel == 0, f"'{slot.fqn}' offset={slot.offset} align={layout.align_numel}"
            assert slot.offset - prev_end < layout.align_numel, f"'{slot.fqn}': a gap of a whole alignment step"
    # The padding intervals, rank by rank, are exactly the elements no slot covers.
    covered = _slot_mask(layout)
    is_padding = torch.zeros(layout.padded_numel, dtype=torch.bool)
    for rank in range(layout.world_size):
        start, end = layout.shard_bounds(rank)
        intervals = layout.local_padding_intervals(rank)
        assert all(0 <= a < b <= layout.shard_numel for a, b in intervals), (rank, intervals)
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(intervals, intervals[1:])), f"rank {rank}: {intervals} not disjoint runs"
        for a, b in intervals:
            is_padding[start + a : start + b] = True
    assert torch.equal(is_padding, ~covered), f"padding intervals {layout.padding_intervals()} != uncovered elements"
    assert int(is_padding.sum()) == layout.padding_numel == layout.padded_numel - layout.param_numel


def check_uniform_shards(layout: FlatLayout) -> None:
    n, w = layout.aligned_numel, layout.world_size
    assert layout.shard_numel == -(-n // w) == shard_numel_for(n, w)
    assert padding_violation(n, w, layout.shard_numel) is None
    assert layout.padded_numel == w * layout.shard_numel
    assert 0 <= layout.tail_padding_numel < w and (layout.tail_padding_numel == 0) == (n % w == 0)
    assert sum(layout.split_numels()) == layout.padded_numel
    bounds = [layout.shard_bounds(r) for r in range(w)]
    assert bounds[0][0] == 0 and bounds[-1][1] == layout.padded_numel
    assert all(end - start == layout.shard_numel for start, end in bounds)
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(w - 1))
    check_alignment(layout)
    for bad_rank in (-1, w):
        with pytest.raises(ValueError, match=f"rank={bad_rank}"):
            layout.shard_bounds(bad_rank)


def check_locate(layout: FlatLayout) -> None:
    covered = _slot_mask(layout).tolist()
    local_padding = []  # per rank, a shard-local mask from the rank's own padding intervals
    for rank in range(layout.world_size):
        mask = [False] * layout.shard_numel
        for a, b in layout.local_padding_intervals(rank):
            mask[a:b] = [True] * (b - a)
        local_padding.append(mask)
    for i in range(layout.padded_numel):
        rank, local = layout.locate(i)
        start, end = layout.shard_bounds(rank)
        assert start <= i < end and start + local == i, f"flat_index={i} rank={rank} local={local}"
        assert local_padding[rank][local] == (not covered[i]), f"flat_index={i}"
    for bad_index in (-1, layout.padded_numel):
        with pytest.raises(ValueError, match=f"flat_index={bad_index}"):
            layout.locate(bad_index)


def check_round_trip(layout: FlatLayout, seed: int, dtype: torch.dtype) -> None:
    params = _random_params(layout, seed, dtype)
    padded = flatten_padded(params, layout)
    assert padded.dtype == dtype and padded.numel() == layout.padded_numel
    assert torch.all(padded[~_slot_mask(layout)] == 0)
    # Each fake rank keeps its own copy of its shard; the gather concatenates them in rank order.
    sharded = [shard_of(padded, layout, r).clone() for r in range(layout.world_size)]
    for rank, shard in enumerate(sharded):
        assert torch.all(_padding_of_shard(shard, layout, rank) == 0), f"rank {rank}: non-zero padding"
    gathered = torch.cat(sharded)
    assert torch.equal(_bits(gathered), _bits(padded))
    for slot, param, view in zip(layout.slots, params, unflatten_views(gathered, layout), strict=True):
        assert view.shape == param.shape, f"'{slot.fqn}': size {tuple(view.shape)} != {tuple(param.shape)}"
        assert torch.equal(_bits(view), _bits(param)), f"'{slot.fqn}' changed bits in the round trip"


def check_views_alias(layout: FlatLayout, seed: int, storage_offset: int) -> None:
    # The buffer itself starts `storage_offset` elements into its storage, as a slice of a bigger
    # allocation would: views must be placed relative to the buffer, not to the storage.
    backing = torch.zeros(storage_offset + layout.padded_numel)
    padded = backing[storage_offset:]
    padded.copy_(flatten_padded(_random_params(layout, seed), layout))
    views = unflatten_views(padded, layout)
    for slot, view in zip(layout.slots, views, strict=True):
        assert view.untyped_storage().data_ptr() == backing.untyped_storage().data_ptr(), f"'{slot.fqn}' is a copy"
        assert view.storage_offset() == storage_offset + slot.offset, f"'{slot.fqn}' at the wrong offset"
    for slot, view in zip(layout.slots, views):
        before = padded.clone()
        view.copy_(-1.0 - torch.arange(slot.numel, dtype=torch.float32).view(slot.size))
        expected = before.clone()
        expected[slot.offset : slot.offset + slot.numel] = -1.0 - torch.arange(slot.numel, dtype=torch.float32)
        assert torch.equal(padded, expected), f"writing '{slot.fqn}' did not land at offset={slot.offset}"
    assert torch.all(backing[:storage_offset] == 0)


def check_reduce_scatter(layout: FlatLayout, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    world_size = layout.world_size
    # grads[src][i]: rank src's full (unsharded) gradient of parameter i.
    grads = [[torch.randn(s.size, generator=gen) for s in layout.slots] for _ in range(world_size)]
    padded_grads = [flatten_padded(g, layout) for g in grads]
    summed = [torch.zeros(s.size) for s in layout.slots]
    for rank_grads in grads:
        for total, g in zip(summed, rank_grads):
            total += g
    summed_padded = flatten_padded(summed, layout)
    # The expected shard is sliced here, not by shard_of: rank dst owns the dst-th of W equal
    # pieces of the padded buffer, ceil(aligned_numel / W) elements each.
    piece = -(-layout.aligned_numel // world_size)
    assert summed_padded.numel() == piece * world_size
    for dst in range(world_size):
        out = torch.zeros(layout.shard_numel)  # (shard_numel,)
        for src in range(world_size):
            out += shard_of(padded_grads[src], layout, dst)
        expected = summed_padded[dst * piece : (dst + 1) * piece]
        assert torch.equal(_bits(out), _bits(expected)), f"rank {dst}: wrong shard"
        assert torch.all(_padding_of_shard(out, layout, dst) == 0), f"rank {dst}: non-zero padding after reduce-scatter"


def check_optimizer_keeps_padding_zero(layout: FlatLayout, seed: int, optimizer: str, num_steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(seed)
    padded = flatten_padded(_random_params(layout, seed), layout)
    # One parameter per fake rank. SGD and AdamW update each parameter on its own, so one optimizer
    # over all W shards steps exactly as W single-rank optimizers would, at a fraction of the cost.
    sharded_params = [torch.nn.Parameter(shard_of(padded, layout, r).clone()) for r in range(layout.world_size)]
    sharded_optimizer = _OPTIMIZERS[optimizer](sharded_params)
    unsharded_param = torch.nn.Parameter(padded[: layout.aligned_numel].clone())
    unsharded_optimizer = _OPTIMIZERS[optimizer]([unsharded_param])
    for step in range(num_steps):
        padded_grad = flatten_padded([torch.randn(s.size, generator=gen) for s in layout.slots], layout)
        for rank, param in enumerate(sharded_params):
            param.grad = shard_of(padded_grad, layout, rank).clone()
        sharded_optimizer.step()
        for rank, param in enumerate(sharded_params):
            state = [param] + [t for t in sharded_optimizer.state[param].values() if t.shape == param.shape]
            for t in state:
                assert torch.all(_padding_of_shard(t, layout, rank) == 0), (
                    f"rank {rank}: {optimizer} made padding non-zero (step={step}, local_padding={layout.local_padding_intervals(rank)})"
                )
        unsharded_param.grad = padded_grad[: layout.aligned_numel].clone()
        unsharded_optimizer.step()
    gathered = torch.cat([p.detach() for p in sharded_params])
    torch.testing.assert_close(gathered[: layout.aligned_numel], unsharded_param.detach(), rtol=1e-6, atol=1e-7)


# Hypothesis tier.


@given(st.integers(0, 2**63 - 1), strategies.world_sizes())
@example(2**53 + 1, 1)  # regression: float division once rounded this down to 2**53
def test_shard_numel_for_is_an_exact_ceil_for_any_int64_numel(unpadded_numel, world_size):
    assert padding_violation(unpadded_numel, world_size, shard_numel_for(unpadded_numel, world_size)) is None


@pytest.mark.parametrize(("unpadded_numel", "world_size", "match"), [(-1, 2, "unpadded_numel=-1"), (3, 0, "world_size=0")])
def test_shard_numel_for_rejects_impossible_arguments(unpadded_numel, world_size, match):
    with pytest.raises(ValueError, match=match):
        shard_numel_for(unpadded_numel, world_size)


@given(strategies.flat_layouts())
def test_shards_are_uniform_and_padding_is_below_world_size(layout):
    check_uniform_shards(layout)


@given(strategies.flat_layouts())
def test_locate_agrees_with_shard_bounds(layout):
    check_locate(layout)


@given(strategies.flat_layouts(), strategies.seeds(), strategies.float_dtypes())
def test_flatten_shard_gather_unflatten_is_bitwise_identity(layout, seed, dtype):
    check_round_trip(layout, seed, dtype)


@given(strategies.flat_layouts(), strategies.seeds(), st.integers(0, 5))
def test_views_alias_the_padded_buffer(layout, seed, storage_offset):
    check_views_alias(layout, seed, storage_offset)


@given(strategies.flat_layouts(), strategies.seeds())
def test_reduce_scatter_is_summed_gradient_sliced(layout, seed):
    check_reduce_scatter(layout, seed)


@given(strategies.flat_layouts(max_numel=256), strategies.seeds(), st.sampled_from(sorted(_OPTIMIZERS)))
def test_optimizer_step_keeps_padding_zero(layout, seed, optimizer):
    check_optimizer_keeps_padding_zero(layout, seed, optimizer)


# Fixed boundary grid: every W in 1..16 against the numels where sharding breaks.

_LARGE_PRIME = 65_537  # never divisible by W > 1; every W in the grid gets it
_HUGE_PRIME = 1_000_003  # a few W only: the simulated collectives cost O(W * numel)
_GRID = [
    (w, n)
    for w in range(1, 17)
    for n in sorted({0, 1, w - 1, w, w + 1, 2 * w - 1, 2 * w + 1, 7, 13, 97, 251, _LARGE_PRIME})
] + [(w, _HUGE_PRIME) for w in (1, 2, 7, 16)]


def _grid_layout(world_size: int, numel: int, align_numel: int) -> FlatLayout:
    """A flat parameter whose aligned numel is exactly `numel`: a 0-d and an empty parameter around
    the main one (they must not shift the padding); aligned, the main one starts a step in."""
    empty = (("empty",), torch.Size([0, 3]))
    if numel == 0:
        sizes = [(("weight",), torch.Size([0])), empty]
    elif align_numel == 1 or numel == 1:
        sizes = [(("scalar",), torch.Size([])), (("weight",), torch.Size([numel - 1])), empty]
    elif numel <= align_numel:
        sizes = [(("empty0",), torch.Size([0])), (("weight",), torch.Size([numel])), empty]
    else:
        sizes = [(("scalar",), torch.Size([])), (("weight",), torch.Size([numel - align_numel])), empty]
    return FlatLayout.build(sizes, world_size, align_numel)


@pytest.mark.parametrize("align_numel", [1, 64])
@pytest.mark.parametrize(("world_size", "numel"), _GRID, ids=[f"W{w}-numel{n}" for w, n in _GRID])
def test_boundary_numels(world_size, numel, align_numel):
    layout = _grid_layout(world_size, numel, align_numel)
    assert layout.aligned_numel == numel
    check_uniform_shards(layout)
    check_round_trip(layout, seed=numel, dtype=torch.float32)
    check_reduce_scatter(layout, seed=numel)
    if numel < _LARGE_PRIME:  # both loop over elements in Python; the small numels cover them
        check_locate(layout)
        check_views_alias(layout, seed=numel, storage_offset=3)
    for optimizer in sorted(_OPTIMIZERS):
        check_optimizer_keeps_padding_zero(layout, seed=numel, optimizer=optimizer)


@pytest.mark.parametrize("world_size", [1, 2, 7, 64])
def test_flat_parameter_with_no_parameters(world_size):
    layout = FlatLayout.build([], world_size, align_numel=64)
    assert (layout.shard_numel, layout.padded_numel, layout.padding_numel) == (0, 0, 0)
    check_uniform_shards(layout)
    check_round_trip(layout, seed=0, dtype=torch.float32)


# Hypothesis must find and shrink the classic padding bugs. `find` raises NoSuchExample when no
# counterexample exists, so these fail if the broken function were correct.


def _floor_shard_numel(unpadded_numel: int, world_size: int) -> int:
    return unpadded_numel // world_size  # deliberately broken: floor drops the remainder


def _full_shard_pad_numel(unpadded_numel: int, world_size: int) -> int:
    padding_numel = world_size - unpadded_numel % world_size  # deliberately broken: W, not 0, when divisible
    return (unpadded_numel + padding_numel) // world_size


@pytest.mark.parametrize(
    ("broken_shard_numel", "minimal"),
    [(_floor_shard_numel, (1, 2)), (_full_shard_pad_numel, (0, 1))],
    ids=["floor_instead_of_ceil", "padding_w_minus_remainder"],
)
def test_hypothesis_shrinks_broken_padding_to_the_classic_case(broken_shard_numel, minimal):
    counterexample = find(
        strategies.numels_and_world_sizes(),
        lambda case: padding_violation(*case, broken_shard_numel(*case)) is not None,
        settings=settings(max_examples=500, database=None, derandomize=True),
    )
    assert counterexample == minimal, f"shrunk to (unpadded_numel, world_size)={counterexample}, expected {minimal}"
    assert padding_violation(*counterexample, shard_numel_for(*counterexample)) is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: strategies.world_sizes(min_value=0),
        lambda: strategies.world_sizes(min_value=9, max_value=8),
        lambda: strategies.sizes_with_numel(-1),
        lambda: strategies.sizes_with_numel(0, max_dims=0),
        lambda: strategies.hard_numels(world_size=0),
        lambda: strategies.size_lists(world_size=4, max_params=0),
        lambda: strategies.flat_layouts(max_numel=-1),
    ],
)
def test_strategies_reject_impossible_arguments(make):
    with pytest.raises(InvalidArgument):
        make()
