"""`ddp`: DistributedDataParallel, replicated parameters and averaged gradients."""

from __future__ import annotations

from cases.features import PLAIN, Features


class DDP:
    name = "ddp"
    needs_process_group = True

    def unsupported(self, features: Features) -> str | None:
        if features not in (PLAIN, Features(refused_wrap=features.refused_wrap)):
            return "the ddp adapter maps no FSDP features"
        return None

    def wrap(self, model, wrap_paths, ctx, faults, features: Features = PLAIN):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=ctx.group)

    def full_params(self, model):
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}

    def full_grads(self, model):
        return {n: p.grad.detach().clone() for n, p in model.module.named_parameters() if p.grad is not None}

    def layouts(self, model):
        return {n: {"kind": "replicated"} for n, _ in model.module.named_parameters()}

    def raw_shards(self, model):
        return []
