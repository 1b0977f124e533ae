"""Users' cases whose loss does or does not depend on how the batch is split ([Note: Batch makeup]
in harness/run/batch_makeup.py): the plan must refuse split data for the coupled ones before any
rank starts, and leave the honest ones alone.

- `make_padded_case`: a tagger on padded sequences whose loss is the mean over the batch's real
  tokens. Ranks hold different numbers of real tokens, so the mean of their local means weights
  a token by its rank's count: not the whole batch's mean. Refused.
- `make_per_sample_case`: the same tagger, each sample's loss the mean over its own real tokens,
  the batch's loss the mean over samples. Separable: not refused.
- `make_batchnorm_split_case`: BatchNorm over each rank's batch with split data. Refused.
- `make_float32_only_case`: a model holding a float32 tensor outside its parameters and buffers,
  which a cast to float64 does not reach: the check cannot run it in float64, says so, and the run
  goes on.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec

VOCAB, TAGS, SEQ, D = 13, 4, 10, 8


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, TAGS)

    def forward(self, tokens):  # (B, T) -> (B, T, TAGS)
        return self.head(torch.tanh(self.fc(self.emb(tokens))))


def padded_batch(seed: int, step: int, global_batch: int):
    """tokens (B, T) with sample b keeping lengths[b] of T real tokens; targets (tags, mask)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.randint(1, VOCAB, (global_batch, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (global_batch,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).float()  # (B, T)
    tags = torch.randint(0, TAGS, (global_batch, SEQ), generator=g)
    return tokens * mask.long(), (tags, mask)


def _token_losses(logits, tags):  # (B, T)
    return F.cross_entropy(logits.reshape(-1, TAGS), tags.reshape(-1), reduction="none").view(tags.shape)


def per_token_mean(logits, targets):
    tags, mask = targets
    return (_token_losses(logits, tags) * mask).sum() / mask.sum()


def per_sample_mean(logits, targets):
    tags, mask = targets
    return ((_token_losses(logits, tags) * mask).sum(1) / mask.sum(1)).mean()


def _tagger_case(name: str, loss_fn) -> Case:
    return Case(name=name, description="a tagger on padded sequences", build_model=Tagger, wrap=("fc",),
                make_batch=padded_batch, loss_fn=loss_fn, optimizers=(OptimizerSpec("sgd", lr=0.1),),
                steps=2, global_batch=8, world_sizes=(1, 2, 4))


def make_padded_case() -> Case:
    return _tagger_case("padded_token_mean", per_token_mean)


def make_per_sample_case() -> Case:
    return _tagger_case("padded_sample_mean", per_sample_mean)


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.fc(x))))


class Float32Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.mix = torch.eye(3) + 0.1  # a plain attribute, not a buffer: .double() leaves it float32

    def forward(self, x):
        return self.fc(x) @ self.mix


def _regression_batch(seed: int, step: int, global_batch: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(global_batch, 5, generator=g), torch.randint(0, 3, (global_batch,), generator=g)


def make_batchnorm_split_case() -> Case:
    return Case(name="batchnorm_split", description="BatchNorm with split data", build_model=NormNet, wrap=("fc",),
                make_batch=_regression_batch, loss_fn=F.cross_entropy, optimizers=(OptimizerSpec("sgd", lr=0.1),),
                steps=2, global_batch=8, world_sizes=(1, 2, 4))


def make_float32_only_case() -> Case:
    return Case(name="float32_only", description="a float32 tensor the model holds outside its buffers",
                build_model=Float32Net, wrap=("fc",), make_batch=_regression_batch, loss_fn=F.cross_entropy,
                optimizers=(OptimizerSpec("sgd", lr=0.1),), steps=2, global_batch=8, world_sizes=(1, 2))
