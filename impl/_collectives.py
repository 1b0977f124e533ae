"""Collectives as free functions that take the process group explicitly.

`group=None` here means "no process group at all" (W = 1): nothing is communicated. The
caller never relies on torch's default group being looked up behind its back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives; torch 2.4 only has the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Bytes each collective kind moved from this rank's point of view (output size)."""

    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    calls_by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + nbytes
        self.calls_by_kind[kind] = self.calls_by_kind.get(kind, 0) + 1

    def reset(self) -> None:
        self.bytes_by_kind.clear()
        self.calls_by_kind.clear()


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_into(
    padded_unsharded: torch.Tensor,
    sharded: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """padded_unsharded <- concat over ranks of `sharded`, in rank order."""
    if group is None:
        padded_unsharded.copy_(sharded)
        return None
    if stats is not None:
        stats.add("all_gather", padded_unsharded)
    return _all_gather_tensor(padded_unsharded, sharded, group=group, async_op=async_op)


def reduce_scatter_sum(
    sharded_out: torch.Tensor,
    padded_unsharded: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """sharded_out <- this rank's shard of the elementwise sum over ranks of `padded_unsharded`.

    async_op=True returns the work in flight (None when nothing is communicated); both tensors
    must stay alive and untouched until it is waited on.
    """
    if group is None:
        sharded_out.copy_(padded_unsharded)
        return None
    work = _reduce_scatter_tensor(sharded_out, padded_unsharded, op=dist.ReduceOp.SUM, group=group,
                                  async_op=async_op)
    if stats is not None:
        stats.add("reduce_scatter", padded_unsharded)
    return work


def all_reduce_sum(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats | None = None
) -> None:
    if group is None:
        return
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    if stats is not None:
        stats.add("all_reduce", tensor)


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    if group is None:
        return
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
