"""A model whose extra branch runs on even steps only: the batch carries the flag (a non-tensor
leaf every rank receives unchanged), so on odd steps the plain model's `branch` gets no gradient
and the optimizer skips it: no weight decay, no moment update, and AdamW's step count for it
stays behind the others'. The branch shares its block's unit with the always-used layers.
AdamW runs without weight decay: a zero gradient on step 1 then leaves the branch where it is, and
only its step count (its bias correction on step 2) tells an optimizer that stepped it apart."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)
        self.branch = nn.Linear(d, d)

    def forward(self, x, use_branch: bool):
        h = x + torch.tanh(self.fc(self.norm(x)))
        return h + 0.5 * torch.tanh(self.branch(h)) if use_branch else h


class BranchModel(nn.Module):
    def __init__(self, d: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(6, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, classes)

    def forward(self, x, use_branch):  # (B, 6), bool
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, use_branch)
        return self.head(h)


def make_batch(seed: int, step: int, global_batch: int):
    g = torch.Generator().manual_seed(seed * 1013 + step)
    inputs = {"x": torch.randn(global_batch, 6, generator=g), "use_branch": step % 2 == 0}
    return inputs, torch.randint(0, 3, (global_batch,), generator=g)


def make_case() -> Case:
    return Case(name="even_step_branch", description="a branch inside each block taken on even steps only",
                build_model=BranchModel, wrap=("blocks.0", "blocks.1"), make_batch=make_batch,
                loss_fn=F.cross_entropy,
                optimizers=(OptimizerSpec("adamw", lr=1e-2),
                            OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=0.01)),
                steps=4, global_batch=8, world_sizes=(1, 2, 4))
