"""The batched evidence gather of dim-0-sharded DTensors (FSDP2, HSDP) is bitwise full_tensor()
per parameter, for sizes below, at and around the world size (slow tier: torchrun at W = 3, 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "rank_scripts" / "batched_gather.py"
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world_size", [3, 4])
def test_batched_gather_is_bitwise_full_tensor(world_size, tmp_path):
    root = str(Path(__file__).resolve().parent.parent)  # the checkout under test, not an installed copy
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={world_size}", str(SCRIPT), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    meshes = {"1d", "hsdp"} if world_size == 4 else {"1d"}
    for rank in range(world_size):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())["results"]
        assert {(r["mesh"], r["grads"]) for r in results} == {(m, g) for m in meshes for g in (False, True)}
        for r in results:
            assert r["names"] and r["bitwise"], (rank, r)
            # the sizes the script meant to cover: fewer rows than ranks and W * k -/+ 1
            rows = {shape[0] for shape in r["shapes"].values()}
            assert {1, world_size - 1, world_size + 1, 2 * world_size - 1, 2 * world_size + 1} <= rows, rows
