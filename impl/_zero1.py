"""ZeRO-1: optimizer-state-only sharding (DeepSpeed stage 1), which torch FSDP lacks.

Parameters and gradients stay replicated (DDP-like); the optimizer state is sharded. The
parameters become views into one padded flat buffer per dtype (see [Note: Uniform padding] in
_flat_param.py); each rank steps an inner optimizer on its shard of that buffer only, then an
all-gather brings every rank's updated shard back into the full buffer.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from impl._collectives import all_gather_into, all_reduce_sum, group_rank_and_size
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
        **defaults: Any,
    ) -> None:
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
        self.shard = torch.nn.Parameter(self.flat[start:end].clone())
        self.optim = optimizer_class([self.shard], **defaults)

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
        all_reduce_sum(flat_grad, self.group)
        if self.world_size > 1:
            flat_grad.div_(self.world_size)
        start, end = self.layout.shard_bounds(self.rank)
        self.shard.grad = flat_grad[start:end].clone()
        self.optim.step()
        zero_padding_(self.shard, self.layout.local_padding_intervals(self.rank))
        all_gather_into(self.flat, self.shard.detach(), self.group)
