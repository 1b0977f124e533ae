"""A user's tagger whose rotary table is a buffer registered empty and grown to the sequence
length on first use (as some RoPE implementations cache it): the buffers check judges buffers
against the model as built, so the plan refuses it with one line before any rank starts."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec

D, VOCAB, SEQ = 8, 11, 6


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos", torch.empty(0, D), persistent=False)

    def forward(self, x):  # (B, T, D)
        t = x.size(1)
        if self.cos.size(0) < t:  # grown lazily: the buffer changes shape in the first forward
            self.cos = torch.cos(torch.arange(t, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, D))
        return x * self.cos[:t]


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rot, self.fc, self.head = nn.Embedding(VOCAB, D), Rotary(), nn.Linear(D, D), nn.Linear(D, VOCAB)

    def forward(self, tokens):  # (B, T) -> (B, T, VOCAB)
        return self.head(torch.tanh(self.fc(self.rot(self.emb(tokens)))))


def make_batch(seed: int, step: int, global_batch: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_case() -> Case:
    return Case(name="lazy_rope", description="a rotary table grown in the forward", build_model=Tagger,
                wrap=("fc",), make_batch=make_batch,
                loss_fn=lambda out, y: F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)),
                optimizers=(OptimizerSpec("sgd", lr=0.1),), steps=2, world_sizes=(1, 2))
