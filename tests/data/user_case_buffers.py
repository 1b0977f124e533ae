"""A user's model with module buffers of every kind the buffers check tells apart ([Note: Buffers]
in harness/judge/diff.py): BatchNorm's running statistics and batch counter (updated by every
training forward, never read by it), a persistent constant (a fixed mixing matrix, saved in the
state_dict) and a non-persistent constant (a per-feature scale a state_dict leaves out).

- `make_case`: the plain model, identical data only (BatchNorm's statistics are each rank's own
  batch's under split data).
- `make_constant_case`: the same model without BatchNorm, so only constant buffers, both data modes.
- `make_checkpointed_case`: the block with BatchNorm recomputed in backward (activation
  checkpointing). torch.utils.checkpoint re-runs its forward in training mode, so BatchNorm updates
  its running statistics twice per step: not the unsharded run, whatever the sharding.
- `make_meta_constant_case`: the constant case built on the meta device (Features(meta_init=True)):
  to_empty() leaves the non-persistent `scale` uninitialised and no state dict holds it.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec
from cases.features import Features

D, CLASSES = 6, 3


class Block(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.norm = nn.BatchNorm1d(D) if norm else nn.Identity()
        self.register_buffer("mix", torch.eye(D) + 0.1 * torch.ones(D, D))  # persistent constant

    def forward(self, x):
        return torch.relu(self.norm(self.lin(x))) @ self.mix


class Net(nn.Module):
    def __init__(self, norm: bool = True) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D), persistent=False)  # not in the state_dict
        self.blocks = nn.ModuleList(Block(norm) for _ in range(2))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x):
        h = x * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_batch(seed: int, step: int, global_batch: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(global_batch, D, generator=g), torch.randint(0, CLASSES, (global_batch,), generator=g)


def _case(name: str, norm: bool, features: Features = Features(), data_modes=("identical",)) -> Case:
    return Case(name=name, description="a user's model with buffers: BatchNorm statistics, constants",
                build_model=lambda: Net(norm), wrap=("blocks.0", "blocks.1"), make_batch=make_batch,
                loss_fn=F.cross_entropy, optimizers=(OptimizerSpec("sgd", lr=0.1),), steps=3, global_batch=8,
                world_sizes=(1, 2, 4), data_modes=data_modes, features=features)


def make_case() -> Case:
    return _case("buffers", norm=True)


def make_constant_case() -> Case:
    return _case("buffers_constant", norm=False, data_modes=("identical", "split"))


def make_checkpointed_case() -> Case:
    return _case("buffers_checkpointed", norm=True, features=Features(activation_checkpointing=("blocks.0",)))


def make_meta_constant_case() -> Case:
    return _case("buffers_meta", norm=False, features=Features(meta_init=True), data_modes=("identical", "split"))
