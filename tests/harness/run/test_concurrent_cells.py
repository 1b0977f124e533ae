"""Cells of one world size run side by side in teams of ranks ([Note: One launch, every world
size], harness/run/orchestrate.py): a failed launch is charged to the cell that was running in
the ranks that failed, the other cells it was running run again, and a team's cell says which
launch ranks ran it. The evidence of a team's cell is bitwise that of a launch of its own:
tests/harness/run/test_one_launch.py (its W = 1 cells run in two teams on two cores)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.run.orchestrate import _charged, _ran_in, launch_ranks
from harness.run.outcome import LaunchResult
from harness.run.plan import build_plan
from harness.run.snapshot import started_path
from harness.run.worker import num_teams

REPO = Path(__file__).resolve().parents[3]
PLUGINS = "tests/harness/adapters/test_harness_plugins.py"


def _plan(tmp_path: Path):
    return build_plan(cases=("mlp",), impls=("ours", "fsdp2"), world_sizes=(1, 2), data_modes=("identical", "split"),
                      steps=1, out_dir=tmp_path)


def _started(plan, cell, ranks: list[int], run_id: str | None = None) -> None:
    path = started_path(plan.snapshot_dir, cell.cell_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run_id": run_id or plan.run_id, "cell_id": cell.cell_id, "launch_ranks": ranks}))


def _failed(first_rank: int | None, timed_out: bool = False) -> LaunchResult:
    root = ("" if first_rank is None else
            f"Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-23\n  host      : h\n"
            f"  rank      : {first_rank} (local_rank: {first_rank})\n  exitcode  : 1 (pid: 1)\n")
    return LaunchResult(2, (), 1, timed_out, 3.0, (), "torchrun failed\n" + root, Path("."), 0)


def test_a_failure_is_charged_to_the_cell_running_in_the_rank_that_failed(tmp_path):
    plan = _plan(tmp_path)
    w1 = [c for c in plan.cells if c.world_size == 1]
    _started(plan, w1[0], [0])  # finished is not known here: every cell below is unfinished
    _started(plan, w1[1], [1])
    unfinished = list(w1)
    assert _charged(plan, _failed(1), unfinished) == [w1[1]]
    assert _charged(plan, _failed(0), unfinished) == [w1[0]]
    # no rank named, or one that ran none of them: the first cell running
    assert _charged(plan, _failed(None), unfinished) == [w1[0]]
    assert _charged(plan, _failed(5), unfinished) == [w1[0]]
    # a hang: every cell that was running (the stacks say which hung), not the ones not started
    assert _charged(plan, _failed(None, timed_out=True), unfinished) == [w1[0], w1[1]]


def test_a_cell_not_started_in_this_run_is_not_running(tmp_path):
    plan = _plan(tmp_path)
    w1 = [c for c in plan.cells if c.world_size == 1]
    _started(plan, w1[0], [0], run_id="another-run")  # a record another run left in the same --out
    assert launch_ranks(plan, w1[0]) is None and launch_ranks(plan, w1[1]) is None
    # nothing started: the first unfinished cell, as in a launch of one cell at a time
    assert _charged(plan, _failed(1), w1[1:]) == [w1[1]]


def test_a_cell_of_a_team_says_which_launch_ranks_ran_it(tmp_path):
    plan = _plan(tmp_path)
    w2 = [c for c in plan.cells if c.world_size == 2]
    _started(plan, w2[0], [0, 1])
    _started(plan, w2[1], [2, 3])
    assert _ran_in(plan, w2[0]) == ""
    assert _ran_in(plan, w2[1]).startswith("this cell ran in launch ranks 2-3 as its ranks 0-1")


def test_teams_fill_the_launch_up_to_the_cap():
    assert [num_teams(8, w, 2) for w in (1, 2, 4, 8)] == [2, 2, 2, 1]
    assert [num_teams(8, w, 1 << 30) for w in (1, 2, 3, 4, 8)] == [8, 4, 2, 2, 1]
    assert num_teams(4, 4, 0) == 1


@pytest.mark.slow
def test_a_cell_that_raises_beside_others_errors_alone_and_the_others_pass(tmp_path):
    """W = 1 in two teams (two cores): each planted cell raises while another cell may be running
    in the other team; the planted cells error with their own traceback, named by the launch rank
    that ran them, and every other cell (run again when its launch was ended under it) passes."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--cases", "mlp", "--impls",
                           f"ours,{PLUGINS}:RaiseAtWorldSize1", "--world-sizes", "1,2", "--data", "identical,split",
                           "--steps", "1", "--timeout", "600", "--out", str(out), "--quiet"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    verdicts = {c["cell_id"]: c["verdict"] for c in summary["cells"]}
    planted = {f"mlp.raise_at_w1.w1.{d}" for d in ("identical", "split")}
    assert {c for c, v in verdicts.items() if v != "pass"} == planted, verdicts
    assert len(verdicts) == 8 and summary["references"][0]["verdict"] == "pass"
    for cell in summary["cells"]:
        if cell["cell_id"] in planted:
            error = cell["error"]
            match = re.match(r"this cell ran in launch ranks (\d+)-\1 as its ranks 0-0", error)
            rank = int(match.group(1)) if match else 0
            assert f"first failure: rank {rank}" in error, error[-2000:]
            assert f"[rank {rank}] RuntimeError: planted failure: raises while wrapping at W = 1" in error, error[-2000:]
    assert len(list((out / "logs").iterdir())) >= 3  # each planted cell ended a launch
