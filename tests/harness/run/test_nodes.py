"""[Note: Across nodes] (harness/run/nodes.py): two harness processes on this host as two nodes of
two ranks each, meeting at one c10d rendezvous, against one node of four ranks; a node lost
mid-run; flags refused before any rank starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.errors import PlanError
from harness.run.nodes import launch_ranks_by_node
from harness.run.plan import Nodes, build_plan
from harness.run.snapshot import load_snapshot
from tests.harness.run.test_one_launch import _differences, _snapshot_files

REPO = Path(__file__).resolve().parents[3]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(rank: int, count: int, out: Path, port: int, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "harness", "run", *args, "--quiet", "--out", str(out),
                             "--nnodes", str(count), "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
                             "--rdzv-id", f"test{port}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _left_running(marker: str) -> list[str]:
    """Processes whose command line or environment names `marker` (the run's directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if int(pid) != os.getpid() and (marker.encode() in cmd or marker.encode() in env):
            found.append(pid + ": " + cmd.replace(bytes(1), b" ")[:200].decode(errors="replace"))
    return found


@pytest.mark.parametrize("nodes, sizes, message", [
    (Nodes(2, 0, ""), (4,), "needs --rdzv-endpoint HOST:PORT"),
    (Nodes(2, 0, "localhost"), (4,), "needs --rdzv-endpoint HOST:PORT"),
    (Nodes(2, 2, "localhost:29400"), (4,), "--node-rank=2 must be between 0 and --nnodes - 1 = 1"),
    (Nodes(0, 0, "localhost:29400"), (4,), "--nnodes=0 must be >= 1"),
    (Nodes(2, 0, "localhost:29400"), (1, 3), "the launch of 3 ranks .* does not split evenly over 2 nodes"),
    (Nodes(2, 0, "localhost:29400", "a b"), (4,), "--rdzv-id='a b'"),
])
def test_node_flags_are_refused_before_any_rank_starts(tmp_path, nodes, sizes, message):
    with pytest.raises(PlanError, match=message):
        build_plan(cases=("mlp",), impls=("ours",), world_sizes=sizes, out_dir=tmp_path, nodes=nodes)


@pytest.mark.slow
def test_two_nodes_of_two_ranks_are_bitwise_one_node_of_four(tmp_path):
    """The standard cases at W = 4 (and the W = 1 reference), ours and fsdp2, both data modes:
    the same verdicts and the same evidence bit for bit (snapshots kept), the other node exiting
    with node 0's verdict, its ranks having run their share."""
    args = ["--cases", "mlp,transformer", "--impls", "ours,fsdp2", "--world-sizes", "4", "--steps", "2",
            "--keep-evidence", "--timeout", "600"]
    one = subprocess.run([sys.executable, "-m", "harness", "run", *args, "--quiet", "--out", str(tmp_path / "one")],
                         cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=900)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    port = _port()
    follower = _node(1, 2, tmp_path / "two", port, args)
    leader = _node(0, 2, tmp_path / "two", port, args)
    out0, _ = leader.communicate(timeout=900)
    out1, _ = follower.communicate(timeout=120)
    assert (leader.returncode, follower.returncode) == (0, 0), out0[-3000:] + out1[-3000:]
    assert "node 0 ended the run: verdict: pass" in out1
    verdicts = {name: {c["cell_id"]: c["verdict"] for c in json.loads((tmp_path / name / "summary.json").read_text())["cells"]}
                for name in ("one", "two")}
    assert verdicts["one"] == verdicts["two"] and len(verdicts["one"]) == 8
    files = _snapshot_files(tmp_path / "one")
    assert files == _snapshot_files(tmp_path / "two") and len(files) == 2 * 10
    for rel in files:
        diffs = _differences(load_snapshot(tmp_path / "one" / rel), load_snapshot(tmp_path / "two" / rel))
        assert not diffs, (rel, diffs[:5])
    [label] = [p.name for p in (tmp_path / "two" / "nodes").iterdir() if p.is_dir()]
    # torchrun's c10d rendezvous orders the nodes' agents by (host, pid), not by --node-rank: each
    # node holds two consecutive launch ranks, which two is the rendezvous's choice.
    by_node = launch_ranks_by_node(tmp_path / "two", label)
    assert sorted(map(tuple, by_node.values())) == [(0, 1), (2, 3)] and set(by_node) == {0, 1}, by_node
    assert not _left_running(str(tmp_path))


@pytest.mark.slow
def test_a_node_lost_mid_run_ends_the_other_naming_its_ranks(tmp_path):
    """Node 1's harness killed once its ranks run: node 0 ends with an error naming node 1 and its
    launch ranks, well within --timeout, and nothing of either node is left running. Then node 0
    killed: node 1 ends by itself."""
    args = ["--cases", "transformer", "--impls", "ours", "--world-sizes", "4", "--steps", "30", "--timeout", "300"]
    port = _port()
    follower = _node(1, 2, tmp_path / "lost1", port, args)
    leader = _node(0, 2, tmp_path / "lost1", port, args)
    deadline = time.monotonic() + 300
    while not list((tmp_path / "lost1" / "nodes").glob("*/rank-3")) and time.monotonic() < deadline:
        time.sleep(0.2)
    follower.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    out0, _ = leader.communicate(timeout=300)
    assert leader.returncode == 1, out0[-3000:]
    assert time.monotonic() - killed < 60
    report = (tmp_path / "lost1" / "report.md").read_text()
    [label] = [p.name for p in (tmp_path / "lost1" / "nodes").iterdir() if p.is_dir()]
    held = launch_ranks_by_node(tmp_path / "lost1", label)[1]  # the rendezvous's choice (by pid)
    assert held in ([0, 1], [2, 3]) and f"lost node 1 (launch ranks {held[0]}, {held[1]};" in report, report[:3000]
    follower.communicate(timeout=30)
    assert not _left_running(str(tmp_path / "lost1"))

    port = _port()
    follower = _node(1, 2, tmp_path / "lost0", port, args)
    leader = _node(0, 2, tmp_path / "lost0", port, args)
    while not list((tmp_path / "lost0" / "nodes").glob("*/rank-3")) and time.monotonic() < deadline + 300:
        time.sleep(0.2)
    leader.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    out1, _ = follower.communicate(timeout=120)
    assert follower.returncode == 1 and "node 0 stopped answering" in out1, out1[-3000:]
    assert time.monotonic() - killed < 60
    leader.communicate(timeout=30)
    time.sleep(2)  # node 0's ranks end on their own (their harness is gone: [Note: No survivors])
    assert not _left_running(str(tmp_path / "lost0"))


def test_a_node_is_lost_when_silent_and_not_while_it_may_still_start(tmp_path):
    """lost_nodes: a heartbeat older than NODE_LOST_S is a lost node; a node that never beat is
    lost only STARTUP_SKEW_S into the launch (it may start that much after node 0)."""
    from harness.run.nodes import NODE_LOST_S, STARTUP_SKEW_S, lost_nodes, nodes_dir

    nodes_dir(tmp_path).mkdir()
    (nodes_dir(tmp_path) / "node-1.alive").write_text(f"{time.time() - NODE_LOST_S - 5}\n")
    (nodes_dir(tmp_path) / "node-2.alive").write_text(f"{time.time()}\n")
    just_started = time.monotonic()
    assert lost_nodes(tmp_path, 4, just_started) == [1]  # node 3 never beat, but may still start
    assert lost_nodes(tmp_path, 4, just_started - NODE_LOST_S - 5) == [1]  # a late node is not a silent one
    assert lost_nodes(tmp_path, 4, just_started - STARTUP_SKEW_S - 1) == [1, 3]
