"""The adapter interface every implementation under test satisfies, and what a rank hands it.

Built in (one module each): `ours` (impl/), `fsdp2` (torch.distributed.fsdp.fully_shard), `ddp`
(DistributedDataParallel) and `single` (the plain module, no process group: the reference);
harness/adapters/registry.py resolves `--impls` names. A user's implementation needs no edit here:
pass `--impls my_pkg.my_mod:MyAdapter` or `--impls path/to/file.py:MyAdapter`, naming a class (or
instance) that satisfies `Adapter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    group: dist.ProcessGroup | None  # None: no process group (W = 1, impl=single)
    device: torch.device = torch.device("cpu")


@dataclass(frozen=True)
class RawShard:
    """One rank's raw shard of one flat parameter, padding included (for the padding check)."""

    key: str  # '<unit fqn>/<flat param name>'
    data: torch.Tensor  # (shard_numel,)
    grad: torch.Tensor | None  # (shard_numel,) or None
    padding_intervals: tuple[tuple[int, int], ...]  # every padding run, shard-local [start, end)


@runtime_checkable
class Adapter(Protocol):
    name: str
    needs_process_group: bool

    def wrap(self, model: nn.Module, wrap_paths: tuple[str, ...], ctx: RankContext,
             faults: frozenset[str]) -> nn.Module:
        """Shard/wrap `model` (already holding the reference initial state) for training."""

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full parameters under the plain model's names (a collective; every rank calls it)."""

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full averaged gradients under the plain model's names (after backward, a collective)."""

    def layouts(self, model: nn.Module) -> dict[str, dict]:
        """Per parameter name, how its elements map to ranks (see snapshot.py, 'layouts')."""

    def raw_shards(self, model: nn.Module) -> list[RawShard]:
        """This rank's raw padded shards (no collective); [] when the impl exposes none."""


def set_prefetch(model: nn.Module, wrap_paths: tuple[str, ...]) -> None:
    """Each wrapped unit prefetches the next one in forward and the previous one in backward."""
    units = [model.get_submodule(p) for p in wrap_paths]
    for prev, nxt in zip(units, units[1:]):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])
