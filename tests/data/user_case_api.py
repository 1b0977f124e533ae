"""A user's case that uses the whole Case API (README, "Verify your own model"): a model taking
keyword arguments and returning a dict, a batch that is a pytree (a dict of inputs, a tuple of
targets), units chosen by module class, AdamW with a parameter group of its own (the embedding,
a unit of its own: a flat parameter has one learning rate) and SGD with a warm-up LR schedule. The tests copy it elsewhere
and verify it with `python -m harness run --cases <copy>:make_case`."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec, ParamGroup

VOCAB, T, CLASSES = 23, 6, 4


class Mixer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.token_mix = nn.Linear(T, T)
        self.channel = nn.Linear(d, d)

    def forward(self, h, mask):  # (B, T, d), (B, T)
        mixed = self.token_mix(self.norm(h).transpose(1, 2)).transpose(1, 2)
        return h + F.gelu(self.channel(mixed)) * mask.unsqueeze(-1)


class Tagger(nn.Module):
    """Token ids and a mask in, a dict out: per-token tags and a sequence score."""

    def __init__(self, d: int = 20, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.mixers = nn.ModuleList(Mixer(d) for _ in range(n))
        self.tags = nn.Linear(d, CLASSES)
        self.score = nn.Linear(d, 1)

    def forward(self, input_ids, attention_mask, temperature=1.0):
        h = self.embed(input_ids)
        for mixer in self.mixers:
            h = mixer(h, attention_mask)
        return {"tag_logits": self.tags(h) / temperature, "score": self.score(h.mean(dim=1)).squeeze(-1)}


def make_batch(seed: int, step: int, global_batch: int):
    g = torch.Generator().manual_seed(seed * 104729 + step)
    inputs = {"input_ids": torch.randint(0, VOCAB, (global_batch, T), generator=g),
              "attention_mask": (torch.rand(global_batch, T, generator=g) > 0.2).float(),
              "temperature": 2.0}  # not a tensor: every rank and micro-batch gets it as it is
    targets = (torch.randint(0, CLASSES, (global_batch, T), generator=g), torch.randn(global_batch, generator=g))
    return inputs, targets


def loss_fn(outputs, targets):
    tags, score = targets
    return F.cross_entropy(outputs["tag_logits"].flatten(0, 1), tags.flatten()) + F.mse_loss(outputs["score"], score)


def warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


def make_case() -> Case:
    return Case(
        name="tagger", description="a user's tagger: dict in, dict out, wrap by class, groups, LR schedule",
        build_model=Tagger, wrap=(nn.Embedding, Mixer), make_batch=make_batch, loss_fn=loss_fn,
        optimizers=(OptimizerSpec("adamw", lr=3e-3, weight_decay=0.1,
                                  param_groups=(ParamGroup(("embed.*",), lr=1e-2, weight_decay=0.0),)),
                    OptimizerSpec("sgd", lr=0.2, momentum=0.8, lr_scheduler=warmup)),
        steps=4, global_batch=8, world_sizes=(1, 2, 4))
