"""`fsdp1`: torch.distributed.fsdp.FullyShardedDataParallel, one variant per sharding strategy.

    fsdp1            FULL_SHARD      (ZeRO-3)
    fsdp1_grad_op    SHARD_GRAD_OP   (ZeRO-2: parameters stay unsharded from forward to backward)
    fsdp1_no_shard   NO_SHARD        (DDP-like: every rank holds the whole flat parameter)
    fsdp1_hybrid     HYBRID_SHARD    on a (replicate 2, shard W / 2) mesh for even W; (1, 1) at W = 1

Every variant uses `use_orig_params=True` (the optimizer sees the original parameters, as views
into the flat shard, and `summon_full_params(with_grads=True)` can gather gradients) and
`device_id=cpu` (FSDP1 otherwise refuses a CPU-only host). Full parameters and gradients come from
the base class (summon_full_params). The raw shards are exposed with their layouts, read from
FSDP1's FlatParameter metadata; FSDP1 fills the alignment padding between parameters with 42 on
purpose (torch/distributed/fsdp/_flat_param.py, _FLAT_PARAM_PADDING_VALUE), so parameter padding
is declared UNSPECIFIED; gradient padding is zero.

At W = 2 `fsdp1_hybrid` is a (2, 1) mesh: FSDP1 turns HYBRID_SHARD with a shard group of one
rank into NO_SHARD and then reduces gradients only within that one-rank group (the known upstream
finding, docs/findings.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from harness.adapters.base import Adapter, Padding, RawShard, plain_name

class FSDP1(Adapter):
    name = "fsdp1"
    contracts = frozenset({"gradient_sync_off", "no_gather_in_backward", "unsharded"})
    param_padding = Padding.UNSPECIFIED  # alignment padding filled with 42
    grad_padding = Padding.ZERO

    def __init__(self, strategy: str = "FULL_SHARD", name: str = "fsdp1") -> None:
        self.strategy = strategy
        self.name = name

    def wrap(self, model, wrap_paths, ctx):
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

        # Features are not mapped yet: Adapter.unsupported skips every feature case, naming them.
        kwargs = {"sharding_strategy": ShardingStrategy[self.strategy], "use_orig_params": True,
                  "device_id": ctx.device}
        if self.strategy == "HYBRID_SHARD":
            kwargs["device_mesh"] = _hybrid_mesh(ctx.world_size, ctx.device.type)
        else:
            kwargs["process_group"] = ctx.group
        for path in wrap_paths:
            parent, _, attr = path.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, FullyShardedDataParallel(model.get_submodule(path), **kwargs))
        return FullyShardedDataParallel(model, **kwargs)

    def layouts(self, model):
        out = {}
        for unit, handle in _handles(model):
            flat = handle.flat_param
            shard_numel, group_size = _shard_geometry(handle)
            offset = 0
            fqns = iter(flat._fqns)
            for numel, is_padding in zip(flat._numels_with_padding, flat._is_padding_mask):
                if not is_padding:
                    fqn = next(fqns)
                    out[f"{unit}.{fqn}" if unit else fqn] = {
                        "kind": "flat", "unit": unit or "<root>", "flat_key": _flat_key(unit),
                        "offset": offset, "shard_numel": shard_numel,
                        "aligned_numel": shard_numel * group_size, "world_size": group_size}
                offset += numel
        return out

    def raw_shards(self, model):
        shards = []
        for unit, handle in _handles(model):
            flat = handle.flat_param
            shard_numel, group_size = _shard_geometry(handle)
            data = _local_shard(flat) if handle.uses_sharded_strategy else flat.data
            rank = handle.rank if group_size > 1 else 0
            padded = _padding_runs(flat, shard_numel * group_size)
            lo, hi = rank * shard_numel, (rank + 1) * shard_numel
            local = tuple((max(a, lo) - lo, min(b, hi) - lo) for a, b in padded if min(b, hi) > max(a, lo))
            grad = flat.grad.detach().clone() if flat.grad is not None else None
            shards.append(RawShard(_flat_key(unit), data.detach().clone(), grad, local))
        return shards


def _flat_key(unit: str) -> str:
    return f"{unit or '<root>'}/flat_param"


def _handles(model: nn.Module):
    """(unit fqn under the plain model's names, FlatParamHandle) of every FSDP1 unit with parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for path, module in model.named_modules():
        if isinstance(module, FullyShardedDataParallel) and module._handle is not None:
            yield plain_name(path + ".")[:-1], module._handle  # the root's path is ''


def _shard_geometry(handle) -> tuple[int, int]:
    """(shard_numel, ranks the flat parameter is split over): NO_SHARD keeps it whole."""
    flat = handle.flat_param
    if not handle.uses_sharded_strategy:
        return flat._unpadded_unsharded_size.numel(), 1
    return _local_shard(flat).numel(), handle.world_size


def _local_shard(flat) -> torch.Tensor:
    # FSDP1 sets _local_shard at its lazy init (the first forward); before that the flat
    # parameter's own data is this rank's shard.
    return flat._local_shard if hasattr(flat, "_local_shard") else flat.data


def _padding_runs(flat, padded_numel: int) -> list[tuple[int, int]]:
    """Every padding run of the unsharded flat parameter: alignment gaps and the tail."""
    runs, offset = [], 0
    for numel, is_padding in zip(flat._numels_with_padding, flat._is_padding_mask):
        if is_padding and numel:
            runs.append((offset, offset + numel))
        offset += numel
    if padded_numel > offset:
        runs.append((offset, padded_numel))
    return runs


def _hybrid_mesh(world_size: int, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    replicate = 2 if world_size % 2 == 0 else 1
    return init_device_mesh(device_type, (replicate, world_size // replicate), mesh_dim_names=("replicate", "shard"))


FSDP1_VARIANTS = {
    "fsdp1": functools.partial(FSDP1, "FULL_SHARD", "fsdp1"),
    "fsdp1_grad_op": functools.partial(FSDP1, "SHARD_GRAD_OP", "fsdp1_grad_op"),
    "fsdp1_no_shard": functools.partial(FSDP1, "NO_SHARD", "fsdp1_no_shard"),
    "fsdp1_hybrid": functools.partial(FSDP1, "HYBRID_SHARD", "fsdp1_hybrid"),
}
