"""`single`: the plain module in one process, no process group: the reference."""

from __future__ import annotations

import torch

from cases.features import Features
from harness.adapters.base import Adapter
from harness.adapters.features import CastCompute


class Single(Adapter):
    name = "single"
    needs_process_group = False
    simulated_ranks = True  # no collectives at all

    def unsupported(self, features: Features) -> str | None:
        return None

    def wrap(self, model, wrap_paths, ctx):
        if ctx.features.mixed_precision:
            return CastCompute(model, ctx.features.compute_dtype)
        return model

    def set_gradient_sync(self, model, enabled):
        pass  # one process: nothing to synchronise

    def materialize(self, model, init_state, device: torch.device = torch.device("cpu")):
        model.to_empty(device=device)
        model.load_state_dict(init_state)

    def layouts(self, model):
        return {n: {"kind": "replicated"} for n, _ in model.named_parameters()}
