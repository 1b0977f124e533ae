"""The fault-injection seam: named, planted sharding bugs, inert unless a unit is built with them.

`fully_shard(..., _faults=frozenset({"no_grad_average"}))` enables them for that unit only; with
the default empty set every check below is a set-membership test that is never true. The
catalog exists so the harness can prove its tolerances still catch real bugs (the mutants
verb); no production code path depends on it. Nothing here is global state.

Newer faults reach impl/ as hook objects at named seams instead (`Seams`, built once per unit by
`seams_for`): an honest unit gets the base class, whose every hook changes nothing, so production
code calls the hook without asking which fault, if any, is planted.
"""

from __future__ import annotations

FAULTS: dict[str, str] = {
    "no_grad_average": "reduce-scatter sums gradients but never divides by the world size",
    "padding_garbage_at_init": "the padded tail of each shard is left non-zero at init",
    "shard_offset_off_by_one": "each rank takes its shard one element late when sharding at init",
    "all_gather_rank_order": "all-gather places rank shards in reversed order",
    "drop_last_rank_grad": "the last rank's reduce-scattered gradient shard is dropped (zeroed)",
    "grad_padding_garbage": "gradient padding is not zeroed, so the optimizer steps the padded region",
    "no_regather_before_backward": "reshard after forward zeroes the buffer and backward never re-gathers",
    "tied_param_duplicated": "a parameter with two names gets two slots, as if in two flat parameters",
    "grad_accum_overwrite": "a second backward overwrites the sharded gradient instead of adding to it",
    "grad_scale_1e-5": "every reduced gradient shard is scaled by (1 + 1e-5): a small systematic error",
    "grad_scale_1e-6": "every reduced gradient shard is scaled by (1 + 1e-6): a slow drift",
    "grad_scale_1e-7": "every reduced gradient shard is scaled by (1 + 1e-7), about one ulp of fp32: within "
                       "the per-element bound, a tilt of the signs of the errors",
    "grad_shift_one_ulp": "every non-zero reduced gradient element moves one ulp upward",
    "master_lost_to_param_dtype": "mixed precision: the fp32 master shard is overwritten by its param_dtype "
                                  "rounding at every all-gather",
    "replica_grad_drift": "HSDP / NO_SHARD: the second replica's gradient is scaled by (1 + 1e-3), so the "
                          "replicas drift apart",
    "grad_nan_one_element": "the last rank's first gradient element becomes NaN at its second reduction",
    "buffers_zeroed_at_wrap": "fully_shard zeroes the buffers of the modules it wraps (BatchNorm's running "
                              "variance becomes 0), as a wrap that re-created the module's storage and copied "
                              "back its parameters only",
    "unused_params_stepped": "a parameter that had no gradient on any rank gets a zero one, so the optimizer "
                             "steps it (weight decay, moments, AdamW's step count), as when a unit's flat "
                             "parameter was stepped whole",
    "state_gather_rank_order": "the all-gather behind full state dicts places each rank's shard one slot "
                               "later (rank r's block lands at r + 1): the shards stay right, the gathered "
                               "parameters are wrong",
    "clip_twice": "clip_grad_norm_ clips twice: after the first clip it computes the norm of the clipped "
                  "gradients and clips by it again (a scale of 1 - 1e-6 / max_norm where clipping acted)",
    "clip_norm_world_group": "clip_grad_norm_ sums the shards' norms over the whole world instead of the shard "
                             "group: under HSDP every replica counts again (the norm sqrt(R) times too large)",
    "grad_sync_every_micro": "set_requires_gradient_sync(False) is ignored: every micro-batch of an accumulated "
                             "step reduce-scatters its gradients (M times the traffic; the sum is the same)",
    "reshard_after_forward_ignored": "reshard_after_forward=False is ignored: parameters are resharded after forward "
                                     "and all-gathered again in backward (ZeRO-3 where ZeRO-2 was configured)",
    "zero1_state_replicated": "ZeRO-1 runs as ZeRO-0: every rank keeps and steps the whole optimizer state (the "
                              "same updates, W times the state's memory)",
    "mesh_dims_swapped": "a 2-D mesh is read as (shard, replicate) instead of (replicate, shard): NO_SHARD's (W, 1) "
                         "mesh shards over every rank",
    "grad_predivide_param_dtype": "gradients are divided by the data-parallel size before the reduction, in the "
                                  "parameter dtype (bfloat16 under mixed precision) before the cast to the reduce "
                                  "dtype, and not after: exact at a power-of-two W, one more rounding of every term "
                                  "at W = 3, 5, 6, 7",
    "grad_scale_from_step_6": "from its 6th reduction on (step 6 where a unit reduces once per step) every reduced "
                              "gradient shard is scaled by (1 + 1e-5), as a buffer captured after a warm-up: the "
                              "first five steps are exact",
    "reduce_at_last_gradient": "a unit starts its reduction when its last view gets a gradient on this rank (or at "
                               "the end of backward), a moment ranks that give different parameters a gradient "
                               "do not share: their collectives fall out of step",
}
GRAD_SCALE_FAULTS = {"grad_scale_1e-5": 1e-5, "grad_scale_1e-6": 1e-6, "grad_scale_1e-7": 1e-7}


def validate_faults(faults: frozenset[str]) -> frozenset[str]:
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; known: {sorted(FAULTS)}")
    return frozenset(faults)


class Seams:
    """The hooks of impl/ where a planted fault may act; this base class is the honest behaviour."""

    def used_slots(self, used: list[bool]) -> list[bool]:
        """Per slot of a flat parameter, whether some rank had a gradient for it in the reduction
        just completed ([Note: Gradients with their used flags] in impl/_handle.py)."""
        return used

    def reduce_at_last_gradient(self) -> bool:
        """Whether a unit reduces as soon as its last view got a gradient on this rank, instead of
        at the next point every rank agrees on ([Note: Rank-consistent reductions] in impl/_unit.py)."""
        return False


    def gathered_blocks(self, blocks):
        """The (W, numel) blocks of a state-dict all-gather, one row per rank of the shard group,
        before they are read rank after rank (`gather_full_many` in impl/_handle.py)."""
        return blocks

    def clip_norm_group(self, shard_group):
        """The group the shards' partial norms are summed over (impl/_clip.py)."""
        return shard_group

    def clip_times(self) -> int:
        """How many times clip_grad_norm_ clips (impl/_clip.py)."""
        return 1

    def before_reduce(self, padded_grad, data_parallel_size: int):
        """The packed gradient handed to the reduction, before its cast to the reduce dtype."""
        return padded_grad

    def average_divisor(self, data_parallel_size: int) -> int:
        """What the reduced gradient sum is divided by to give the average."""
        return data_parallel_size

    def averaged(self, handle, sharded_grad) -> None:
        """The averaged gradient shard of `handle`'s reduction, in place, before padding is zeroed."""


class _ClipTwice(Seams):
    def clip_times(self) -> int:
        return 2


class _ClipNormWorldGroup(Seams):
    def clip_norm_group(self, shard_group):
        import torch.distributed as dist

        return dist.group.WORLD if dist.is_initialized() else shard_group  # every rank of the world


class _PredivideInParamDtype(Seams):
    def before_reduce(self, padded_grad, data_parallel_size: int):
        return padded_grad / data_parallel_size if data_parallel_size > 1 else padded_grad

    def average_divisor(self, data_parallel_size: int) -> int:
        return 1


class _ScaleFromStep6(Seams):
    def __init__(self) -> None:
        self.reductions: dict[int, int] = {}

    def averaged(self, handle, sharded_grad) -> None:
        self.reductions[id(handle)] = count = self.reductions.get(id(handle), 0) + 1
        if count >= 6:
            sharded_grad.mul_(1 + 1e-5)


class _StepUnusedParams(Seams):
    def used_slots(self, used: list[bool]) -> list[bool]:
        return [True] * len(used)


class _StateGatherRankOrder(Seams):
    def gathered_blocks(self, blocks):
        return blocks.roll(1, dims=0)


class _ReduceAtLastGradient(Seams):
    def reduce_at_last_gradient(self) -> bool:
        return True


SEAM_FAULTS: dict[str, type[Seams]] = {"unused_params_stepped": _StepUnusedParams,
                                       "reduce_at_last_gradient": _ReduceAtLastGradient,
                                       "state_gather_rank_order": _StateGatherRankOrder,
                                       "clip_twice": _ClipTwice, "clip_norm_world_group": _ClipNormWorldGroup,
                                       "grad_predivide_param_dtype": _PredivideInParamDtype,
                                       "grad_scale_from_step_6": _ScaleFromStep6}


def seams_for(faults: frozenset[str]) -> Seams:
    """The hook object of a unit built with `faults` (the honest one when none acts at a seam)."""
    planted = sorted(set(faults) & SEAM_FAULTS.keys())
    if len(planted) > 1:
        raise ValueError(f"faults {planted} act at the same seams; plant one of them at a time")
    return SEAM_FAULTS[planted[0]]() if planted else Seams()
