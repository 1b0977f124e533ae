"""A from-scratch FSDP (ZeRO-3) with an FSDP2-style API.

    from impl import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters())  # the local shards
"""

from impl._collectives import CommStats
from impl._faults import FAULTS
from impl._flat_param import FlatLayout, shard_numel_for
from impl._state_dict import (
    LocalShard,
    full_grad_dict,
    full_state_dict,
    init_meta_module,
    load_full_state_dict,
    local_shards,
)
from impl.api import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, UnshardHandle, fully_shard,
                      register_fsdp_forward_method, units)
from impl._checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from impl._clip import clip_grad_norm_
from impl._wrap import AnyPolicy, ModuleClassPolicy, SizePolicy, auto_wrap
from impl._zero1 import ZeroRedundancyOptimizer

__all__ = [
    "AnyPolicy",
    "CPUOffloadPolicy",
    "ModuleClassPolicy",
    "OffloadPolicy",
    "SizePolicy",
    "ZeroRedundancyOptimizer",
    "auto_wrap",
    "clip_grad_norm_",
    "load_sharded_checkpoint",
    "save_sharded_checkpoint",
    "FAULTS",
    "CommStats",
    "FSDPModule",
    "FlatLayout",
    "LocalShard",
    "MixedPrecisionPolicy",
    "full_grad_dict",
    "full_state_dict",
    "fully_shard",
    "register_fsdp_forward_method",
    "UnshardHandle",
    "init_meta_module",
    "load_full_state_dict",
    "local_shards",
    "shard_numel_for",
    "units",
]
