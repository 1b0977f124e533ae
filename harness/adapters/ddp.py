"""`ddp`: DistributedDataParallel, replicated parameters and averaged gradients."""

from __future__ import annotations

from harness.adapters.base import Adapter


class DDP(Adapter):
    name = "ddp"

    def wrap(self, model, wrap_paths, ctx):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=ctx.group)

    def layouts(self, model):
        return {n: {"kind": "replicated"} for n, _ in model.module.named_parameters()}
