"""One unit's flat parameter: layout, alignment, uniform padding and views.

Pure tensor code, no process group: everything here is testable in one process.

The padded flat buffer, for slots p0, p1, p2 over W ranks:

    | p0 | align pad | p1 | align pad | p2 | uniform pad |
    0    ^           ^ offset of p1 (a multiple of align_numel)
    <------------------ aligned_numel ---->
    <------------------ padded_numel = W * shard_numel ---------------->

[Note: Alignment]
Every original parameter starts at a multiple of `align_numel` elements, chosen so that its
offset is a multiple of ALIGNMENT_BYTES = 256 bytes in every dtype the buffer is held in. A view at
an unaligned offset is not numerically the same tensor as the same values freshly allocated: the
CPU GEMM (MKL, measured on AVX2) rounds differently for an fp32 weight whose offset is not a
multiple of 16 bytes, so `F.linear(x, w)` with `w` one element into its storage differs from
`F.linear(x, w.clone())`, and a W = 1 run stops being bitwise equal to the plain model. Fresh
allocations are 64-byte aligned on the CPU (c10's allocator alignment, also the AVX-512 vector
width) and 512-byte aligned on CUDA, where PyTorch hands cuBLASLt the pointers' alignment up to
256 bytes as a heuristic input (so an algorithm, and its rounding, can depend on it). 256 bytes is
therefore the smallest alignment at which a view is indistinguishable from a fresh tensor to
every kernel we run on. The cost is under 256 bytes per parameter (about 0.1 MB for GPT-2
medium's ~300 parameters), paid in every shard like any other element.

The layout (offsets, `aligned_numel`) does not depend on W, so a checkpoint reshards by slicing
the same aligned buffer with another W. The alignment padding is padding like the uniform tail:
exactly zero always, reported by `local_padding_intervals`, never read by a view.

[Note: Uniform padding]
`all_gather_into_tensor` and `reduce_scatter_tensor` need every rank's shard to have the same
numel, and the unsharded buffer to be exactly W shards long. The aligned flat buffer of
`aligned_numel` elements is therefore padded at its tail to
`padded_numel = W * ceil(aligned_numel / W)`; rank r owns elements [r * shard_numel,
(r + 1) * shard_numel). The padding (interior alignment padding and the tail of fewer than W
elements) must be exactly zero at init, after every reduce-scatter and after every optimizer step:
a non-zero pad would leak into a gradient norm, into weight-decayed state, or into a parameter
after a reshard to another world size. Ranks whose whole shard is padding hold zeros and take
part in every collective like any other rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ALIGNMENT_BYTES = 256  # see [Note: Alignment]


def shard_numel_for(unpadded_numel: int, world_size: int) -> int:
    """ceil(unpadded_numel / world_size): every rank's shard numel, padding included."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if unpadded_numel < 0:
        raise ValueError(f"unpadded_numel={unpadded_numel} must be >= 0")
    return -(-unpadded_numel // world_size)  # integer ceil: float division rounds past 2**53


def align_numel_for(*dtypes: torch.dtype) -> int:
    """Elements per alignment step: ALIGNMENT_BYTES in the narrowest of `dtypes` (and so in all)."""
    if not dtypes:
        raise ValueError("align_numel_for needs at least one dtype")
    return max(ALIGNMENT_BYTES // dtype.itemsize for dtype in dtypes)


def _align_up(numel: int, align_numel: int) -> int:
    return -(-numel // align_numel) * align_numel


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives inside the padded flat buffer."""

    fqns: tuple[str, ...]  # every name the parameter has (tied names share one slot)
    size: torch.Size
    offset: int  # first element in the padded flat buffer (a multiple of align_numel unless empty)
    numel: int

    @property
    def fqn(self) -> str:
        return self.fqns[0]

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    """The layout of one flat parameter sharded over `world_size` ranks."""

    slots: tuple[ParamSlot, ...]
    world_size: int
    align_numel: int

    @classmethod
    def build(
        cls, named_sizes: list[tuple[tuple[str, ...], torch.Size]], world_size: int, align_numel: int
    ) -> FlatLayout:
        """Slots in the given order, each at the next multiple of `align_numel` (1: dense)."""
        if align_numel < 1:
            raise ValueError(f"align_numel={align_numel} must be >= 1")
        slots, end = [], 0
        for fqns, size in named_sizes:
            numel = math.prod(size)
            offset = _align_up(end, align_numel) if numel else end  # an empty view needs no alignment
            slots.append(ParamSlot(tuple(fqns), torch.Size(size), offset, numel))
            end = offset + numel
        shard_numel_for(end, world_size)  # validates world_size
        return cls(tuple(slots), world_size, align_numel)

    @property
    def param_numel(self) -> int:
        """Elements that belong to a parameter (no padding of either kind)."""
        return sum(s.numel for s in self.slots)

    @property
    def aligned_numel(self) -> int:
        """The buffer up to the end of the last slot: parameters plus alignment padding."""
        return self.slots[-1].end if self.slots else 0

    @property
    def shard_numel(self) -> int:
        return shard_numel_for(self.aligned_numel, self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def tail_padding_numel(self) -> int:
        """The uniform padding after the last slot (fewer than world_size elements)."""
        return self.padded_numel - self.aligned_numel

    @property
    def padding_numel(self) -> int:
        """All padding: alignment gaps between slots plus the uniform tail."""
        return self.padded_numel - self.param_numel

    def padding_intervals(self) -> tuple[tuple[int, int], ...]:
        """[start, end) of every padding run in the padded buffer, in order, none empty."""
        out, end = [], 0
        for slot in self.slots:
            if slot.numel == 0:
                continue  # an empty slot splits no gap: its neighbours' padding is one run
            if slot.offset > end:
                out.append((end, slot.offset))
            end = slot.end
        if self.padded_numel > end:
            out.append((end, self.padded_numel))
        return tuple(out)

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        """[start, end) of `rank`'s shard in the padded flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} outside world_size={self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def local_padding_intervals(self, rank: int) -> tuple[tuple[int, int], ...]:
        """[start, end) of every padding run inside `rank`'s shard, shard-local, none empty."""
        start, end = self.shard_bounds(rank)
        return tuple(
            (max(a, start) - start, min(b, end) - start)
            for a, b in self.padding_intervals()
            if a < end and b > start
        )

    def local_slot_bounds(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Per slot, [start, end) of its elements inside `rank`'s shard, shard-local; (0, 0) for a
        slot with no element there. The slices of the shard the optimizer steps ([Note:
        Per-parameter shards] in impl/_handle.py)."""
        start, end = self.shard_bounds(rank)
        out = []
        for slot in self.slots:
            lo, hi = max(slot.offset, start), min(slot.end, end)
            out.append((lo - start, hi - start) if lo < hi else (0, 0))
        return tuple(out)

    def locate(self, flat_index: int) -> tuple[int, int]:
        """(owning rank, index inside that rank's shard) of an element of the padded buffer."""
        if not 0 <= flat_index < self.padded_numel:
            raise ValueError(f"flat_index={flat_index} outside padded_numel={self.padded_numel}")
        return divmod(flat_index, self.shard_numel)

    def split_numels(self) -> list[int]:
        """Numels to `torch.split` the padded buffer into: gap, slot, gap, slot, ..., tail.

        The slot pieces are the odd ones (index 2 * i + 1 for slot i).
        """
        numels, end = [], 0
        for slot in self.slots:
            numels += [slot.offset - end, slot.numel]
            end = slot.end
        return numels + [self.padded_numel - end]


def zero_padding_(shard: torch.Tensor, intervals: tuple[tuple[int, int], ...]) -> None:
    """Write zeros into the given [start, end) runs of a shard (in place, no autograd record)."""
    for start, end in intervals:
        shard[start:end].zero_()


def flatten_padded(tensors: list[torch.Tensor], layout: FlatLayout) -> torch.Tensor:
    """Copy `tensors` (in slot order) into a padded flat buffer, every padding element zero."""
    if len(tensors) != len(layout.slots):
        raise ValueError(f"got {len(tensors)} tensors for {len(layout.slots)} slots")
    dtype = tensors[0].dtype if tensors else torch.float32
    device = tensors[0].device if tensors else torch.device("cpu")
    padded = torch.empty(layout.padded_numel, dtype=dtype, device=device)
    for slot, t in zip(layout.slots, tensors):
        if t.shape != slot.size:
            raise ValueError(f"'{slot.fqn}': size {tuple(t.shape)} != layout size {tuple(slot.size)}")
        padded[slot.offset : slot.end].copy_(t.reshape(-1))
    zero_padding_(padded, layout.padding_intervals())
    return padded


def unflatten_views(padded: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """Views of `padded` shaped like the original parameters, in slot order.

    One `split` for all slots: under autograd its backward is a single node that writes every
    view's gradient into one padded gradient buffer (zeros where a view got no gradient, and in
    every padding piece).
    """
    if padded.numel() != layout.padded_numel:
        raise ValueError(f"buffer numel {padded.numel()} != padded_numel {layout.padded_numel}")
    pieces = torch.split(padded, layout.split_numels())
    return [pieces[2 * i + 1].view(slot.size) for i, slot in enumerate(layout.slots)]


def shard_of(padded: torch.Tensor, layout: FlatLayout, rank: int) -> torch.Tensor:
    """`rank`'s shard of a padded flat buffer (a view)."""
    start, end = layout.shard_bounds(rank)
    return padded[start:end]
