"""A model, data and loss the harness has never seen (a gated residual MLP over sequences),
written the way a user would: the tests copy this file somewhere else and verify it with
`python -m harness run --cases <copy>:make_case`."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec


class GatedBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d)
        self.down = nn.Linear(d, d, bias=False)

    def forward(self, x):
        a, b, c = self.up(self.norm(x)).chunk(3, dim=-1)
        return x + self.down(F.silu(a) * b + 0.1 * torch.tanh(c))


class SeqModel(nn.Module):
    def __init__(self, d: int = 24, n: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(7, d)
        self.blocks = nn.ModuleList(GatedBlock(d) for _ in range(n))
        self.scale = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(d, classes)

    def forward(self, x):  # (B, T, 7)
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1) * self.scale)  # (B, classes)


def batch(seed: int, step: int, global_batch: int):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    return torch.randn(global_batch, 6, 7, generator=g), torch.randint(0, 5, (global_batch,), generator=g)


def make_case() -> Case:
    return Case(name="gated_seq", description="a user's gated residual MLP over sequences",
                build_model=SeqModel, wrap=("blocks.0", "blocks.1", "blocks.2"), make_batch=batch,
                loss_fn=F.cross_entropy,
                optimizers=(OptimizerSpec("adamw", lr=3e-3, weight_decay=0.1), OptimizerSpec("sgd", lr=0.1, momentum=0.8)),
                steps=4, global_batch=8, world_sizes=(1, 2, 4))


# A user's adapter with a planted bug: ours, except every reduced gradient is 1e-5 too large.
from dataclasses import replace  # noqa: E402

from harness.adapters import Ours  # noqa: E402


class ScaledGradients(Ours):
    name = "scaled_gradients"

    def wrap(self, model, wrap_paths, ctx):
        return super().wrap(model, wrap_paths, replace(ctx, faults=ctx.faults | {"grad_scale_1e-5"}))
