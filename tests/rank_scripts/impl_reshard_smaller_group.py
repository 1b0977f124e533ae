"""Run under torchrun at W = 4: reshard_after_forward=2 ([Note: Resharding to a smaller group] in
impl/_handle.py) against True and against torch FSDP2's int. One JSON file per rank.

A TransformerLM with its blocks and root wrapped, two AdamW steps on this rank's batch: after each
forward every unit holds half of its unsharded buffer; backward gathers within groups of 2 ranks,
forward within the 4; the gradients and parameters are those of reshard_after_forward=True, bitwise;
as many all-gathers as torch FSDP2 with the same int.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from cases.models import TransformerConfig, TransformerLM, lm_loss
from harness.run.rank import rank_prologue
from tests.support.torchrun_script import finish_rank

CFG = TransformerConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=18)


def batch(i: int):
    g = torch.Generator().manual_seed(100 + i + 10 * dist.get_rank())
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def build(fully_shard, reshard) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(CFG)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def train(model, after_forward=None) -> tuple[list[list[torch.Tensor]], list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads, losses = [], []
    for i in range(2):
        x, y = batch(i)
        loss = lm_loss(model(x), y)
        if after_forward is not None:
            after_forward(model)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return grads, losses


def main() -> int:
    out_dir = sys.argv[1]
    rank_prologue(threads=1)
    import impl._handle
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    sizes: list[int] = []
    real = impl._handle.all_gather_into

    def recording(out, sharded, group, *args, **kwargs):
        sizes.append(1 if group is None else dist.get_world_size(group))
        return real(out, sharded, group, *args, **kwargs)

    held = []

    def after_forward(model):  # each unit's share of its unsharded buffer between forward and backward
        held.append(sorted({(h._post_forward.numel() if h._post_forward is not None else -1) * 1.0
                            / h.layout.padded_numel for _, u in impl.units(model) for h in u.handles}))

    impl._handle.all_gather_into = recording
    try:
        half_grads, half_losses = train(build(impl.fully_shard, 2), after_forward)
    finally:
        impl._handle.all_gather_into = real
    whole_grads, whole_losses = train(build(impl.fully_shard, True))
    count = [0]
    real_fsdp2 = _fsdp_param_group.foreach_all_gather

    def counting(*args, **kwargs):
        count[0] += 1
        return real_fsdp2(*args, **kwargs)
    _fsdp_param_group.foreach_all_gather = counting
    try:
        train(build(torch_fully_shard, 2))
    finally:
        _fsdp_param_group.foreach_all_gather = real_fsdp2
    result = {"gather_sizes": {str(k): sizes.count(k) for k in sorted(set(sizes))}, "fsdp2_gathers": count[0],
              "held_after_forward": held, "losses_bitwise": half_losses == whole_losses,
              "grads_bitwise": all(torch.equal(a, b) for ga, gb in zip(half_grads, whole_grads) for a, b in zip(ga, gb))}
    return finish_rank(out_dir, result)


if __name__ == "__main__":
    sys.exit(main())
