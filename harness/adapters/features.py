"""How a case's Features (cases/features.py) turn into calls on an implementation and on the
single-process reference. Adapter-independent pieces live here; adapter-specific ones in their own
modules of harness/adapters/.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from cases.data import map_tensors
from cases.features import Features


def device_available(features: Features) -> str | None:
    """None when the case can run here, else why it is skipped."""
    if features.requires_device == "cuda" and not torch.cuda.is_available():
        return "needs a CUDA device (parameters on the CPU, compute on the GPU); none is visible here"
    return None


def apply_activation_checkpointing(model: nn.Module, paths: tuple[str, ...]) -> None:
    """Recompute these sub-modules' forward in backward (non-reentrant), before any wrapping."""
    for path in paths:
        module = model.get_submodule(path)
        inner = module.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        module.forward = forward


def make_mesh(features: Features, world_size: int, device_type: str = "cpu"):
    """A (replicate, shard) DeviceMesh over the world group for this world size."""
    from torch.distributed.device_mesh import init_device_mesh

    replicate, shard = features.mesh_shape(world_size)
    if replicate == 1:
        return init_device_mesh(device_type, (shard,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


class CastCompute(nn.Module):
    """The plain model computing the way mixed precision does: every forward uses a copy of the
    fp32 parameters cast to `dtype` (the cast is differentiable, so gradients come back cast to
    fp32 onto the master parameters), floating inputs are cast too. Parameter names are the
    plain model's (`named_parameters` delegates)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = model
        self.dtype = dtype

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)

    def forward(self, *args, **kwargs):
        params = {n: p.to(self.dtype) for n, p in self.inner.named_parameters()}
        args, kwargs = map_tensors(lambda a: a.to(self.dtype) if a.is_floating_point() else a, (args, kwargs))
        return functional_call(self.inner, params, args, kwargs)


def floating_output(out):
    """Losses are computed in fp32 whatever the compute dtype, for every implementation alike
    (every floating tensor of an output pytree: a tensor, tuple, dict, ModelOutput)."""
    return map_tensors(lambda t: t.float() if t.is_floating_point() and t.dtype != torch.float32 else t, out)


def all_reduce_mean_copy(tensors: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """The average over ranks of every tensor, as new tensors (an observation, not training)."""
    out = {}
    world_size = dist.get_world_size(group) if group is not None else 1
    for name, t in tensors.items():
        copy = t.detach().clone()
        if group is not None:
            dist.all_reduce(copy, group=group)
            copy /= world_size
        out[name] = copy
    return out
