"""Run under torchrun: the harness's batched evidence gather of FSDP2 parameters and gradients
(harness/adapters/base.py, [Note: Batched evidence gathers]) is bitwise DTensor.full_tensor() for
awkward dim-0 sizes (fewer rows than ranks, W * k - 1, W * k + 1), a 1-D mesh and, at even W, a
(2, W / 2) HSDP mesh. Writes rank<r>.json into argv[1]."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from harness.adapters.base import full_tensors
from harness.run.rank import rank_epilogue, rank_prologue


def model(world: int) -> nn.Module:
    torch.manual_seed(0)
    rows = sorted({1, max(1, world - 1), world + 1, 2 * world - 1, 2 * world + 1, 3})
    return nn.Sequential(*[nn.Linear(3, r) for r in rows], nn.Linear(3, 2, bias=False))


def main(out: Path) -> None:
    rank_prologue(threads=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = {"1d": init_device_mesh("cpu", (world,))}
    if world % 2 == 0 and world > 2:
        meshes["hsdp"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    results = []
    for label, mesh in meshes.items():
        m = model(world)
        for layer in m:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))
        sum(layer(x).square().sum() for layer in m).backward()
        for grads in (False, True):
            batched = full_tensors(m, grads=grads)
            each = {n: (p.grad if grads else p).full_tensor() for n, p in m.named_parameters()}
            assert all(isinstance(p, DTensor) for p in m.parameters())
            results.append({"mesh": label, "grads": grads, "names": sorted(batched) == sorted(each),
                            "bitwise": all(torch.equal(batched[n], each[n]) and batched[n].shape == each[n].shape
                                           for n in each),
                            "shapes": {n: list(t.shape) for n, t in batched.items()}})
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": world, "results": results}))
    rank_epilogue()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
