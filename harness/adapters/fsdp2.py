"""`fsdp2`: torch.distributed.fsdp.fully_shard, the implementation ours is measured against."""

from __future__ import annotations

import math

import torch

from cases.features import DTYPES, Features
from harness.adapters.base import Adapter, set_prefetch
from harness.adapters.features import make_mesh


class FSDP2(Adapter):
    name = "fsdp2"
    contracts = frozenset({"gradient_sync_off", "no_gather_in_backward", "unsharded", "shard_group", "sharded_state"})
    shards_scalar_params = False  # fully_shard raises on a 0-d parameter

    def unsupported(self, features: Features) -> str | None:
        for field_name, reason in (
            ("auto_wrap", "torch FSDP2 has no auto-wrap policies (FSDP1 had them)"),
            ("zero1", "torch FSDP2 has no optimizer-state-only sharding (ZeRO-1)"),
            ("checkpoint_reshard_at", "not mapped: FSDP2 reshards checkpoints through torch.distributed.checkpoint"),
        ):
            if getattr(features, field_name):
                return reason
        return None

    def wrap(self, model, wrap_paths, ctx):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        features = ctx.features
        if features.mesh == "shard":
            mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
        else:
            mesh = make_mesh(features, ctx.world_size, ctx.device.type)
        kwargs = {"mesh": mesh, "reshard_after_forward": features.reshard_after_forward}
        if features.cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            kwargs["offload_policy"] = CPUOffloadPolicy()
        if features.mixed_precision:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                DTYPES[features.param_dtype], DTYPES[features.reduce_dtype] if features.reduce_dtype else None)
        for path in wrap_paths:
            fully_shard(model.get_submodule(path), **kwargs)
        for group in features.wrap_groups:
            members = [model.get_submodule(path) for path in group]
            fully_shard(members, **kwargs)
            if len({id(fully_shard.state(m)) for m in members}) != 1:
                raise RuntimeError(f"rank {ctx.rank}: fully_shard({list(group)}) left its members in several states")
        fully_shard(model, **kwargs)
        if features.prefetch:
            set_prefetch(model, wrap_paths)
        return model

    def materialize(self, model, init_state, device: torch.device = torch.device("cpu")):
        from torch.distributed.tensor import distribute_tensor

        model.to_empty(device=device)
        with torch.no_grad():  # every rank holds the full reference state: keep this rank's shard
            for name, param in model.named_parameters():
                param.copy_(distribute_tensor(init_state[name], param.device_mesh, param.placements))
            for name, buffer in model.named_buffers():  # whole on every rank; persistent ones are in the state
                if name in init_state:
                    buffer.copy_(init_state[name])

    def layouts(self, model):
        out = {}
        for name, p in model.named_parameters():
            rows = p.size(0) if p.dim() else 1
            world_size = p.device_mesh.size()
            out[name] = {"kind": "dim0", "rows": rows, "chunk_rows": math.ceil(rows / world_size),
                         "world_size": world_size}
        return out
