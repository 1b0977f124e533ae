"""A user's case with the usual "no weight decay on biases and norms" parameter groups (README,
"Verify your own model"): a pre-norm residual regressor taking a tuple of inputs (features and a
per-sample scale, as positional arguments), AdamW and SGD each with weight decay on the matrices
only. Widths are odd so that a partition of W = 2 or 4 ends in padding. A flat parameter has one
learning rate and one weight decay, so an implementation that flattens each unit's parameters
together (ours) cannot run it; per-parameter ones (fsdp2, DeepSpeed's engine) can."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec, ParamGroup

D_IN, D, D_OUT = 7, 15, 3
NO_DECAY = ParamGroup(("*.bias", "*norm.*"), weight_decay=0.0)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, h):  # (B, d)
        return h + self.proj(F.gelu(self.fc(self.norm(h))))


class Regressor(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList(Block(D) for _ in range(n))
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x, scale):  # (B, D_IN), (B, 1) -> (B, D_OUT)
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(self.norm(h)) * scale


def make_batch(seed: int, step: int, global_batch: int):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    inputs = (torch.randn(global_batch, D_IN, generator=g), 1.0 + torch.rand(global_batch, 1, generator=g))
    return inputs, torch.randn(global_batch, D_OUT, generator=g)


def make_case() -> Case:
    return Case(
        name="no_decay", description="a user's residual regressor: tuple inputs, no weight decay on biases and norms",
        build_model=Regressor, wrap=("blocks.0", "blocks.1"), make_batch=make_batch, loss_fn=F.mse_loss,
        optimizers=(OptimizerSpec("adamw", lr=3e-3, weight_decay=0.1, param_groups=(NO_DECAY,)),
                    OptimizerSpec("sgd", lr=0.05, momentum=0.9, weight_decay=0.01, param_groups=(NO_DECAY,))),
        steps=3, global_batch=8, world_sizes=(1, 2, 4))
