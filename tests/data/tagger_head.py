"""A model with a head the loss ignores: `tagger` is computed in every forward but no loss term
reads it, so the plain model's tagger gets no gradient (grad None) and torch's optimizers leave
it alone. It lives in the root unit beside the used input projection and head, so an FSDP that
keeps one flat parameter per unit must not let the optimizer move it (weight decay, moments)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TaggedModel(nn.Module):
    def __init__(self, d: int = 16, classes: int = 3, tags: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(6, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, classes)
        self.tagger = nn.Linear(d, tags)  # (B, tags): returned, never read by the loss

    def forward(self, x):  # (B, 6)
        h = self.blocks(self.inp(x))
        return {"logits": self.head(h), "tags": self.tagger(h)}


def make_batch(seed: int, step: int, global_batch: int):
    g = torch.Generator().manual_seed(seed * 1009 + step)
    return torch.randn(global_batch, 6, generator=g), torch.randint(0, 3, (global_batch,), generator=g)


def make_case() -> Case:
    return Case(name="tagger_head", description="a head (tagger) the loss ignores, in the root unit",
                build_model=TaggedModel, wrap=("blocks.0", "blocks.1"), make_batch=make_batch,
                loss_fn=lambda out, y: F.cross_entropy(out["logits"], y),
                optimizers=(OptimizerSpec("adamw", lr=1e-2, weight_decay=0.1),
                            OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=0.01)),
                steps=3, global_batch=8, world_sizes=(1, 2, 4))
