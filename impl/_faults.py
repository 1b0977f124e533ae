"""The fault-injection seams: named, planted sharding bugs, inert unless a unit is built with them.

`fully_shard(..., _faults=frozenset({"no_grad_average"}))` plants them in that unit only. The
catalog exists so the harness can prove its tolerances still catch real bugs (the mutants verb);
no production code path depends on it, and nothing here is global state.

[Note: Fault seams]
Each fault is a subclass of `Seams` overriding the hooks where it acts; `seams_for` builds the
unit's hook object once, at wrap time. impl/ calls every hook on every path and never asks which
fault, if any, is planted: an honest unit gets the base class, whose every hook returns the value
it is given (the honest decision or tensor), so an honest run computes what it would without the
seam, bit for bit. A hook takes the honest value first and returns the value to use; hooks that
act on a tensor in place return that tensor. Several faults in one unit apply in the order of
their names, each to what the previous one returned (`_Chain`).
"""

from __future__ import annotations

from typing import Callable



def validate_faults(faults: frozenset[str]) -> frozenset[str]:
    unknown = sorted(set(faults) - set(SEAMS))
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; known: {sorted(SEAMS)}")
    return frozenset(faults)


class Seams:
    """The hooks of impl/ where a planted fault may act; this base class is the honest behaviour."""

    planted = False  # whether any fault acts through this object

    # -- wrapping (impl/api.py) ------------------------------------------------------------------
    def mesh_groups(self, groups: tuple, has_mesh: bool) -> tuple:
        """(shard group, replicate group) read from the unit's mesh."""
        return groups

    def wrapped_buffers(self, buffers: list):
        """The buffers of the modules fully_shard just wrapped (not those of wrapped sub-units)."""
        return buffers

    def shares_tied(self, shared: bool) -> bool:
        """Whether a parameter reached under a second name shares the first name's slot."""
        return shared

    def reshard_after_forward(self, configured: bool | None) -> bool | None:
        return configured

    # -- sharding at init (impl/_handle.py) -------------------------------------------------------
    def shard_bounds(self, cut: tuple):
        """((start, end), padded buffer) this rank's shard is cut from: one value, as every hook
        takes and returns, so that several faults fold through it (`_Chain`)."""
        return cut

    def init_padding_value(self, value: float) -> float:
        """What the padded tail of a shard holds after sharding at init and when re-zeroed."""
        return value

    # -- all-gather -------------------------------------------------------------------------------
    def cast_for_gather(self, cast, master):
        """The shard cast to the parameter dtype for the all-gather (`master`: the fp32 shard)."""
        return cast

    def gathered(self, out, shard_world_size: int):
        """The unsharded buffer just all-gathered from `shard_world_size` > 1 shards, in place."""
        return out

    def regathers_for_backward(self, regather: bool) -> bool:
        """Whether resharding after forward frees the buffer (backward gathers it again)."""
        return regather

    # -- gradient reduction -----------------------------------------------------------------------
    def gradient_sync(self, requested: bool) -> bool:
        """Whether this backward reduces (set_requires_gradient_sync's choice)."""
        return requested

    def used_slots(self, used: list[bool]) -> list[bool]:
        """Per slot of a flat parameter, whether some rank had a gradient for it in the reduction
        just completed ([Note: Gradients with their used flags] in impl/_handle.py)."""
        return used

    def reduce_at_last_gradient(self, at_last: bool) -> bool:
        """Whether a unit reduces as soon as its last view got a gradient on this rank, instead of
        at the next point every rank agrees on ([Note: Rank-consistent reductions] in impl/_unit.py)."""
        return at_last

    def before_reduce(self, padded_grad, data_parallel_size: int):
        """The packed gradient handed to the reduction, before its cast to the reduce dtype."""
        return padded_grad

    def average_divisor(self, divisor: int) -> int:
        """What the reduced gradient sum is divided by to give the average."""
        return divisor

    def averaged(self, sharded_grad, handle, comm):
        """The averaged gradient shard of `handle`'s reduction, in place, before padding is zeroed."""
        return sharded_grad

    def gradient_padding_value(self, value: float) -> float:
        """What the padding of a reduced gradient shard is set to."""
        return value

    def accumulates(self, accumulate: bool) -> bool:
        """Whether a second reduction in one step adds into the shard gradient (or replaces it)."""
        return accumulate

    # -- optimizer, clipping, state dicts ---------------------------------------------------------
    def zero1_whole_state(self, whole: bool) -> bool:
        """Whether ZeRO-1 steps every slot of the buffer on every rank."""
        return whole

    def gathered_blocks(self, blocks):
        """The (W, numel) blocks of a state-dict all-gather, one row per rank of the shard group,
        before they are read rank after rank (`gather_full_many` in impl/_handle.py)."""
        return blocks

    def clip_norm_group(self, shard_group):
        """The group the shards' partial norms are summed over (impl/_clip.py)."""
        return shard_group

    def clip_times(self, times: int) -> int:
        """How many times clip_grad_norm_ clips (impl/_clip.py)."""
        return times


class _Planted(Seams):
    planted = True


def _answering(hook: str, value) -> Callable[[], Seams]:
    """A fault whose one act is to answer `hook` with `value`, whatever the honest answer."""
    return type(f"_Answering_{hook}", (_Planted,), {hook: lambda self, honest, *context: value})


class _ShardOffsetOffByOne(_Planted):
    def shard_bounds(self, cut: tuple):
        import torch

        (start, end), padded = cut
        return (start + 1, end + 1), torch.cat([padded, padded.new_zeros(1)])


class _AllGatherRankOrder(_Planted):
    def gathered(self, out, shard_world_size: int):
        import torch

        return out.copy_(torch.cat(list(reversed(out.chunk(shard_world_size)))))


class _RankIndexIn6Bits(_Planted):
    """The all-gather writes rank r's shard at block r mod 64, as a rank index kept in 6 bits would:
    with more than 64 ranks the blocks of ranks 64.. overwrite those of ranks 0.. and their own
    blocks stay zero. Honest at every world size up to 64."""

    BITS = 6

    def gathered(self, out, shard_world_size: int):
        if shard_world_size <= 1 << self.BITS:
            return out
        blocks = out.view(shard_world_size, -1)
        for r in range(1 << self.BITS, shard_world_size):
            blocks[r % (1 << self.BITS)].copy_(blocks[r])
            blocks[r].zero_()
        return out


class _LastRank(_Planted):
    """A fault that acts on the last rank of the shard group only."""

    @staticmethod
    def on_last_rank(comm) -> bool:
        return comm.groups.shard_rank == comm.groups.shard_world_size - 1


class _DropLastRankGrad(_LastRank):
    def averaged(self, sharded_grad, handle, comm):
        return sharded_grad.zero_() if self.on_last_rank(comm) else sharded_grad


class _ScaleGrad(_Planted):
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def averaged(self, sharded_grad, handle, comm):
        return sharded_grad.mul_(1 + self.scale)


class _GradShiftOneUlp(_Planted):
    def averaged(self, sharded_grad, handle, comm):
        import torch

        up = torch.nextafter(sharded_grad, torch.full_like(sharded_grad, float("inf")))
        return sharded_grad.copy_(torch.where(sharded_grad != 0, up, sharded_grad))


class _MasterLostToParamDtype(_Planted):
    def cast_for_gather(self, cast, master):
        import torch

        if cast is not master:
            with torch.no_grad():
                master.copy_(cast.to(master.dtype))
        return cast


class _ReplicaGradDrift(_Planted):
    def averaged(self, sharded_grad, handle, comm):
        import torch.distributed as dist

        if comm.groups.replicate_group is not None and dist.get_rank(comm.groups.replicate_group) == 1:
            sharded_grad.mul_(1 + 1e-3)
        return sharded_grad


class _GradNanOneElement(_LastRank):
    def __init__(self) -> None:
        self.reductions: dict[int, int] = {}

    def averaged(self, sharded_grad, handle, comm):
        if self.on_last_rank(comm):
            self.reductions[id(handle)] = count = self.reductions.get(id(handle), 0) + 1
            if count == 2:  # not in padding, which the reduction zeroes next
                at = _first_outside(handle.layout.local_padding_intervals(comm.groups.shard_rank), sharded_grad.numel())
                if at is not None:
                    sharded_grad[at] = float("nan")
        return sharded_grad


def _first_outside(intervals, numel: int) -> int | None:
    """The first index of [0, numel) in none of the [start, end) `intervals`, or None."""
    at = 0
    for start, end in sorted(intervals):
        if start > at:
            break
        at = max(at, end)
    return at if at < numel else None


class _BuffersZeroedAtWrap(_Planted):
    def wrapped_buffers(self, buffers: list):
        import torch

        with torch.no_grad():
            for b in buffers:
                b.zero_()
        return buffers


class _StepUnusedParams(_Planted):
    def used_slots(self, used: list[bool]) -> list[bool]:
        return [True] * len(used)


class _StateGatherRankOrder(_Planted):
    def gathered_blocks(self, blocks):
        return blocks.roll(1, dims=0)


class _ClipTwice(_Planted):
    def clip_times(self, times: int) -> int:
        return 2 * times


class _ClipNormWorldGroup(_Planted):
    def clip_norm_group(self, shard_group):
        import torch.distributed as dist

        return dist.group.WORLD if dist.is_initialized() else shard_group  # every rank of the world


class _MeshDimsSwapped(_Planted):
    def mesh_groups(self, groups: tuple, has_mesh: bool) -> tuple:
        shard, replicate = groups
        return (replicate, shard) if has_mesh and replicate is not None else groups


class _PredivideInParamDtype(_Planted):
    def before_reduce(self, padded_grad, data_parallel_size: int):
        return padded_grad / data_parallel_size if data_parallel_size > 1 else padded_grad

    def average_divisor(self, divisor: int) -> int:
        return 1


class _ScaleFromStep6(_Planted):
    def __init__(self) -> None:
        self.reductions: dict[int, int] = {}

    def averaged(self, sharded_grad, handle, comm):
        self.reductions[id(handle)] = count = self.reductions.get(id(handle), 0) + 1
        return sharded_grad.mul_(1 + 1e-5) if count >= 6 else sharded_grad


SEAMS: dict[str, Callable[[], Seams]] = {
    "no_grad_average": _answering("average_divisor", 1),
    "padding_garbage_at_init": _answering("init_padding_value", 1.0),
    "shard_offset_off_by_one": _ShardOffsetOffByOne,
    "all_gather_rank_order": _AllGatherRankOrder,
    "drop_last_rank_grad": _DropLastRankGrad,
    "grad_padding_garbage": _answering("gradient_padding_value", 1.0),
    "no_regather_before_backward": _answering("regathers_for_backward", False),
    "tied_param_duplicated": _answering("shares_tied", False),
    "grad_accum_overwrite": _answering("accumulates", False),
    "grad_scale_1e-5": lambda: _ScaleGrad(1e-5),
    "grad_scale_1e-6": lambda: _ScaleGrad(1e-6),
    "grad_scale_1e-7": lambda: _ScaleGrad(1e-7),
    "grad_shift_one_ulp": _GradShiftOneUlp,
    "master_lost_to_param_dtype": _MasterLostToParamDtype,
    "replica_grad_drift": _ReplicaGradDrift,
    "grad_nan_one_element": _GradNanOneElement,
    "buffers_zeroed_at_wrap": _BuffersZeroedAtWrap,
    "unused_params_stepped": _StepUnusedParams,
    "state_gather_rank_order": _StateGatherRankOrder,
    "clip_twice": _ClipTwice,
    "clip_norm_world_group": _ClipNormWorldGroup,
    "grad_sync_every_micro": _answering("gradient_sync", True),
    "reshard_after_forward_ignored": _answering("reshard_after_forward", True),
    "zero1_state_replicated": _answering("zero1_whole_state", True),
    "mesh_dims_swapped": _MeshDimsSwapped,
    "grad_predivide_param_dtype": _PredivideInParamDtype,
    "grad_scale_from_step_6": _ScaleFromStep6,
    "reduce_at_last_gradient": _answering("reduce_at_last_gradient", True),
    "rank_index_in_6_bits": _RankIndexIn6Bits,
}
# The faults impl/ can plant, by name (what each plants: the harness's fault catalog, harness/faults.py).
FAULTS: tuple[str, ...] = tuple(SEAMS)


def _folding(name: str):
    def hook(self, value, *context):
        for seam in self.seams:
            value = getattr(seam, name)(value, *context)
        return value
    hook.__name__ = name
    return hook


class _Chain(_Planted):
    """Several planted faults in one unit, each hook applied in turn (faults in name order)."""

    def __init__(self, seams: list[Seams]) -> None:
        self.seams = seams


for _name in [n for n, v in vars(Seams).items() if callable(v) and not n.startswith("_")]:
    setattr(_Chain, _name, _folding(_name))


def seams_for(faults: frozenset[str]) -> Seams:
    """The hook object of a unit built with `faults` (the honest base class when there are none)."""
    planted = [SEAMS[name]() for name in sorted(validate_faults(faults))]
    if not planted:
        return Seams()
    return planted[0] if len(planted) == 1 else _Chain(planted)
