"""Run under torchrun at W = 2: impl's FSDP2 API against torch FSDP2 itself. One JSON file per rank.

- all-gathers: a TransformerLM (blocks and root wrapped, reshard_after_forward=True, so the root
  too), two micro-batches (gradient sync off for the first) then an optimizer step: impl issues as
  many all-gathers as FSDP2 (each counted where the implementation gathers one unit's parameters);
- set_gradient_divide_factor(1.0): the reduced gradients are the sums, W times the means, bitwise.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import impl
from cases.models import TransformerConfig, TransformerLM, lm_loss
from harness.run.rank import rank_prologue
from tests.support.torchrun_script import finish_rank

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


def gathers_of_accumulation(fully_shard, where, name: str, keep_after_first: bool = False,
                            last_backward_hint: bool = False, sync_every: bool = False
                            ) -> tuple[int, list[torch.Tensor], bool]:
    """All-gathers of one unit's parameters, counted at the implementation's own call (`where`.`name`),
    over two micro-batches (gradient sync off for the first) and a step; the gradients before the
    step; whether a reduction was still in flight after the first backward. `keep_after_first`:
    set_reshard_after_backward(False) for the first micro-batch; `last_backward_hint`:
    set_is_last_backward(False) for it (impl only: the in-flight check reads impl's reducer);
    `sync_every`: gradient sync on for both."""
    model = build(fully_shard)
    count = [0]
    real = getattr(where, name)
    in_flight = False

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)
    setattr(where, name, counting)
    try:
        for i in range(2):
            model.set_requires_gradient_sync(i == 1 or sync_every)
            if keep_after_first:
                model.set_reshard_after_backward(i == 1)
            if last_backward_hint:
                model.set_is_last_backward(i == 1)
            x, y = batch(i)
            lm_loss(model(x), y).backward()
            if i == 0 and last_backward_hint:
                in_flight = model.fsdp_unit().reducer.in_flight is not None
        grads = [p.grad.clone() for p in model.parameters()]
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    finally:
        setattr(where, name, real)
    return count[0], grads, in_flight


def after_a_failure(where: str) -> bool:
    """Two models built alike; the first runs an iteration that raises half-way (in a block's
    forward, or in backward at that block's output: the root's gradients already in, some reduced),
    then reset_iter_state(); both then run one iteration: the same gradients, bitwise."""
    failing, fresh = build(impl.fully_shard), build(impl.fully_shard)
    armed = [True]

    def planted(*_):
        raise ValueError("planted")

    block = failing.blocks[1]
    if where == "forward":
        block.register_forward_pre_hook(lambda module, args: planted() if armed[0] else None)
    else:
        def on_output(module, args, out):
            if armed[0]:
                out.register_hook(planted)
        block.register_forward_hook(on_output)
    x, y = batch(0)
    try:
        lm_loss(failing(x), y).backward()
    except ValueError:
        pass
    armed[0] = False
    failing.reset_iter_state()
    for p in failing.parameters():
        p.grad = None
    x, y = batch(1)
    got = []
    for model in (failing, fresh):
        lm_loss(model(x), y).backward()
        got.append([p.grad.clone() for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*got))


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

    ours = (impl.fully_shard, impl._handle, "all_gather_into")
    theirs = (torch_fully_shard, _fsdp_param_group, "foreach_all_gather")
    plain_count, plain_grads, _ = gathers_of_accumulation(*ours)
    result = {"gathers": {"impl": plain_count, "fsdp2": gathers_of_accumulation(*theirs)[0]}}
    # set_reshard_after_backward(False) for the first micro-batch: its parameters outlive its
    # backward, so the second forward gathers nothing; the same gradients.
    kept_count, kept_grads, _ = gathers_of_accumulation(*ours, keep_after_first=True)
    result["kept_after_backward"] = {"impl": kept_count,
                                     "fsdp2": gathers_of_accumulation(*theirs, keep_after_first=True)[0],
                                     "grads_bitwise": all(torch.equal(a, b) for a, b in zip(kept_grads, plain_grads))}
    # set_is_last_backward(False) for the first of two synced micro-batches: its last reduction is
    # left in flight, finished by the second; the gradients are those of waiting every time.
    _, waited, _ = gathers_of_accumulation(*ours, sync_every=True)
    _, hinted, in_flight = gathers_of_accumulation(*ours, sync_every=True, last_backward_hint=True)
    result["last_backward_hint"] = {"in_flight_after_first": in_flight,
                                    "grads_bitwise": all(torch.equal(a, b) for a, b in zip(hinted, waited))}
    means, sums = grads(None), grads(1.0)
    result["sums_are_w_times_means"] = all(torch.equal(s, m * dist.get_world_size()) for s, m in zip(sums, means))
    result["some_gradient_nonzero"] = any(bool((m != 0).any()) for m in means)
    result["reset_after_failure"] = {where: after_a_failure(where) for where in ("forward", "backward")}
    return finish_rank(out_dir, result)


if __name__ == "__main__":
    sys.exit(main())
