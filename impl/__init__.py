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
from impl.api import FSDPModule, MixedPrecisionPolicy, fully_shard, units

__all__ = [
    "FAULTS",
    "CommStats",
    "FSDPModule",
    "FlatLayout",
    "LocalShard",
    "MixedPrecisionPolicy",
    "full_grad_dict",
    "full_state_dict",
    "fully_shard",
    "init_meta_module",
    "load_full_state_dict",
    "local_shards",
    "shard_numel_for",
    "units",
]
