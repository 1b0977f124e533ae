"""Run under torchrun at W = 4: HSDP on a (2 replicas, 2 shards) mesh, two micro-batches, against
itself with `set_requires_all_reduce(False)` on the first. One JSON file per rank.

The same four gradient terms per element are summed in another association (each micro-batch's
shard-group sum kept, then both all-reduced at once), so the gradients agree to float32 rounding;
and the replicas all-reduce once per handle instead of twice.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import impl
import impl._handle
from cases.models import TransformerConfig, TransformerLM, lm_loss
from harness.run.rank import rank_prologue
from tests.support.torchrun_script import finish_rank

CFG = TransformerConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=18)


def batch(i: int):
    g = torch.Generator().manual_seed(100 + i + 10 * dist.get_rank())
    idx = torch.randint(0, 37, (4, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def accumulate(all_reduce_first: bool) -> tuple[list[torch.Tensor], int]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = TransformerLM(CFG)
    for block in model.blocks:
        impl.fully_shard(block, mesh=mesh)
    impl.fully_shard(model, mesh=mesh)
    count = [0]
    real = impl._handle.all_reduce_sum

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)
    impl._handle.all_reduce_sum = counting
    try:
        for i in range(2):
            model.set_requires_all_reduce(all_reduce_first or i == 1)
            x, y = batch(i)
            lm_loss(model(x), y).backward()
    finally:
        impl._handle.all_reduce_sum = real
    return [p.grad.clone() for p in model.parameters()], count[0]


def main() -> int:
    out_dir = sys.argv[1]
    rank_prologue(threads=1)
    every, every_count = accumulate(True)
    once, once_count = accumulate(False)
    close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(every, once))
    result = {"all_reduces": {"every_micro_batch": every_count, "last_only": once_count}, "close": close,
              "nonzero": any(bool((g != 0).any()) for g in once)}
    return finish_rank(out_dir, result)


if __name__ == "__main__":
    sys.exit(main())
