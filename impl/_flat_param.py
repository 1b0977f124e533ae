"""One unit's flat parameter: layout, uniform padding and views.

Pure tensor code, no process group: everything here is testable in one process.

[Note: Uniform padding]
`all_gather_into_tensor` and `reduce_scatter_tensor` need every rank's shard to have the same
numel, and the unsharded buffer to be exactly W shards long. A flat parameter of `unpadded_numel`
elements is therefore padded at its tail to `padded_numel = W * ceil(unpadded_numel / W)`; rank r
owns elements [r * shard_numel, (r + 1) * shard_numel). The padding (fewer than W elements) must be
exactly zero at init, after every reduce-scatter and after every optimizer step: a non-zero pad
would leak into a gradient norm, into weight-decayed state, or into a parameter after a reshard to
another world size. Ranks whose whole shard is padding (unpadded_numel < W) hold zeros and take
part in every collective like any other rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def shard_numel_for(unpadded_numel: int, world_size: int) -> int:
    """ceil(unpadded_numel / world_size): every rank's shard numel, padding included."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if unpadded_numel < 0:
        raise ValueError(f"unpadded_numel={unpadded_numel} must be >= 0")
    return -(-unpadded_numel // world_size)  # integer ceil: float division rounds past 2**53


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives inside the unpadded flat buffer."""

    fqns: tuple[str, ...]  # every name the parameter has (tied names share one slot)
    size: torch.Size
    offset: int  # first element in the flat buffer
    numel: int

    @property
    def fqn(self) -> str:
        return self.fqns[0]


@dataclass(frozen=True)
class FlatLayout:
    """The layout of one flat parameter sharded over `world_size` ranks."""

    slots: tuple[ParamSlot, ...]
    world_size: int

    @classmethod
    def build(cls, named_sizes: list[tuple[tuple[str, ...], torch.Size]], world_size: int) -> FlatLayout:
        slots, offset = [], 0
        for fqns, size in named_sizes:
            numel = math.prod(size)
            slots.append(ParamSlot(tuple(fqns), torch.Size(size), offset, numel))
            offset += numel
        shard_numel_for(offset, world_size)  # validates world_size
        return cls(tuple(slots), world_size)

    @property
    def unpadded_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def shard_numel(self) -> int:
        return shard_numel_for(self.unpadded_numel, self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def padding_numel(self) -> int:
        return self.padded_numel - self.unpadded_numel

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        """[start, end) of `rank`'s shard in the padded flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} outside world_size={self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def local_padding_bounds(self, rank: int) -> tuple[int, int]:
        """[start, end) of the padding inside `rank`'s local shard (empty when start == end)."""
        start, end = self.shard_bounds(rank)
        pad_start = min(max(self.unpadded_numel - start, 0), self.shard_numel)
        return pad_start, end - start

    def locate(self, flat_index: int) -> tuple[int, int]:
        """(owning rank, index inside that rank's shard) of an element of the padded buffer."""
        if not 0 <= flat_index < self.padded_numel:
            raise ValueError(f"flat_index={flat_index} outside padded_numel={self.padded_numel}")
        return divmod(flat_index, self.shard_numel)

    def split_numels(self) -> list[int]:
        """Numels to `torch.split` the padded buffer into: each slot, then the padding."""
        return [s.numel for s in self.slots] + [self.padding_numel]


def flatten_padded(tensors: list[torch.Tensor], layout: FlatLayout) -> torch.Tensor:
    """Concatenate `tensors` (in slot order) into a padded flat buffer with a zero tail."""
    if len(tensors) != len(layout.slots):
        raise ValueError(f"got {len(tensors)} tensors for {len(layout.slots)} slots")
    dtype = tensors[0].dtype if tensors else torch.float32
    device = tensors[0].device if tensors else torch.device("cpu")
    padded = torch.empty(layout.padded_numel, dtype=dtype, device=device)
    for slot, t in zip(layout.slots, tensors):
        if t.shape != slot.size:
            raise ValueError(f"'{slot.fqn}': size {tuple(t.shape)} != layout size {tuple(slot.size)}")
        padded[slot.offset : slot.offset + slot.numel].copy_(t.reshape(-1))
    padded[layout.unpadded_numel :].zero_()
    return padded


def unflatten_views(padded: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """Views of `padded` shaped like the original parameters, in slot order.

    One `split` for all slots: under autograd its backward is a single node that writes every
    view's gradient into one padded gradient buffer (zeros where a view got no gradient).
    """
    if padded.numel() != layout.padded_numel:
        raise ValueError(f"buffer numel {padded.numel()} != padded_numel {layout.padded_numel}")
    pieces = torch.split(padded, layout.split_numels())
    return [piece.view(slot.size) for piece, slot in zip(pieces, layout.slots)]


def shard_of(padded: torch.Tensor, layout: FlatLayout, rank: int) -> torch.Tensor:
    """`rank`'s shard of a padded flat buffer (a view)."""
    start, end = layout.shard_bounds(rank)
    return padded[start:end]
