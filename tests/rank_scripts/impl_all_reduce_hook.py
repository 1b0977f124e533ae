"""Run under torchrun at W = 4: FSDP2's custom HSDP. The model is sharded over groups of 2 ranks
(1-D meshes {0, 1} and {2, 3}) and `set_all_reduce_hook` all-reduces each reduced shard gradient
over the ranks holding the same shard ({0, 2}, {1, 3}) and halves it: the gradients must be those of
native HSDP on a (2 replicas, 2 shards) mesh, bitwise (each division is by a power of 2, exact, and
the same terms are summed in the same order). Without the hook they are each half's own average.
One JSON file per rank.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import impl
from cases.models import TransformerConfig, TransformerLM, lm_loss
from harness.run.rank import rank_prologue
from tests.support.torchrun_script import finish_rank

CFG = TransformerConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=18)


def batch():
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    idx = torch.randint(0, 37, (4, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def grads(model) -> dict[str, torch.Tensor]:
    x, y = batch()
    lm_loss(model(x), y).backward()
    return impl.full_grad_dict(model)


def build(mesh) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(CFG)
    for block in model.blocks:
        impl.fully_shard(block, mesh=mesh)
    return impl.fully_shard(model, mesh=mesh)


def main() -> int:
    out_dir = sys.argv[1]
    rank_prologue(threads=1)
    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine, peers = halves[rank // 2], across[rank % 2]
    shard_mesh = DeviceMesh.from_group(mine, "cpu", dist.get_process_group_ranks(mine), mesh_dim_names=("shard",))
    calls = [0]

    def hook(grad: torch.Tensor) -> None:
        calls[0] += 1
        dist.all_reduce(grad, group=peers)
        grad.div_(2)

    custom = build(shard_mesh)
    for module in custom.modules():
        if isinstance(module, impl.FSDPModule):
            module.set_all_reduce_hook(hook)
    with_hook = grads(custom)
    without_hook = grads(build(shard_mesh))
    native = grads(build(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))))
    result = {
        "hook_calls": calls[0],
        "bitwise_native": all(torch.equal(with_hook[n], native[n]) for n in native),
        "without_hook_differs": any(not torch.equal(without_hook[n], native[n]) for n in native),
        "nonzero": any(bool((g != 0).any()) for g in native.values()),
    }
    return finish_rank(out_dir, result)


if __name__ == "__main__":
    sys.exit(main())
