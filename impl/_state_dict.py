"""Full state dicts under the original names, and meta-device materialisation.

`model.state_dict()` on a wrapped model is a collective: every unit all-gathers its flat
parameters and the hook replaces the flat-parameter entries by the original names, so the keys
equal those of the plain model. `model.load_state_dict(full_sd)` takes original names too: a
pre-hook slices this rank's shard out of the full tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from impl._flat_param import FlatLayout
from impl._unit import FSDPUnit


def register_state_dict_hooks(module: nn.Module, unit: FSDPUnit) -> None:
    module.register_state_dict_post_hook(_make_post_hook(unit))
    module.register_load_state_dict_pre_hook(_make_load_pre_hook(unit))


def _make_post_hook(unit: FSDPUnit):
    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        for handle in unit.handles:
            state_dict.pop(prefix + handle.param_name, None)
            for slot, full in zip(handle.layout.slots, handle.gather_full()):
                for fqn in slot.fqns:
                    state_dict[prefix + fqn] = full

    return hook


def _make_load_pre_hook(unit: FSDPUnit):
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for handle in unit.handles:
            if prefix + handle.param_name in state_dict:
                continue  # already in flat form
            missing = [prefix + s.fqn for s in handle.layout.slots if prefix + s.fqn not in state_dict]
            if missing:
                error_msgs.append(f"missing original parameters for a sharded unit: {missing}")
                state_dict[prefix + handle.param_name] = handle.sharded.detach()
                continue
            full = []
            for slot in handle.layout.slots:
                tensor = state_dict.pop(prefix + slot.fqn)
                for tied in slot.fqns[1:]:
                    state_dict.pop(prefix + tied, None)
                if tuple(tensor.shape) != tuple(slot.size):
                    error_msgs.append(
                        f"size mismatch for {prefix + slot.fqn}: checkpoint {tuple(tensor.shape)}, "
                        f"model {tuple(slot.size)}"
                    )
                    tensor = torch.zeros(slot.size, dtype=handle.sharded.dtype)
                full.append(tensor.to(handle.sharded.dtype))
            local = handle.init_sharded_from([t.to(handle.sharded.device) for t in full])
            state_dict[prefix + handle.param_name] = local
            handle.reshard()

    return hook


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors under the plain model's names, on every rank (a collective)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True):
    """The inverse of full_state_dict: every rank keeps its shard of the given full tensors."""
    return model.load_state_dict(state_dict, strict=strict)


def init_meta_module(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Materialise a model built on the meta device and wrapped: `to_empty()`, then each module's
    own `reset_parameters()` run on full (unsharded) parameters, then each rank keeps its shard.

    Full parameters are filled with NaN first; a parameter that no reset_parameters() wrote is
    reported by name instead of silently training from uninitialised memory.
    """
    model.to_empty(device=device)
    units = [m.__dict__["_fsdp_unit"] for m in model.modules() if "_fsdp_unit" in m.__dict__]
    full_by_handle = {}
    with torch.no_grad():
        for unit in units:
            for handle in unit.handles:
                fulls = [torch.full(s.size, float("nan"), dtype=handle.sharded.dtype, device=device) for s in handle.layout.slots]
                for full, owners in zip(fulls, handle.slot_owners):
                    for sub, attr in owners:
                        sub.__dict__[attr] = full
                full_by_handle[id(handle)] = (handle, fulls)
        for sub in model.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
        never = []
        for handle, fulls in full_by_handle.values():
            for slot, full in zip(handle.layout.slots, fulls):
                if full.is_floating_point() and torch.isnan(full).any():
                    never.append(slot.fqn)
            if not never:
                handle.sharded.copy_(handle.init_sharded_from(fulls))
                handle.reshard()
            for owners in handle.slot_owners:
                for sub, attr in owners:
                    sub.__dict__.pop(attr, None)  # forward points the names at views again
    if never:
        raise RuntimeError(
            f"init_meta_module: parameters never materialised by any reset_parameters(): {never}. "
            f"Fix: give their module a reset_parameters() or load a full state dict instead."
        )
    return model


def full_grad_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full averaged gradients under the plain model's names, on every rank (a collective).

    Parameters whose gradient is None are left out, as `p.grad is None` would be in the plain
    model; a flat parameter with a gradient reports every slot (zeros where nothing flowed).
    """
    grads: dict[str, torch.Tensor] = {}
    for fqn, module in model.named_modules():
        unit = module.__dict__.get("_fsdp_unit")
        prefix = f"{fqn}." if fqn else ""
        for name, param in module._parameters.items():
            if param is None or param.grad is None:
                continue
            handle = next((h for h in unit.handles if h.param_name == name), None) if unit else None
            if handle is None:
                grads[prefix + name] = param.grad.detach().clone()
                continue
            for slot, full in zip(handle.layout.slots, handle.gather_full(param.grad.detach())):
                for tied in slot.fqns:
                    grads[prefix + tied] = full
    return grads


@dataclass(frozen=True)
class LocalShard:
    """One rank's raw shard of one flat parameter, padding included, and where things lie in it."""

    unit_fqn: str
    param_name: str
    rank: int
    world_size: int
    layout: FlatLayout
    data: torch.Tensor  # (shard_numel,), a detached clone
    grad: torch.Tensor | None

    @property
    def padding(self) -> torch.Tensor:
        start, end = self.layout.local_padding_bounds(self.rank)
        return self.data[start:end]


def local_shards(model: nn.Module) -> list[LocalShard]:
    """This rank's raw flat-parameter shards (no collective)."""
    shards = []
    for fqn, module in model.named_modules():
        unit = module.__dict__.get("_fsdp_unit")
        for handle in unit.handles if unit else ():
            param = handle.sharded.detach()
            shards.append(
                LocalShard(
                    unit_fqn=fqn,
                    param_name=handle.param_name,
                    rank=handle.comm.shard_rank,
                    world_size=handle.comm.shard_world_size,
                    layout=handle.layout,
                    data=param.clone(),
                    grad=None if handle.sharded.grad is None else handle.sharded.grad.detach().clone(),
                )
            )
    return shards
