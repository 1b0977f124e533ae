"""Run under torchrun at W = 2: impl's FSDP2 API against torch FSDP2 itself. One JSON file per rank.

- all-gathers: a TransformerLM (blocks and root wrapped, reshard_after_forward=True, so the root
  too), two micro-batches (gradient sync off for the first) then an optimizer step: impl issues as
  many all-gathers as FSDP2 (each counted where the implementation gathers one unit's parameters);
- set_gradient_divide_factor(1.0): the reduced gradients are the sums, W times the means, bitwise.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import impl
from cases.models import TransformerConfig, TransformerLM, lm_loss
from harness.run.rank import rank_epilogue, rank_prologue

CFG = TransformerConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=18)


def batch(i: int):
    g = torch.Generator().manual_seed(100 + i + 10 * dist.get_rank())
    idx = torch.randint(0, 37, (4, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def build(fully_shard) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TransformerLM(CFG)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    return model


def gathers_of_accumulation(fully_shard, where, name: str) -> int:
    """All-gathers of one unit's parameters, counted at the implementation's own call (`where`.`name`)."""
    model = build(fully_shard)
    count = [0]
    real = getattr(where, name)

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)
    setattr(where, name, counting)
    try:
        for i in range(2):
            model.set_requires_gradient_sync(i == 1)
            x, y = batch(i)
            lm_loss(model(x), y).backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    finally:
        setattr(where, name, real)
    return count[0]


def grads(divide_factor: float | None) -> list[torch.Tensor]:
    model = build(impl.fully_shard)
    if divide_factor is not None:
        for module in (*model.blocks, model):
            module.set_gradient_divide_factor(divide_factor)
    x, y = batch(0)
    lm_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def main() -> int:
    out_dir = sys.argv[1]
    rank_prologue(threads=1)
    import impl._handle
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    result = {"gathers": {"impl": gathers_of_accumulation(impl.fully_shard, impl._handle, "all_gather_into"),
                          "fsdp2": gathers_of_accumulation(torch_fully_shard, _fsdp_param_group, "foreach_all_gather")}}
    means, sums = grads(None), grads(1.0)
    result["sums_are_w_times_means"] = all(torch.equal(s, m * dist.get_world_size()) for s, m in zip(sums, means))
    result["some_gradient_nonzero"] = any(bool((m != 0).any()) for m in means)
    with open(f"{out_dir}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    rank_epilogue()
    return 0


if __name__ == "__main__":
    sys.exit(main())
