"""The one catalog of planted faults: every bug the harness can plant, by name, with what it plants,
the layer it is planted in, what it needs to act and the catalog cases where it acts (standard
library only: the parent, the verbs and the ranks all read it; tests/harness/test_fault_catalog.py keeps it
in step with the seams that plant them).

Layers: "impl" (a hook object at a named seam of our own FSDP, impl/_faults.py SEAMS: impl=ours
only), "collective" (in what torch.distributed delivers, harness/run/dist_faults.py: any
implementation, W > 1), "loop" (in the training loop the harness drives, harness/run/rank.py and
worker.py: any implementation, run and gate only).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from harness.errors import PlanError

LAYERS = ("impl", "collective", "loop")
# In the error of a cell whose requested fault met nothing it acts on (the mutants' n/a).
NEVER_ACTED = "never acted"


@dataclass(frozen=True)
class Fault:
    name: str
    layer: str  # one of LAYERS
    plants: str  # the bug, in one sentence
    needs: str | None = None  # the feature it acts only under (the mutants' n/a), if any
    cases: tuple[str, ...] = ()  # catalog cases with that feature, which the mutants run it on too

    def __post_init__(self) -> None:
        if self.layer not in LAYERS:
            raise ValueError(f"fault {self.name!r}: layer {self.layer!r} is not one of {LAYERS}")


CATALOG: tuple[Fault, ...] = (
    Fault('no_grad_average', 'impl',
          'reduce-scatter sums gradients but never divides by the world size',
          cases=('mixed_precision', 'mixed_precision_bf16_reduce')),
    Fault('padding_garbage_at_init', 'impl',
          'the padded tail of each shard is left non-zero at init'),
    Fault('shard_offset_off_by_one', 'impl',
          'each rank takes its shard one element late when sharding at init'),
    Fault('all_gather_rank_order', 'impl',
          'all-gather places rank shards in reversed order'),
    Fault('drop_last_rank_grad', 'impl',
          "the last rank's reduce-scattered gradient shard is dropped (zeroed)"),
    Fault('grad_padding_garbage', 'impl',
          'gradient padding is not zeroed, so the optimizer steps the padded region'),
    Fault('no_regather_before_backward', 'impl',
          'reshard after forward zeroes the buffer and backward never re-gathers'),
    Fault('tied_param_duplicated', 'impl',
          'a parameter with two names gets two slots, as if in two flat parameters',
          needs='a parameter with two names (tied weights)'),
    Fault('grad_accum_overwrite', 'impl',
          'a second backward overwrites the sharded gradient instead of adding to it',
          needs='gradient accumulation'),
    Fault('grad_scale_1e-5', 'impl',
          'every reduced gradient shard is scaled by (1 + 1e-5): a small systematic error'),
    Fault('grad_scale_1e-6', 'impl',
          'every reduced gradient shard is scaled by (1 + 1e-6): a slow drift'),
    Fault('grad_scale_1e-7', 'impl',
          'every reduced gradient shard is scaled by (1 + 1e-7), about one ulp of fp32: within the per-element '
          'bound, a tilt of the signs of the errors'),
    Fault('grad_shift_one_ulp', 'impl',
          'every non-zero reduced gradient element moves one ulp upward'),
    Fault('master_lost_to_param_dtype', 'impl',
          'mixed precision: the fp32 master shard is overwritten by its param_dtype rounding at every '
          'all-gather',
          needs='mixed precision',
          cases=('mixed_precision', 'mixed_precision_bf16_reduce')),
    Fault('replica_grad_drift', 'impl',
          "HSDP / NO_SHARD: the second replica's gradient is scaled by (1 + 1e-3), so the replicas drift apart",
          needs='replicated shards (HSDP or NO_SHARD)',
          cases=('no_shard', 'hybrid_shard')),
    Fault('grad_nan_one_element', 'impl',
          "the last rank's first gradient element outside padding becomes NaN at its second reduction"),
    Fault('buffers_zeroed_at_wrap', 'impl',
          "fully_shard zeroes the buffers of the modules it wraps (BatchNorm's running variance becomes 0), as "
          "a wrap that re-created the module's storage and copied back its parameters only",
          needs='module buffers',
          cases=('batchnorm',)),
    Fault('unused_params_stepped', 'impl',
          'a parameter that had no gradient on any rank gets a zero one, so the optimizer steps it (weight '
          "decay, moments, AdamW's step count), as when a unit's flat parameter was stepped whole",
          needs='a parameter without a gradient (no loss term reaches it)',
          cases=('unused_head',)),
    Fault('state_gather_rank_order', 'impl',
          "the all-gather behind full state dicts places each rank's shard one slot later (rank r's block lands "
          'at r + 1): the shards stay right, the gathered parameters are wrong'),
    Fault('clip_twice', 'impl',
          'clip_grad_norm_ clips twice: after the first clip it computes the norm of the clipped gradients and '
          'clips by it again (a scale of 1 - 1e-6 / max_norm where clipping acted)',
          needs='gradient-norm clipping',
          cases=('clip_grad_norm',)),
    Fault('clip_norm_world_group', 'impl',
          "clip_grad_norm_ sums the shards' norms over the whole world instead of the shard group: under HSDP "
          'every replica counts again (the norm sqrt(R) times too large)',
          needs='gradient-norm clipping under HSDP (replicated shards)',
          cases=('hybrid_shard_clip',)),
    Fault('grad_sync_every_micro', 'impl',
          'set_requires_gradient_sync(False) is ignored: every micro-batch of an accumulated step '
          'reduce-scatters its gradients (M times the traffic; the sum is the same)',
          needs='gradient accumulation',
          cases=('grad_accumulation',)),
    Fault('reshard_after_forward_ignored', 'impl',
          'reshard_after_forward=False is ignored: parameters are resharded after forward and all-gathered '
          'again in backward (ZeRO-3 where ZeRO-2 was configured)',
          needs='reshard_after_forward=False',
          cases=('reshard_after_forward_false',)),
    Fault('zero1_state_replicated', 'impl',
          'ZeRO-1 runs as ZeRO-0: every rank keeps and steps the whole optimizer state (the same updates, W '
          "times the state's memory)",
          needs='ZeRO-1',
          cases=('zero1',)),
    Fault('mesh_dims_swapped', 'impl',
          "a 2-D mesh is read as (shard, replicate) instead of (replicate, shard): NO_SHARD's (W, 1) mesh "
          'shards over every rank',
          needs='a 2-D mesh (HSDP or NO_SHARD)',
          cases=('no_shard', 'hybrid_shard')),
    Fault('grad_predivide_param_dtype', 'impl',
          'gradients are divided by the data-parallel size before the reduction, in the parameter dtype '
          '(bfloat16 under mixed precision) before the cast to the reduce dtype, and not after: exact at a '
          'power-of-two W, one more rounding of every term at W = 3, 5, 6, 7',
          needs='a world size that is not a power of two'),
    Fault('grad_scale_from_step_6', 'impl',
          'from its 6th reduction on (step 6 where a unit reduces once per step) every reduced gradient shard '
          'is scaled by (1 + 1e-5), as a buffer captured after a warm-up: the first five steps are exact',
          needs='6 steps or more'),
    Fault('reduce_at_last_gradient', 'impl',
          'a unit starts its reduction when its last view gets a gradient on this rank (or at the end of '
          'backward), a moment ranks that give different parameters a gradient do not share: their collectives '
          'fall out of step',
          needs="a parameter one rank's batch gives a gradient and another's does not (split data)"),
    Fault('rank_index_in_6_bits', 'impl',
          "the all-gather writes rank r's shard at block r mod 64 (a rank index kept in 6 bits): the blocks of "
          'ranks 64.. overwrite those of ranks 0.., exact up to 64 ranks',
          needs='more than 64 ranks in a shard group (--backend simulated)'),
    Fault('dist_scale_1e-5', 'collective',
          "every gradient reduction's result (sum or average of floats) is scaled by (1 + 1e-5)"),
    Fault('dist_drop_last_rank', 'collective',
          "the last rank's contribution is missing from every gradient reduction"),
    Fault('dist_rotate_all_gather', 'collective',
          "all-gathers deliver the shards rotated by one rank (rank r's slot holds rank r+1's)"),
    Fault('dist_stale_reduction', 'collective',
          "the second gradient reduction of a given shape and dtype returns the first one's result (a stale "
          'buffer: at step 2 when each unit reduces once per step)'),
    Fault('lr_scheduler_stepped_twice', 'loop',
          'the LR scheduler is stepped twice after every optimizer step, as a loop that steps it beside an '
          'engine that steps it too'),
)
FAULTS: dict[str, Fault] = {f.name: f for f in CATALOG}
if len(FAULTS) != len(CATALOG):
    raise ValueError("a fault is in the catalog twice")


def of_layer(layer: str) -> dict[str, Fault]:
    """The faults of one layer, by name, in the catalog's order."""
    return {f.name: f for f in CATALOG if f.layer == layer}


def split_faults(faults: Iterable[str]) -> tuple[frozenset[str], frozenset[str]]:
    """(faults planted inside impl/, collective faults); the loop's own are neither."""
    faults = frozenset(faults)
    return (frozenset(f for f in faults if f not in FAULTS or FAULTS[f].layer == "impl"),
            frozenset(f for f in faults if f in FAULTS and FAULTS[f].layer == "collective"))


def check_faults(faults: Iterable[str], impls: Iterable[str], loop: bool = True) -> None:
    """The one validation of requested fault names (run/gate --faults, fuzz --faults, mutants
    --only): each is a collective fault (any implementation), a training-loop fault (run and gate:
    `loop`), or a fault planted in impl/, which needs impl=ours among `impls`. PlanError (exit 2)
    naming the known ones otherwise."""
    faults = frozenset(faults)
    loop_faults = sorted(f for f in faults if f in FAULTS and FAULTS[f].layer == "loop")
    if not loop and loop_faults:
        raise PlanError(f"faults {loop_faults} act in the training loop of run and gate; this verb drives its own loop")
    unknown = sorted(faults - FAULTS.keys())
    if unknown:
        raise PlanError(f"unknown fault(s) {unknown}; known: collective faults (any impl) {sorted(of_layer('collective'))}, "
                        f"training-loop faults (any impl, run and gate) {sorted(of_layer('loop'))}, "
                        f"planted in impl/ (impl=ours) {sorted(of_layer('impl'))}")
    impl_faults, _ = split_faults(faults)
    impls = tuple(impls)
    if impl_faults and "ours" not in impls:
        raise PlanError(f"faults {sorted(impl_faults)} are planted in impl/ and apply to --impls ours only, not "
                        f"{','.join(impls)}; the collective faults {sorted(of_layer('collective'))} apply to any "
                        f"implementation")
