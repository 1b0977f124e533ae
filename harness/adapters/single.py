"""`single`: the plain module in one process, no process group: the reference."""

from __future__ import annotations

import torch

from cases.features import PLAIN, Features
from harness.adapters.features import CastCompute


class Single:
    name = "single"
    needs_process_group = False

    def unsupported(self, features: Features) -> str | None:
        return None

    def wrap(self, model, wrap_paths, ctx, faults, features: Features = PLAIN):
        if features.mixed_precision:
            return CastCompute(model, features.compute_dtype)
        return model

    def materialize(self, model, init_state, device: torch.device = torch.device("cpu")):
        model.to_empty(device=device)
        model.load_state_dict(init_state)

    def full_params(self, model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def full_grads(self, model):
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    def layouts(self, model):
        return {n: {"kind": "replicated"} for n, _ in model.named_parameters()}

    def raw_shards(self, model):
        return []
