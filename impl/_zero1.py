"""ZeRO-1: optimizer-state-only sharding (DeepSpeed stage 1), which torch FSDP lacks.

Parameters and gradients stay replicated (DDP-like); the optimizer state is sharded. The
parameters become views into one padded flat buffer per dtype (see [Note: Uniform padding] in
_flat_param.py); each rank steps an inner optimizer on its shard of that buffer only, then an
all-gather brings every rank's updated shard back into the full buffer. The inner optimizer holds
each parameter's piece of the shard as a tensor of its own, and a parameter that had no gradient
on any rank has none there either, so it is skipped as the plain model's optimizer skips it
([Note: Per-parameter shards] and [Note: Gradients with their used flags] in _handle.py: the
flags travel in the gradients' all-reduce).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from impl._collectives import all_gather_into, all_reduce_sum, group_rank_and_size
from impl._faults import seams_for
from impl._flat_param import FlatLayout, align_numel_for, flatten_padded, unflatten_views, zero_padding_


class ZeroRedundancyOptimizer:
    """`ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group, lr=...)`.

    step() all-reduces and averages the gradients over the group (so no DDP wrapper is needed),
    steps this rank's shard and all-gathers the parameters. process_group=None means the WORLD
    group when torch.distributed is initialised and no group (W = 1) otherwise.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        optimizer_class: Callable[..., torch.optim.Optimizer],
        process_group: dist.ProcessGroup | None = None,
        _faults: frozenset[str] = frozenset(),
        **defaults: Any,
    ) -> None:
        seams = seams_for(frozenset(_faults))
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.group = process_group
        self.rank, self.world_size = group_rank_and_size(process_group)
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ZeroRedundancyOptimizer: no parameters that require grad")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeroRedundancyOptimizer: parameters of several dtypes {sorted(map(str, dtypes))}")
        self.layout = FlatLayout.build(
            [((str(i),), p.shape) for i, p in enumerate(self.params)], self.world_size, align_numel_for(*dtypes)
        )
        with torch.no_grad():
            self.flat = flatten_padded([p.detach() for p in self.params], self.layout)
            for param, view in zip(self.params, unflatten_views(self.flat, self.layout)):
                param.data = view  # parameters now live inside the flat buffer
        start, end = self.layout.shard_bounds(self.rank)
        self.shard = self.flat[start:end].clone()
        self.local_bounds = self.layout.local_slot_bounds(self.rank)
        self.pieces = [torch.nn.Parameter(self.shard[a:b]) for a, b in self.local_bounds]
        self.whole = None
        if seams.zero1_whole_state(False):  # every rank steps every slot of the buffer
            self.whole = self.flat.clone()
            self.pieces = [torch.nn.Parameter(self.whole[slot.offset:slot.end]) for slot in self.layout.slots]
        self.optim = optimizer_class(self.pieces, **defaults)

    @property
    def state(self):
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat_grad = flatten_padded(grads, self.layout)
        flags = torch.tensor([p.grad is not None for p in self.params], dtype=flat_grad.dtype, device=flat_grad.device)
        reduced = torch.cat([flat_grad, flags])  # one all-reduce: the gradients and who had one
        all_reduce_sum(reduced, self.group)
        flat_grad, used = reduced[:flat_grad.numel()], (reduced[flat_grad.numel():] != 0).tolist()
        if self.world_size > 1:
            flat_grad.div_(self.world_size)
        start, end = self.layout.shard_bounds(self.rank)
        if self.whole is not None:
            for piece, slot, u in zip(self.pieces, self.layout.slots, used):
                piece.grad = flat_grad[slot.offset:slot.end].clone() if u else None
            self.optim.step()
            self.shard.copy_(self.whole[start:end])
        else:
            shard_grad = flat_grad[start:end].clone()
            for piece, (a, b), u in zip(self.pieces, self.local_bounds, used):
                piece.grad = shard_grad[a:b] if u else None
            self.optim.step()
        zero_padding_(self.shard, self.layout.local_padding_intervals(self.rank))
        all_gather_into(self.flat, self.shard, self.group)
