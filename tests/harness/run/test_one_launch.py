"""[Note: One launch, every world size] (harness/run/orchestrate.py): one torchrun runs the cells
of every world size, each world size in a fresh process group of its own ranks. Its evidence must
be bitwise that of a launch per cell, and a world size that hangs must end alone."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.run.plan import usable_cores
from harness.run.snapshot import load_snapshot, save_snapshot

REPO = Path(__file__).resolve().parents[3]
PLUGINS = "tests/harness/adapters/test_harness_plugins.py"


def _harness(args: list[str], timeout: float) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "harness", *args, "--quiet"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().reshape(-1).clone(memory_format=torch.contiguous_format)
    return bytes(t.view(torch.uint8).numpy()) if t.dtype != torch.bool else bytes(t.numpy())


def _differences(a, b, path: str = "") -> list[str]:
    """Every place two snapshots differ: tensors bit for bit, everything else by value (run_id aside)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape)
                and _bits(a) == _bits(b))
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a if k != "run_id" for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} != {len(b)} entries"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _snapshot_files(out: Path) -> list[Path]:
    return sorted(p.relative_to(out) for p in out.glob("snapshots/*/*.pt"))


@pytest.mark.slow
def test_every_world_size_in_one_launch_is_bitwise_a_launch_of_its_own(tmp_path):
    """W = 1 and 2 in one launch (each in a process group formed after the launch's own was given
    up) against a launch of W = 1 and a launch of W = 2 (each in the launch's own group)."""
    common = ["run", "--cases", "mlp", "--impls", "ours,fsdp2", "--data", "split", "--steps", "2", "--timeout", "600",
              "--keep-evidence"]
    runs = {"both": "1,2", "w1": "1", "w2": "2"}
    for name, sizes in runs.items():
        rc, output = _harness([*common, "--world-sizes", sizes, "--out", str(tmp_path / name)], timeout=1200)
        assert rc == 0, output[-3000:]
        assert len(list((tmp_path / name / "logs").iterdir())) == 1  # one torchrun
    files = _snapshot_files(tmp_path / "both")
    assert len(files) == 2 * 5  # 4 cells and the reference, sgd and adamw
    # W = 1 ran in two teams (two ranks, two cores: harness/run/plan.py max_teams), so cells ran in
    # launch rank 1 as their rank 0, and are compared below like every other.
    ran_in = {p.parent.name: json.loads(p.read_text())["launch_ranks"] for p in (tmp_path / "both").glob("snapshots/*/started.json")}
    assert sorted(ran_in) == sorted({rel.parent.name for rel in files}), ran_in
    teams = {(0,), (1,)} if usable_cores() >= 2 else {(0,)}
    assert {tuple(r) for c, r in ran_in.items() if ".w2." not in c} == teams, ran_in
    own = {rel: tmp_path / ("w1" if ".w1." in str(rel) else "w2") / rel for rel in files}
    assert sorted(set(_snapshot_files(tmp_path / "w1")) | set(_snapshot_files(tmp_path / "w2"))) == files
    for rel in files:
        one = load_snapshot(tmp_path / "both" / rel)
        assert one["steps"] and one["init"]["params"]
        theirs = load_snapshot(own[rel])
        # A reference names the world sizes it serves (the plan's: (1, 2) here, (2,) alone), which
        # its noise covers; at W <= the batch they change no bit, which the tensors still show.
        for snap in (one, theirs):
            snap["cell"].pop("serves", None)
        assert _differences(one, theirs) == [], rel
    # The comparison sees one flipped bit in one element of one step's shadow state.
    rel = Path("snapshots/mlp.fsdp2.w2.split/adamw.pt")
    damaged = load_snapshot(own[rel])
    state = next(iter(damaged["steps"][-1]["shadow"]["state"].values()))
    tensor = next(iter(state.values()))
    tensor.view(-1)[0] = torch.nextafter(tensor.view(-1)[0], torch.tensor(math.inf, dtype=tensor.dtype))
    save_snapshot(tmp_path / "damaged.pt", damaged)
    assert len(_differences(load_snapshot(tmp_path / "both" / rel), load_snapshot(tmp_path / "damaged.pt"))) == 1


@pytest.mark.slow
def test_a_world_size_that_hangs_ends_alone_and_the_larger_one_still_runs(tmp_path):
    out = tmp_path / "out"
    timeout = 60  # per world size; the first one's includes the launch's start-up (as in test_harness_runs)
    rc, output = _harness(["run", "--cases", "mlp", "--impls", f"{PLUGINS}:HangOnRank1AtWorldSize2",
                           "--world-sizes", "2,4", "--data", "identical", "--steps", "1",
                           "--timeout", str(timeout), "--out", str(out)], timeout=900)
    assert rc == 1, output[-3000:]
    cells = {c["world_size"]: c for c in json.loads((out / "summary.json").read_text())["cells"]}
    assert cells[2]["verdict"] == "error" and "launch W=2 timed out" in cells[2]["error"], cells[2]["error"][-2000:]
    assert "[rank 1]" in cells[2]["error"] and "in wrap" in cells[2]["error"], cells[2]["error"][-2000:]
    assert cells[4]["verdict"] == "pass", cells[4]
    # The first launch ran W = 2 and W = 4 (it ended in the hang); the second W = 4 alone.
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["w2_4-0", "w4-1"]
