"""A run across nodes: every node runs the same `harness run` command with its own --node-rank;
node 0 plans, launches, judges and reports, the others run their share of every launch's ranks and
exit with node 0's verdict. Standard library only.

[Note: Across nodes]
The nodes share the run's --out directory (a shared filesystem, as a cluster's job directory is;
on one host, the same path). Through it, and through torchrun's own c10d rendezvous:
- Node 0 writes `nodes/leader.json` (its run id and start time) once its output directory is
  its own, then, before each launch, `nodes/launch-<n>.json`: the launch plan file its ranks read
  (in the shared directory), the world size, the rendezvous id of that launch and what the ranks'
  environment needs (threads, the user's --cases / --impls directories). Each node starts one
  torchrun agent per launch with `--nnodes N --nproc-per-node W/N --rdzv-backend c10d`; the ranks
  read the same plan and write their records into the same snapshots directory, so node 0 sees
  every cell complete (or not) as on one node, and the evidence is the same bits (the ranks'
  arithmetic does not know which host it runs on).
- Every rank writes `nodes/<label>/rank-<R>` with its node, so node 0 names the ranks of a node it
  lost. Every harness process touches `nodes/node-<k>.alive` while it runs; one not touched for
  NODE_LOST_S (or never, STARTUP_SKEW_S into a launch) is a lost node: node 0 ends its launch at
  once (its ranks would wait on the lost ones until --timeout) and charges the running cells with
  an error naming the node and its ranks; a node that loses node 0 ends its own launch and exits 1.
- Node 0 ends by writing `nodes/verdict.json` (the exit code it returns, whatever ended it: a
  verdict, a refused flag, a lost node); the others exit with that code. A node started before
  node 0 waits for a `leader.json` of a run that has no verdict yet and began at most
  STARTUP_SKEW_S before it (the files of an earlier run in the same directory are not followed).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

NODES_DIR = "nodes"
NODE_LOST_S = 30.0  # a node's heartbeat older than this: the node is gone (it beats every HEARTBEAT_S)
HEARTBEAT_S = 1.0
STARTUP_SKEW_S = 120.0  # how much earlier than a following node node 0 may have started
NODE_RANK_VAR = "HARNESS_NODE_RANK"
NODES_DIR_VAR = "HARNESS_NODES_DIR"
LAUNCH_LABEL_VAR = "HARNESS_LAUNCH_LABEL"


def nodes_dir(out_dir: Path) -> Path:
    return Path(out_dir) / NODES_DIR


def _write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class Heartbeat:
    """`nodes/node-<rank>.alive`, rewritten every HEARTBEAT_S by a daemon thread from `start()` for
    as long as the process lives (judging and reporting included): it stops when the process dies."""

    def __init__(self, out_dir: Path, node_rank: int) -> None:
        self.path = nodes_dir(out_dir) / f"node-{node_rank}.alive"
        self._stop = threading.Event()

    def beat(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(f"{time.time():.3f}\n")

    def start(self) -> Heartbeat:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.beat()
                except OSError:
                    pass  # the directory went away (the run is ending)
                self._stop.wait(HEARTBEAT_S)
        threading.Thread(target=loop, name="harness-heartbeat", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()


def silent_for(out_dir: Path, node_rank: int) -> float | None:
    """Seconds since node `node_rank` last beat (None: it never has)."""
    try:
        return max(0.0, time.time() - float((nodes_dir(out_dir) / f"node-{node_rank}.alive").read_text()))
    except (OSError, ValueError):
        return None


def lost_nodes(out_dir: Path, count: int, since: float) -> list[int]:
    """The nodes other than 0 silent for NODE_LOST_S, of those that beat at least once, or that never
    beat though the launch began more than STARTUP_SKEW_S ago (`since`, time.monotonic()): a node may
    start that much after node 0."""
    lost = []
    for node in range(1, count):
        silent = silent_for(out_dir, node)
        if (silent is not None and silent > NODE_LOST_S) or (silent is None and time.monotonic() - since > STARTUP_SKEW_S):
            lost.append(node)
    return lost


def announce_leader(out_dir: Path, run_id: str, rdzv_id: str) -> None:
    _write_json(nodes_dir(out_dir) / "leader.json", {"run_id": run_id, "rdzv_id": rdzv_id, "created": time.time()})


def announce_launch(out_dir: Path, seq: int, payload: dict) -> None:
    _write_json(nodes_dir(out_dir) / f"launch-{seq}.json", payload)


def announce_verdict(out_dir: Path, run_id: str, exit_code: int, line: str) -> None:
    _write_json(nodes_dir(out_dir) / "verdict.json", {"run_id": run_id, "exit": exit_code, "line": line})


def rank_places(directory: Path, label: str) -> dict[int, tuple[int, int]]:
    """{launch rank: (node, local rank)} of the launch `label`, from the files its ranks wrote at
    start (`record_rank`) under `directory` (an out dir's nodes/); a rank that wrote none is absent."""
    found: dict[int, tuple[int, int]] = {}
    for path in (Path(directory) / label).glob("rank-*"):
        try:
            node, local = path.read_text().split()[:2]
            found[int(path.name.removeprefix("rank-"))] = (int(node), int(local))
        except (OSError, ValueError):
            continue
    return found


def launch_ranks_by_node(out_dir: Path, label: str) -> dict[int, list[int]]:
    """{node: its launch ranks} of the launch `label`."""
    found: dict[int, list[int]] = {}
    for rank, (node, _) in sorted(rank_places(nodes_dir(out_dir), label).items()):
        found.setdefault(node, []).append(rank)
    return dict(sorted(found.items()))


def record_rank() -> None:
    """In a rank of a launch across nodes (its environment says so): write which node it runs on."""
    directory, label = os.environ.get(NODES_DIR_VAR), os.environ.get(LAUNCH_LABEL_VAR)
    if not directory or not label:
        return
    path = Path(directory) / label / f"rank-{os.environ['RANK']}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.environ.get(NODE_RANK_VAR, '?')} {os.environ.get('LOCAL_RANK', '?')}\n")


def lost_text(out_dir: Path, label: str, nodes: list[int]) -> str:
    """What a launch that lost `nodes` tells the cells it charges."""
    ranks = launch_ranks_by_node(out_dir, label)
    parts = []
    for node in nodes:
        silent = silent_for(out_dir, node)
        held = ranks.get(node)
        parts.append(f"node {node} (launch ranks {', '.join(map(str, held)) if held else 'not known: none started'}"
                     f"; its harness {'never' if silent is None else 'last'} answered"
                     f"{'' if silent is None else f' {silent:.0f} s ago'})")
    return f"lost {'; '.join(parts)}: its ranks are gone, and the ranks here waited on them"


class Follower:
    """A node other than 0 ([Note: Across nodes]): waits for node 0's run, runs its share of each
    launch, and returns node 0's exit code (1 if node 0 is lost)."""

    def __init__(self, out_dir: Path, node_rank: int, rdzv_id: str, say=print) -> None:
        self.out_dir, self.node_rank, self.rdzv_id, self.say = Path(out_dir), node_rank, rdzv_id, say
        self.heartbeat = Heartbeat(self.out_dir, node_rank)
        self.started = time.time()

    def _leader(self) -> dict | None:
        leader = _read_json(nodes_dir(self.out_dir) / "leader.json")
        if leader is None or leader.get("rdzv_id") != self.rdzv_id:
            return None
        if float(leader.get("created", 0)) < self.started - STARTUP_SKEW_S:
            return None
        verdict = _read_json(nodes_dir(self.out_dir) / "verdict.json")
        if verdict is not None and verdict.get("run_id") == leader.get("run_id"):
            return None  # a finished run's files
        return leader

    def _leader_lost(self, since: float) -> bool:
        silent = silent_for(self.out_dir, 0)
        return (silent is not None and silent > NODE_LOST_S) or (silent is None and time.monotonic() - since > NODE_LOST_S)

    def run(self, start_launch, poll_s: float = 0.2, wait_s: float = 3600.0) -> int:
        """`start_launch(payload, log_dir)` starts this node's part of a launch and returns an object
        with poll() and kill() (harness/run/launch.py Launch)."""
        self.say(f"[harness] node {self.node_rank}: waiting for node 0 in {self.out_dir}")
        deadline = time.monotonic() + wait_s
        leader = None
        while leader is None:
            leader = self._leader()
            if leader is None and time.monotonic() > deadline:
                self.say(f"[harness] node {self.node_rank}: node 0 did not start a run in {wait_s:.0f} s")
                return 1
            time.sleep(poll_s)
        run_id, seq, since = leader["run_id"], 0, time.monotonic()
        self.heartbeat.start()  # node 0's directory is its own now: this node's heartbeat goes there
        try:
            return self._follow(run_id, seq, since, start_launch, poll_s)
        finally:
            self.heartbeat.stop()

    def _follow(self, run_id: str, seq: int, since: float, start_launch, poll_s: float) -> int:
        while True:
            verdict = _read_json(nodes_dir(self.out_dir) / "verdict.json")
            if verdict is not None and verdict.get("run_id") == run_id:
                self.say(f"[harness] node {self.node_rank}: node 0 ended the run: {verdict.get('line', '')}")
                return int(verdict.get("exit", 1))
            payload = _read_json(nodes_dir(self.out_dir) / f"launch-{seq}.json")
            if payload is not None and payload.get("run_id") == run_id:
                log_dir = Path(payload["log_dir"]) / f"node{self.node_rank}"
                self.say(f"[harness] node {self.node_rank}: launch {payload['label']} "
                         f"({payload['world_size']} ranks over {payload['nnodes']} nodes)")
                launch = start_launch(payload, log_dir)
                try:
                    while launch.poll() is None:
                        if self._leader_lost(since):
                            self.say(f"[harness] node {self.node_rank}: node 0 stopped answering (its heartbeat "
                                     f"is over {NODE_LOST_S:.0f} s old); ended this node's ranks")
                            return 1
                        time.sleep(poll_s)
                finally:
                    launch.kill()
                seq += 1
                continue
            if self._leader_lost(since):
                self.say(f"[harness] node {self.node_rank}: node 0 stopped answering (its heartbeat is over "
                         f"{NODE_LOST_S:.0f} s old)")
                return 1
            time.sleep(poll_s)
