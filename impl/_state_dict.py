"""Full state dicts under the original names, and meta-device materialisation.

`model.state_dict()` on a wrapped model is a collective: every unit all-gathers its flat
parameters and the hook replaces each parameter's local piece ([Note: Per-parameter shards] in
impl/_handle.py) by the full tensor, under the same names as the plain model's.
`model.load_state_dict(full_sd)` takes full tensors too: a pre-hook slices this rank's pieces out
of them, which the owners then load as their parameters.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn as nn

from impl._flat_param import FlatLayout, unflatten_views, zero_padding_
from impl._handle import FlatParamHandle, gather_full_many
from impl._unit import FSDPUnit, units_with_prefixes


def register_state_dict_hooks(module: nn.Module, unit: FSDPUnit, member: int = 0) -> None:
    """The hooks of `module`, the unit's member `member` ([Note: Module groups] in impl/_unit.py):
    they write and read the names of the parameters relative to it."""
    module.register_state_dict_post_hook(_make_post_hook(unit, member))
    module.register_load_state_dict_pre_hook(
        _make_load_pre_hook(unit) if len(unit.members) == 1 else _make_member_load_pre_hook(unit, member))


# id(handle) -> its full tensors, gathered for every unit at once by full_state_dict (else each
# unit's hook gathers its own).
_GATHERED: ContextVar[dict[int, list[torch.Tensor]] | None] = ContextVar("_GATHERED", default=None)


def _make_post_hook(unit: FSDPUnit, member: int):
    last = member == len(unit.members) - 1  # a group's other members read the gathered tensors too

    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        gathered = _GATHERED.get()
        for handle in unit.handles:
            if gathered is not None and id(handle) in gathered:
                fulls = gathered.pop(id(handle)) if last else gathered[id(handle)]
            else:
                fulls = handle.gather_full()
            for slot, members, full in zip(handle.layout.slots, handle.slot_members, fulls):
                for fqn, j in zip(slot.fqns, members):
                    if j == member:
                        state_dict[prefix + fqn] = full

    return hook


def _make_member_load_pre_hook(unit: FSDPUnit, member: int):
    """A group member's load hook: each of its names gets this rank's piece of the full tensor
    given under it (the elements of the slot inside this rank's shard), which its owner loads."""
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for handle in unit.handles:
            start, _ = handle.layout.shard_bounds(handle.comm.groups.shard_rank)
            sharded = handle.sharded
            for slot, members, (a, b) in zip(handle.layout.slots, handle.slot_members, handle.local_bounds):
                for fqn, j in zip(slot.fqns, members):
                    key = prefix + fqn
                    if j != member:
                        continue
                    if key not in state_dict:
                        error_msgs.append(f"missing original parameters for a sharded unit: {[key]}")
                        continue
                    tensor = state_dict[key]
                    if tuple(tensor.shape) != tuple(slot.size):
                        error_msgs.append(f"size mismatch for {key}: checkpoint {tuple(tensor.shape)}, "
                                          f"model {tuple(slot.size)}")
                        tensor = torch.zeros(slot.size, dtype=sharded.dtype)
                    flat = tensor.to(device=sharded.device, dtype=sharded.dtype).reshape(-1)
                    state_dict[key] = flat[a + start - slot.offset:b + start - slot.offset] if b > a else flat[:0]
            handle.reshard()

    return hook


def _make_load_pre_hook(unit: FSDPUnit):
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for handle in unit.handles:
            missing = [prefix + s.fqn for s in handle.layout.slots if prefix + s.fqn not in state_dict]
            if missing:
                error_msgs.append(f"missing original parameters for a sharded unit: {missing}")
                continue
            full = []
            for slot in handle.layout.slots:
                tensor = state_dict[prefix + slot.fqn]
                if tuple(tensor.shape) != tuple(slot.size):
                    error_msgs.append(
                        f"size mismatch for {prefix + slot.fqn}: checkpoint {tuple(tensor.shape)}, "
                        f"model {tuple(slot.size)}"
                    )
                    tensor = torch.zeros(slot.size, dtype=handle.sharded.dtype)
                full.append(tensor.to(handle.sharded.dtype))
            local = handle.init_sharded_from([t.to(handle.sharded.device) for t in full])
            # Each name gets this rank's piece, which its owner loads into its parameter (the piece).
            for slot, (a, b) in zip(handle.layout.slots, handle.local_bounds):
                for fqn in slot.fqns:
                    state_dict[prefix + fqn] = local[a:b]
            handle.reshard()

    return hook


def _handles(model: nn.Module) -> list[FlatParamHandle]:
    return [h for unit, _ in units_with_prefixes(model) for h in unit.handles]


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors under the plain model's names, on every rank (a collective: every unit's flat
    parameters in one all-gather per bucket, `gather_full_many`)."""
    handles = _handles(model)
    fulls = gather_full_many([(h, h.sharded.detach()) for h in handles])
    token = _GATHERED.set({id(h): f for h, f in zip(handles, fulls)})
    try:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        _GATHERED.reset(token)


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True):
    """The inverse of full_state_dict: every rank keeps its shard of the given full tensors."""
    return model.load_state_dict(state_dict, strict=strict)


def init_meta_module(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Materialise a model built on the meta device and wrapped: `to_empty()`, then each module's
    own `reset_parameters()` run on full (unsharded) parameters, then each rank keeps its shard.

    Modules are reset in `model.modules()` order (the construction order of most models, so the
    random draws match an eager build). A unit's full parameters exist only from the first reset
    that touches them until the last one, as views of one padded buffer from which this rank's
    shard is copied (when the shard is the whole buffer, W_shard = 1, the views are of the
    shard itself): peak memory is the sharded model plus the units in flight, never the model.
    Full parameters are filled with NaN first; a parameter that no reset_parameters() wrote is
    reported by name instead of silently training from uninitialised memory.
    """
    model.to_empty(device=device)
    handles = _handles(model)
    for handle in handles:
        handle.bind_pieces()  # to_empty() gave each piece storage of its own
    handles_of: dict[int, list] = {}  # id(owning module) -> handles holding its parameters
    pending: dict[int, int] = {}  # id(handle) -> owning modules with reset_parameters not yet run
    for handle in handles:
        owner_modules = {id(sub): sub for owners in handle.slot_owners for sub, _ in owners}
        for key, sub in owner_modules.items():
            handles_of.setdefault(key, []).append(handle)
            if callable(getattr(sub, "reset_parameters", None)):
                pending[id(handle)] = pending.get(id(handle), 0) + 1
    fulls: dict[int, torch.Tensor] = {}  # id(handle) -> its padded unsharded buffer
    never: list[str] = []

    def materialise(handle) -> None:
        layout = handle.layout
        in_place = layout.shard_numel == layout.padded_numel and not handle.comm.seams.planted
        padded = handle.sharded.data if in_place else torch.empty(
            layout.padded_numel, dtype=handle.sharded.dtype, device=device)
        padded.fill_(float("nan"))
        zero_padding_(padded, layout.padding_intervals())
        for full, owners in zip(unflatten_views(padded, layout), handle.slot_owners):
            for sub, attr in owners:
                sub.__dict__[attr] = full
        fulls[id(handle)] = padded

    def finish(handle) -> None:
        padded = fulls.pop(id(handle), None)
        if padded is None:
            never.extend(s.fqn for s in handle.layout.slots)
            return
        views = unflatten_views(padded, handle.layout)
        missing = [s.fqn for s, t in zip(handle.layout.slots, views) if torch.isnan(t).any()]
        never.extend(missing)
        if not missing:
            if padded.untyped_storage() is not handle.sharded.untyped_storage():
                handle.sharded.copy_(handle.shard_of_padded(padded, fresh=False))
            handle.reshard()
        for owners in handle.slot_owners:
            for sub, attr in owners:
                sub.__dict__.pop(attr, None)  # forward points the names at views again

    with torch.no_grad():
        for sub in model.modules():
            reset = getattr(sub, "reset_parameters", None)
            if not callable(reset):
                continue
            mine = handles_of.get(id(sub), [])
            for handle in mine:
                if id(handle) not in fulls:
                    materialise(handle)
            reset()
            for handle in mine:
                pending[id(handle)] -= 1
                if pending[id(handle)] == 0:
                    finish(handle)
        for handle in handles:
            if pending.get(id(handle), 0) != 0 or id(handle) not in pending:
                finish(handle)  # owners without reset_parameters(): reported below
    if never:
        raise RuntimeError(
            f"init_meta_module: parameters never materialised by any reset_parameters(): {sorted(set(never))}. "
            f"Fix: give their module a reset_parameters() or load a full state dict instead."
        )
    return model


def full_grad_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full averaged gradients under the plain model's names, on every rank (a collective).

    Parameters whose gradient is None are left out, as `p.grad is None` would be in the plain
    model: a parameter that had no gradient on any rank ([Note: Gradients with their used flags]
    in impl/_handle.py; the same parameters on every rank, so every rank gathers the same shards).
    """
    entries: list[tuple[list, FlatParamHandle, torch.Tensor]] = []  # (member prefixes, handle, shard gradient)
    held: set[int] = set()
    for unit, prefixes in units_with_prefixes(model):
        for handle in unit.handles:
            held.update(id(p) for p in handle.pieces)
            grad = handle.sharded_grad
            if grad is not None:
                entries.append((prefixes, handle, grad.detach()))
    fulls = gather_full_many([(h, g) for _, h, g in entries])
    grads: dict[str, torch.Tensor] = {}
    for (prefixes, handle, _), full in zip(entries, fulls):
        for names, piece, tensor in zip(handle.slot_names(prefixes), handle.pieces, full):
            if piece.grad is not None:
                for name in names:
                    grads[name] = tensor
    for name, param in model.named_parameters():
        if id(param) not in held and param.grad is not None:  # outside every unit: replicated
            grads[name] = param.grad.detach().clone()
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
    names: tuple[tuple[str, ...], ...] = ()  # per slot, its names in the model (tied names share a slot)

    @property
    def padding_intervals(self) -> tuple[tuple[int, int], ...]:
        """[start, end) of every padding run in this shard (alignment gaps and the uniform tail)."""
        return self.layout.local_padding_intervals(self.rank)

    @property
    def padding(self) -> torch.Tensor:
        """Every padding element of this shard, concatenated (a copy)."""
        return torch.cat([self.data[start:end] for start, end in self.padding_intervals] + [self.data[:0]])


def local_shards(model: nn.Module) -> list[LocalShard]:
    """This rank's raw flat-parameter shards (no collective)."""
    shards = []
    for unit, prefixes in units_with_prefixes(model):
        fqn = next((p for p in prefixes if p is not None), "").removesuffix(".")
        for handle in unit.handles:
            param = handle.sharded.detach()
            shards.append(
                LocalShard(
                    unit_fqn=fqn,
                    param_name=handle.param_name,
                    rank=handle.comm.groups.shard_rank,
                    world_size=handle.comm.groups.shard_world_size,
                    layout=handle.layout,
                    data=param.clone(),
                    grad=None if handle.sharded_grad is None else handle.sharded_grad.detach().clone(),
                    names=tuple(tuple(n) for n in handle.slot_names(prefixes)),
                )
            )
    return shards
