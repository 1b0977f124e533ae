"""Global gradient-norm clipping across shards, equal to the unsharded clip_grad_norm_."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from impl._collectives import all_reduce_max, all_reduce_sum
from impl._faults import Seams
from impl.api import units


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of every parameter of `model` by their global norm; return the norm.

    Each unit's local shard contributes sum |g|^p (or max |g| for inf) over its shard group; the
    padding is zero after every reduce-scatter and so contributes nothing. Parameters outside any
    unit (replicated) contribute once, not once per rank. A collective: call it on every rank.
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type} must be > 0 (or inf)")
    sharded, replicated, group, held, seams = [], [], None, set(), Seams()
    for _, unit in units(model):
        for handle in unit.handles:
            held.update(id(p) for p in handle.pieces)
            seams = handle.comm.seams
            grad = handle.sharded_grad  # the pieces' gradients are slices of it
            if grad is None:
                continue
            if group is not None and handle.comm.groups.shard_group is not group:
                raise ValueError("clip_grad_norm_: units shard over different process groups")
            group = handle.comm.groups.shard_group
            sharded.append(grad)
    replicated = [p.grad for p in model.parameters() if id(p) not in held and p.grad is not None]
    grads = sharded + replicated
    if not grads:
        return torch.tensor(0.0)
    first = None
    for _ in range(seams.clip_times(1)):
        total = _total_norm(sharded, replicated, norm_type, seams.clip_norm_group(group), grads[0].device)
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(clip_coef.to(g.dtype))
        first = total if first is None else first
    return first


def _total_norm(sharded: list[torch.Tensor], replicated: list[torch.Tensor], norm_type: float, group,
                device: torch.device) -> torch.Tensor:
    """The global norm of the local shards' gradients (summed, or maxed, over `group`) and the
    replicated parameters' (counted once)."""
    if math.isinf(norm_type):
        local = torch.stack([g.detach().abs().max() for g in sharded]).max() if sharded else torch.zeros((), device=device)
        total = local.to(torch.float32)
        all_reduce_max(total, group)
        if replicated:
            total = torch.maximum(total, torch.stack([g.detach().abs().max() for g in replicated]).max().float())
        return total
    local = sum((g.detach().float().abs().pow(norm_type).sum() for g in sharded), torch.zeros((), device=device))
    all_reduce_sum(local, group)
    rep = sum((g.detach().float().abs().pow(norm_type).sum() for g in replicated), torch.zeros((), device=device))
    return (local + rep).pow(1.0 / norm_type)
