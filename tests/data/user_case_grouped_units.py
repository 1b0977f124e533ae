"""The README's model with the usual "no weight decay on biases and norms" parameter groups: every
unit holds a weight and its bias in different groups. `fsdp2` keeps per-parameter tensors, and
`ours` gives the optimizer each parameter's own piece of the flat shard (impl/_handle.py [Note:
Per-parameter shards]): both run it."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec, ParamGroup


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class MyModel(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp, self.blocks, self.head = nn.Linear(5, d), nn.Sequential(Block(d), Block(d)), nn.Linear(d, 3)

    def forward(self, features):
        return self.head(self.blocks(self.inp(features)))


def make_batch(seed: int, step: int, global_batch: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(global_batch, 5, generator=g), torch.randint(0, 3, (global_batch,), generator=g)


def make_case() -> Case:
    no_decay = ParamGroup(("*.bias", "*.norm.*"), weight_decay=0.0)
    return Case(name="grouped_units", description="no weight decay on biases and norms", build_model=MyModel,
                wrap=(Block,), make_batch=make_batch, loss_fn=F.cross_entropy,
                optimizers=(OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01, param_groups=(no_decay,)),),
                steps=2, global_batch=8, world_sizes=(1, 2))
