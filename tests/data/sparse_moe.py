"""A top-1 mixture of experts that skips empty experts: each token goes to its router's
highest-scoring expert, and an expert that no token chose is not run at all, so its parameters
get no gradient that step (in the plain model: grad None, the optimizer skips it). With 5 experts
and 32 tokens per step an expert is empty on some steps; with split data an expert may be empty on
one rank's batch and not on another's, and then it has a gradient (the plain model over the global
batch gives it one), and on some steps one rank runs every expert of a layer while another does
not. Each MoE layer (router and experts) is one unit."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec


class MoE(nn.Module):
    def __init__(self, d: int, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, num_experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, d))
                                     for _ in range(num_experts))

    def forward(self, x):  # (B, T, d)
        h = self.norm(x).reshape(-1, x.shape[-1])  # (B*T, d)
        probs = torch.softmax(self.router(h), dim=-1)  # (B*T, E)
        gate, choice = probs.max(dim=-1)  # (B*T,), top-1
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue  # no token chose this expert: it does not run
            out = out.index_add(0, rows, gate[rows, None] * expert(h[rows]))
        return x + out.view_as(x)


class MoEModel(nn.Module):
    def __init__(self, d: int = 12, num_experts: int = 5, hidden: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.layers = nn.ModuleList([MoE(d, num_experts, hidden), MoE(d, num_experts, hidden)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):  # (B, T, 5)
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))  # (B, classes)


def make_batch(seed: int, step: int, global_batch: int):
    g = torch.Generator().manual_seed(seed * 1019 + step)
    return torch.randn(global_batch, 4, 5, generator=g), torch.randint(0, 4, (global_batch,), generator=g)


def make_case() -> Case:
    return Case(name="sparse_moe", description="top-1 MoE layers that skip experts no token chose",
                build_model=MoEModel, wrap=("layers.0", "layers.1"), make_batch=make_batch,
                loss_fn=F.cross_entropy,
                optimizers=(OptimizerSpec("adamw", lr=1e-2, weight_decay=0.1),
                            OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=0.01)),
                steps=4, global_batch=8, world_sizes=(1, 2, 4))
