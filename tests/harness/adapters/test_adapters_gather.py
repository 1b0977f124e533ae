"""The batched evidence gather of dim-0-sharded DTensors (FSDP2, HSDP) is bitwise full_tensor()
per parameter, for sizes below, at and around the world size (slow tier: torchrun at W = 3, 4)."""

from __future__ import annotations


import pytest
from tests.support.torchrun_script import run_rank_script

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world_size", [3, 4])
def test_batched_gather_is_bitwise_full_tensor(world_size, tmp_path):
    meshes = {"1d", "hsdp"} if world_size == 4 else {"1d"}
    for rank, result in enumerate(run_rank_script("batched_gather.py", world_size, tmp_path)):
        results = result["results"]
        assert {(r["mesh"], r["grads"]) for r in results} == {(m, g) for m in meshes for g in (False, True)}
        for r in results:
            assert r["names"] and r["bitwise"], (rank, r)
            # the sizes the script meant to cover: fewer rows than ranks and W * k -/+ 1
            rows = {shape[0] for shape in r["shapes"].values()}
            assert {1, world_size - 1, world_size + 1, 2 * world_size - 1, 2 * world_size + 1} <= rows, rows
