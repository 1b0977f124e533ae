"""The hypothesis strategies of the fuzzer, public for a user's own property tests (the pytest
plugin points to them): `model_specs(world_size)` draws whole models (harness/fuzz/spec.py),
`target_numels` flat sizes on the edges where sharding breaks. Each block's auxiliary parameter is
sized so that its unit's flat numel lands below W, at W*k - 1, W*k, W*k + 1 or on a prime (see
tests/support/strategies.py for the pure layout-level counterparts)."""

from __future__ import annotations

import functools

from hypothesis import strategies as st

from cases.catalog import OptimizerSpec
from harness.fuzz.spec import MAX_NESTING, BlockSpec, ModelSpec

OPTIMIZERS = (
    OptimizerSpec("sgd", lr=0.05),
    OptimizerSpec("sgd", lr=0.05, momentum=0.9),
    OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01),
)
NUMEL_FAMILIES = ("none", "below_w", "w_k_minus_1", "w_k", "w_k_plus_1", "prime")
PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47)


def _own_numel(in_features: int, width: int, bias: bool, tied: bool, gain: bool, fan_out: bool = False,
               unused: bool = False) -> int:
    return (in_features * width + (width if bias else 0) + (width * width if tied else 0) + int(gain)
            + (3 * width * width if fan_out else 0) + (width if unused else 0))


@st.composite
def target_numels(draw, world_size: int, base: int) -> int:
    """An aux numel that puts `base + aux` (the unit's flat numel) on a padding edge, or 0."""
    family = draw(_FAMILIES)
    if family == "none":
        return 0
    if family == "below_w":
        return draw(st.integers(1, max(1, world_size - 1)))  # alone in a small unit, or size 1
    if family == "prime":
        target = draw(_PRIMES)
    else:
        k = draw(st.integers(1, 4))
        target = world_size * k + {"w_k_minus_1": -1, "w_k": 0, "w_k_plus_1": 1}[family]
    return target - base if target > base else max(1, target)


@st.composite
def block_specs(draw, world_size: int, in_features: int, depth: int = 1, scalar_params: bool = True,
                unused_params: bool = False) -> BlockSpec:
    width = draw(st.integers(1, 5))
    bias, tied, gain, frozen, fan_out, unused = (draw(st.booleans()) for _ in range(6))
    # Drawn either way: the same choices give the same other fields.
    gain = gain and scalar_params
    unused = unused and unused_params
    aux = draw(_target_numels(world_size, _own_numel(in_features, width, bias, tied, gain, fan_out, unused)))
    wrap = draw(st.booleans())
    inner = (draw(_inner_block_specs(world_size, width, depth + 1, scalar_params, unused_params))
             if depth < MAX_NESTING else None)
    return BlockSpec(width=width, bias=bias, tied=tied, aux_numel=aux, gain=gain, frozen=frozen, fan_out=fan_out,
                     unused=unused, wrap=not wrap, inner=inner)  # wrap=True shrinks to False: prefer wrapped units


# One strategy object per argument tuple, built once: hypothesis validates and labels every new
# strategy object it draws from, which costs more than the draw itself when a composite builds
# its strategies afresh at every draw. The same strategies, so the same examples per seed.
_FAMILIES = st.sampled_from(NUMEL_FAMILIES)
_PRIMES = st.sampled_from(PRIMES)
_target_numels = functools.cache(target_numels)
_block_specs = functools.cache(block_specs)


@functools.cache
def _inner_block_specs(world_size: int, in_features: int, depth: int, scalar_params: bool,
                       unused_params: bool) -> st.SearchStrategy[BlockSpec | None]:
    return st.none() | _block_specs(world_size, in_features, depth, scalar_params, unused_params)


def model_specs(world_size: int, accumulations: tuple[int, ...] = (1, 2), scalar_params: bool = True,
                unused_params: bool = False) -> st.SearchStrategy[ModelSpec]:
    """Models for a pool of `world_size` ranks (checked here, not at the first draw); with
    `scalar_params` False, none with a 0-d parameter. `unused_params` (off by default) also draws
    blocks with a parameter the forward never reads, which has no gradient: off until the harness
    and impl judge parameters without gradients (issue 30; until then every such model errors with
    'full_grads lack parameters')."""
    if world_size < 1:
        raise ValueError(f"model_specs world_size={world_size} must be >= 1")
    if not accumulations or any(a not in (1, 2) for a in accumulations):
        raise ValueError(f"model_specs accumulations={accumulations} must be a non-empty subset of (1, 2)")
    return _model_specs(world_size, accumulations, scalar_params, unused_params)


@functools.cache  # one strategy object per W (see _block_specs): a drawn W asks for it at every draw
@st.composite
def _model_specs(draw, world_size: int, accumulations: tuple[int, ...], scalar_params: bool,
                 unused_params: bool) -> ModelSpec:
    in_features = draw(st.integers(1, 5))
    blocks, width = [], in_features
    for _ in range(draw(st.integers(1, 3))):
        block = draw(_block_specs(world_size, width, 1, scalar_params, unused_params))
        blocks.append(block)
        while block.inner is not None:
            block = block.inner
        width = block.width
    accumulation = draw(st.sampled_from(accumulations))
    data_mode = draw(st.sampled_from(("split", "identical")))
    return ModelSpec(
        world_size=world_size,
        in_features=in_features,
        out_features=draw(st.integers(1, 3)),
        blocks=tuple(blocks),
        optimizer=draw(st.sampled_from(OPTIMIZERS)),
        steps=draw(st.integers(2, 3)),
        batch_per_rank=accumulation * draw(st.integers(1, 2)),
        accumulation=accumulation,
        sync_every_micro=draw(st.booleans()),
        data_mode=data_mode,
        seed=draw(st.integers(0, 2**16)),
    )


@functools.cache
def _octave(exponent: int, max_world_size: int) -> st.SearchStrategy[int]:
    return st.integers(1 << exponent, min(max_world_size, (2 << exponent) - 1))


def world_sizes_up_to(max_world_size: int) -> st.SearchStrategy[int]:
    """W from 1 to `max_world_size`, as many draws in each octave [2^e, 2^(e+1)) as in any other (so
    W = 1024 is drawn about as often as W in 4..7, not 400 times as often, and costs what it
    costs), shrinking toward the smallest W that still fails ([Note: Fuzzing on simulated ranks]
    in harness/fuzz/simulated.py)."""
    if max_world_size < 1:
        raise ValueError(f"world_sizes_up_to max_world_size={max_world_size} must be >= 1")
    return st.integers(0, max_world_size.bit_length() - 1).flatmap(lambda e: _octave(e, max_world_size))


def warm_up_spec(world_size: int) -> ModelSpec:
    return ModelSpec(world_size, 2, 1, (BlockSpec(width=2, inner=BlockSpec(width=1)),), OPTIMIZERS[0])


def specs_for(world_size: int, impl: str, unused_params: bool = False,
              drawn_world_size: bool = False) -> st.SearchStrategy[ModelSpec]:
    """The models `impl` can take: micro-batches per step as the adapter maps them (an adapter
    that owns the step may map only one), 0-d parameters only where it shards them; parameters
    without gradients only with `unused_params` (see model_specs). `drawn_world_size`: each
    model at a W of its own, up to `world_size` (`world_sizes_up_to`; simulated ranks)."""
    from cases.features import Features
    from harness.adapters.registry import resolve_impl

    adapter = resolve_impl(impl)
    accumulations = (1, 2) if adapter.unsupported(Features(grad_accum=2)) is None else (1,)
    if drawn_world_size:
        return world_sizes_up_to(world_size).flatmap(
            lambda w: model_specs(w, accumulations, adapter.shards_scalar_params, unused_params))
    return model_specs(world_size, accumulations, adapter.shards_scalar_params, unused_params)
