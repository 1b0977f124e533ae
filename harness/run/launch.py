"""The one launcher: a torchrun of W ranks on this host, with a timeout, per-rank logs, stack dumps
and no survivors. Every verb launches through it: run (one launch per world size), the fuzz and
mutants pool (a persistent launch fed through a TCPStore) and bench.

Every process of a launch carries `HARNESS_LAUNCH_ID=<uuid>` in its environment. On timeout the
ranks (those that carry LOCAL_RANK, or forked ones, named harness-rank<N>) get SIGUSR1, on which
the rank's faulthandler (harness/run/rank.py) dumps every thread's stack into its log; then every process
carrying the id is killed. The same scan runs after every launch, so no process outlives the run
even if torchrun dies first (its ranks run in sessions of their own, so killing torchrun's group
alone is not enough). When the harness itself is killed, torchrun and the ranks end themselves
([Note: No survivors] in harness/run/lifeline.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from harness.run import lifeline
from harness.run.nodes import (HEARTBEAT_S, LAUNCH_LABEL_VAR, NODE_LOST_S, NODE_RANK_VAR, NODES_DIR_VAR, announce_launch,
                               lost_nodes, lost_text, nodes_dir, rank_places)
from harness.run.outcome import LaunchResult, RankLog, failure_blocks
from harness.run.plan import Cell, RunPlan, num_parameters, write_launch_plan

LAUNCH_ID_VAR = "HARNESS_LAUNCH_ID"
STACK_DUMP_GRACE_S = 1.5
POLL_S = 0.2
# Seconds a launch's ranks have to exit once their work is done (every cell complete, the fuzz
# pool told to stop): a rank hanging in destroy_process_group or an atexit hook costs this, not
# a whole timeout. Their evidence is not judged then (harness/run/orchestrate.py).
EXIT_GRACE_S = 60.0
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class NodeLaunch:
    """This node's part of a launch across nodes ([Note: Across nodes] in harness/run/nodes.py)."""

    count: int
    rank: int
    endpoint: str  # HOST:PORT of the c10d rendezvous
    rdzv_id: str  # this launch's own
    nodes_dir: Path  # where the ranks say which node they run on
    label: str  # the launch's label (its log directory's name on node 0)


@dataclass(frozen=True)
class TorchrunSpec:
    """`python -m <module> <args>` in each of `world_size` ranks of one torchrun on this host.

    The backend and device are not here: a rank reads them from the configuration file its args
    name (the launch plan's Cells, the pool's config), the only configuration a rank reads."""

    world_size: int
    module: str
    args: tuple[str, ...]
    log_dir: Path  # torchrun.log and ranks/<attempt>/<rank>/{stdout,stderr}.log
    timeout_s: float | None  # None: the caller polls and decides (the fuzz pool: per request)
    threads: int = 1  # intra-op threads per rank
    extra_pythonpath: tuple[str, ...] = ()  # directories of a user's --impls / --cases files
    extra_env: tuple[tuple[str, str], ...] = ()  # (name, value) set in the ranks' environment (bench)
    # Ranks forked from a fork server that imported their module once ([Note: Forked ranks],
    # harness/run/prefork.py) instead of started by torchrun's command line, each importing torch.
    prefork: bool = False
    nodes: NodeLaunch | None = None  # None: every rank on this host
    # W simulated ranks as threads of one process instead of W processes ([Note: A simulated
    # launch] in harness/run/simulated.py); its logs and outcome read as a torchrun's.
    simulated: bool = False

    def __post_init__(self) -> None:
        if self.simulated and (self.nodes is not None or self.prefork):
            raise ValueError("a simulated launch runs in one process on this host: no nodes, no fork server")
        if self.nodes is not None and self.world_size % self.nodes.count:
            raise ValueError(f"TorchrunSpec world_size={self.world_size} does not split over {self.nodes.count} nodes")
        if self.world_size < 1 or self.threads < 1:
            raise ValueError(f"TorchrunSpec world_size={self.world_size} threads={self.threads} must be >= 1")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"TorchrunSpec timeout_s={self.timeout_s} must be > 0 or None")


class Launch:
    """One torchrun: start, poll, dump the ranks' stacks, kill (idempotent), read the logs.

    `run()` does all of it for a launch that ends by itself; a caller that talks to its ranks
    while they run (the fuzz pool) calls the pieces and `kill()` when done."""

    def __init__(self, spec: TorchrunSpec) -> None:
        self.spec = spec
        self.launch_id = uuid.uuid4().hex
        self.log_dir = spec.log_dir.resolve()
        self.started_at = 0.0  # time.monotonic() at start()
        self.leftover_processes_killed = 0
        self._proc: subprocess.Popen | None = None
        self._launcher_log = None

    def start(self) -> None:
        spec = self.spec
        self.log_dir.mkdir(parents=True, exist_ok=True)
        nodes = spec.nodes
        if spec.simulated:
            where = [sys.executable, "-m", "harness.run.simulated", f"--world-size={spec.world_size}",
                     f"--log-dir={self.log_dir / 'ranks'}"]
        elif nodes is None:
            where = [sys.executable, "-m", "harness.run.prefork" if spec.prefork else "torch.distributed.run",
                     "--nnodes=1", f"--nproc-per-node={spec.world_size}",
                     "--master-addr=127.0.0.1", f"--master-port={_free_port()}"]
        else:  # torchrun's own c10d rendezvous; every rank starts from the command line
            where = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes.count}",
                     f"--nproc-per-node={spec.world_size // nodes.count}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={nodes.endpoint}", f"--rdzv-id={nodes.rdzv_id}", "--max-restarts=0"]
        cmd = [*where, *(() if spec.simulated else (f"--log-dir={self.log_dir / 'ranks'}", "--redirects=3")),
               "-m", spec.module, *spec.args]
        self._launcher_log = open(self.log_dir / "torchrun.log", "wb")
        self.started_at = time.monotonic()
        # torchrun in a session of its own (the group kill), dying with this process (SIGKILL included).
        extra_env = spec.extra_env
        if nodes is not None:
            extra_env += ((NODE_RANK_VAR, str(nodes.rank)), (NODES_DIR_VAR, str(nodes.nodes_dir)),
                          (LAUNCH_LABEL_VAR, nodes.label))
        self._proc = subprocess.Popen(cmd, env=_child_env(self.launch_id, spec.threads, spec.extra_pythonpath, extra_env),
                                      stdout=self._launcher_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, preexec_fn=lifeline.child_preexec)

    def poll(self) -> int | None:
        """torchrun's exit status, or None while it runs."""
        return self._proc.poll()

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def wait(self, timeout_s: float) -> bool:
        """Whether torchrun exited within `timeout_s`."""
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def dump_stacks(self) -> None:
        """SIGUSR1 to every rank (the processes of the launch that carry LOCAL_RANK, or, forked,
        are named harness-rank<N>): each writes every thread's stack into its log; then the time
        to write them. torchrun and a fork server would die of it."""
        _signal_all(_processes_with(self.launch_id, ranks_only=True), signal.SIGUSR1)
        time.sleep(STACK_DUMP_GRACE_S)

    def kill(self) -> None:
        """End torchrun's group, then every process of the launch; safe to call twice."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.leftover_processes_killed += _kill_launch(self.launch_id)
        if not self.wait(10):
            self._proc.kill()
            self._proc.wait()
        if not self._launcher_log.closed:
            self._launcher_log.close()

    def rank_logs(self) -> tuple[RankLog, ...]:
        if self.spec.nodes is None:
            return _read_rank_logs(self.log_dir / "ranks", self.spec.world_size)
        return _read_node_rank_logs(self.log_dir, self.spec.nodes, self.spec.world_size)

    def launcher_output(self) -> str:
        if not self._launcher_log.closed:
            self._launcher_log.flush()
        return (self.log_dir / "torchrun.log").read_text(errors="replace")

    def failure_text(self, head: str) -> str:
        """`head`, then each rank's traceback or stacks as one prefixed block (torchrun's tail if none)."""
        return head + "\n" + failure_blocks(self.rank_logs(), self.launcher_output(), stacks=True)

    def run(self, on_poll: Callable[[], None] | None = None,
            overdue: Callable[[float], bool] | None = None) -> LaunchResult:
        """Start, wait for the end or the timeout (stacks dumped), kill what is left; never raises
        for a rank's failure. `overdue(timeout_s)`: whether the launch has run past its timeout
        (default: the seconds since the start exceed it; a launch of several world sizes counts
        from the start of the current one, and gives ranks whose work is done a shorter time to exit)."""
        self.start()
        timed_out = False
        overdue = overdue or (lambda timeout_s: time.monotonic() - self.started_at > timeout_s)
        try:
            while self.poll() is None:
                if self.spec.timeout_s is not None and overdue(self.spec.timeout_s):
                    timed_out = True
                    self.dump_stacks()
                    break
                if on_poll is not None:
                    on_poll()
                time.sleep(POLL_S)
        finally:
            self.kill()
        return LaunchResult(
            world_size=self.spec.world_size,
            cell_ids=(),
            returncode=self.returncode if not timed_out else 124,
            timed_out=timed_out,
            wall_s=time.monotonic() - self.started_at,
            rank_logs=self.rank_logs(),
            launcher_output=self.launcher_output(),
            log_dir=self.log_dir,
            leftover_processes_killed=self.leftover_processes_killed,
        )

    def __enter__(self) -> Launch:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def launch(
    plan: RunPlan,
    world_size: int,
    cells: tuple[Cell, ...],
    label: str,
    on_poll: Callable[[], None] | None = None,
    overdue: Callable[[float], bool] | None = None,
) -> LaunchResult:
    """Run `cells` in one torchrun of `world_size` ranks (harness/run/worker.py; cells of smaller
    world sizes run in the ranks below theirs); never raises for a rank's failure."""
    log_dir = plan.log_dir / label
    log_dir.mkdir(parents=True, exist_ok=True)
    plan_file = (log_dir / "plan.json").resolve()
    write_launch_plan(plan_file, plan, world_size, cells)
    threshold = returned_block_threshold(plan, cells)
    extra_env = ((("MALLOC_MMAP_THRESHOLD_", str(threshold)),)
                 if threshold is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ else ())  # a user's own setting wins
    nodes = None
    if plan.nodes.many:  # [Note: Across nodes]: the other nodes start their part of it from this file
        seq = len(list(nodes_dir(plan.out_dir).glob("launch-*.json")))
        nodes = NodeLaunch(plan.nodes.count, 0, plan.nodes.endpoint, f"{plan.nodes.rdzv_id}-{plan.run_id[:8]}-{seq}",
                           nodes_dir(plan.out_dir).resolve(), label)
        announce_launch(plan.out_dir, seq, {
            "run_id": plan.run_id, "label": label, "world_size": world_size, "nnodes": nodes.count,
            "endpoint": nodes.endpoint, "rdzv_id": nodes.rdzv_id, "plan_file": str(plan_file),
            "log_dir": str(log_dir.resolve()), "threads": plan.threads, "extra_pythonpath": list(plan.extra_pythonpath),
            "extra_env": [list(kv) for kv in extra_env], "module": "harness.run.worker"})
    timeout_s = max(plan.timeout_for(w) for w in {(plan.world_sizes[0] if c.is_reference else c.world_size) for c in cells})
    simulated = plan.backend == "simulated"
    spec = TorchrunSpec(world_size, "harness.run.worker", (str(plan_file),), log_dir, timeout_s, plan.threads,
                        plan.extra_pythonpath, prefork=plan.device == "cpu" and not simulated, extra_env=extra_env,
                        nodes=nodes, simulated=simulated)
    lost: list[int] = []
    if nodes is not None:
        started = time.monotonic()

        def overdue(timeout_s: float, inner=overdue or (lambda t: time.monotonic() - started > t)) -> bool:
            lost[:] = lost_nodes(plan.out_dir, plan.nodes.count, started)
            return bool(lost) or inner(timeout_s)
    result = Launch(spec).run(on_poll, overdue)
    result = dataclasses.replace(result, cell_ids=tuple(c.cell_id for c in cells))
    if nodes is not None and not result.ok and not lost:
        # Ranks here often fail at once when a node is lost (a peer's connection reset), before its
        # heartbeat is old enough to say so: wait that long for it, on failed launches only.
        deadline = time.monotonic() + NODE_LOST_S + HEARTBEAT_S
        while not lost and time.monotonic() < deadline:
            time.sleep(HEARTBEAT_S)
            lost[:] = lost_nodes(plan.out_dir, plan.nodes.count, started)
    if lost:
        result = dataclasses.replace(result, note=lost_text(plan.out_dir, label, lost))
    return result


def follower_launch(payload: dict, log_dir: Path, node_rank: int, nodes_directory: Path) -> Launch:
    """This node's part of the launch node 0 announced in `payload` ([Note: Across nodes]), started."""
    nodes = NodeLaunch(int(payload["nnodes"]), node_rank, payload["endpoint"], payload["rdzv_id"],
                       nodes_directory.resolve(), payload["label"])
    spec = TorchrunSpec(int(payload["world_size"]), payload["module"], (payload["plan_file"],), log_dir, None,
                        int(payload["threads"]), tuple(payload["extra_pythonpath"]),
                        tuple(tuple(kv) for kv in payload["extra_env"]), nodes=nodes)
    launch = Launch(spec)
    launch.start()
    return launch


# [Note: Freed memory kept]
# The ranks' checks compute with model-sized float64 tensors (a replay's sums, a judge's flat
# tensors), freed and allocated again many times per step. glibc serves every allocation above its
# mmap threshold (at most 32 MiB by default) with a fresh mapping and unmaps it on free, so each
# one is page-faulted and zero-filled again: measured on this VM, 30 float64 copies and absolute
# values of a 16.8M-element tensor took 3.8 s, 3.1 s of it in the kernel, and 0.8 s with the two
# settings below, which keep freed memory in the heap for the next allocation of its size (as
# PyTorch's CUDA caching allocator does on a GPU). The arithmetic, and so every bit of evidence,
# is the same; only where the memory comes from changes. Ranks that judge return blocks from a
# size on ([Note: Freed memory returned]).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 40), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
# [Note: Huge pages for model-sized tensors]
# Whether freed memory is kept or returned, a model-sized tensor is mapped in 4 KiB pages, and
# each page it touches for the first time is a fault the kernel serves and zero-fills: measured
# on this VM, promoting 124M float32 values to a fresh float64 tensor took 0.42 s, 0.06 s of it
# the conversion. PyTorch's CPU allocator aligns every block of 2 MiB or more to 2 MiB and advises
# the kernel to back it with transparent huge pages when THP_MEM_ALLOC_ENABLE is set: 512 times
# fewer faults, the same promotion in 0.12 s where freed blocks are returned and 0.05 s where they
# are kept, and a 124M-parameter GPT-2's `harness run` at W = 2 in 251 s instead of 301 (the same
# tree, one run after the other; docs/error_model.md, "Where the time goes"). Where the kernel
# offers no transparent huge pages, or an older PyTorch does not read the variable, nothing
# changes; the arithmetic, and so every bit of evidence, is the same either way.
HUGE_PAGES_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}
# [Note: Freed memory returned]
# Kept in the heap, freed memory stays in a rank's RSS between its uses, as free chunks among live
# ones: measured on this VM for a GPT-2 small (124M parameters) at W = 2 judged on the ranks, the
# cell's rank 0 reached 13 GB and its rank 1 11.7 GB, and the kernel killed a rank of the 23 GB
# machine; for a GPT-2 of 16.8M parameters the largest rank's RSS was 300-400 MiB above its live
# tensors at its peak (its judge's and its noise's temporaries, freed, between live blocks). So the
# ranks of a launch that judges on the ranks, on CPUs, map every block from a threshold on its own
# and unmap it when freed, and a rank's RSS follows its live tensors above that size, at the cost
# of page faults and zero-filling for each such block allocated again. That cost grows with the
# bytes of such blocks a step allocates, so the threshold grows with the model: 1/32 of the largest
# judged model's float32 bytes (RETURNED_BLOCK_FRACTION) rounded to the nearest power of two (the
# judge's pieces and the chunks are powers of two in size: a threshold a few bytes above one of them
# would keep every such temporary), at least 2 MiB (the huge-page size, from which PyTorch's CPU
# allocator aligns a block for transparent huge pages: one fault per 2 MiB) and at most 32 MiB
# (glibc's largest default). Measured on this VM, `harness run` at W = 2, split, 2 AdamW steps,
# the largest process's maxrss:
#   GPT-2 d384 (16.8M; 2 MiB): 1638 -> 1400 MiB, 37 s -> 37 s (2.1 MB: 1433 MiB; 4 MiB: 1473 MiB);
#   GPT-2 small (124M; 16 MiB): 206 s at 32 MiB, 204 s at 14.8 MiB (ranks 8.4 GB), 237 s at 2 MiB
#   (ranks 7.9 GB); the heap keeping everything was slower still (219 s, 10.2 GB). Its failing run
#   (`--faults grad_scale_1e-5`, the same first divergence either way) took 394 s at 16 MiB and 326 s
#   at 32 MiB: what the failing judge allocates in 16-32 MiB blocks is not chunked yet (issue 31).
# A block below the threshold (a layer's tensor of a large model, the judge's chunks) is reused from
# the heap between the releases of freed memory (`release_freed_memory`). The bits are the same.
RETURNED_BLOCK_FRACTION = 32
RETURNED_BLOCK_BOUNDS = (2 << 20, 32 << 20)


def returned_block_threshold(plan: RunPlan, cells: tuple[Cell, ...]) -> int | None:
    """The size from which this launch's ranks return freed blocks to the system ([Note: Freed
    memory returned]): on CPUs, where a model is judged on the ranks; None where the heap keeps them."""
    judged = {c.case for c in cells} & set(plan.judged_on_ranks)
    if plan.device != "cpu" or not judged:
        return None
    low, high = RETURNED_BLOCK_BOUNDS
    share = 4 * max(num_parameters(c) for c in judged) / RETURNED_BLOCK_FRACTION
    return min(high, max(low, 2 ** round(math.log2(max(share, 1)))))


def _child_env(launch_id: str, threads: int, extra_pythonpath: tuple[str, ...] = (),
               extra_env: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """The environment of a launch's torchrun and ranks: pinned threads, the project on the path,
    the launch marker and the harness process they must die with."""
    env = dict(os.environ, **dict(extra_env))
    for name, value in {**MALLOC_ENV, **HUGE_PAGES_ENV}.items():
        env.setdefault(name, value)  # a user's own setting wins
    env.update({
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *extra_pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        LAUNCH_ID_VAR: launch_id,
        lifeline.PARENT_VAR: lifeline.token(),
    })
    return env


def _free_port() -> int:
    """A port the kernel just handed out; parallel runs each get their own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes_with(launch_id: str, ranks_only: bool = False) -> list[int]:
    """The processes carrying the launch's marker; with `ranks_only`, its ranks: those started by
    torchrun's command line carry LOCAL_RANK, forked ones are named (harness/run/prefork.py)."""
    marker = f"{LAUNCH_ID_VAR}={launch_id}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if marker in env and ranks_only and not any(e.startswith(b"LOCAL_RANK=") for e in env):
                with open(f"/proc/{entry}/comm") as f:
                    if not f.read().startswith(lifeline.RANK_NAME_PREFIX):
                        continue
        except OSError:
            continue  # gone, or not ours to read
        if marker in env:
            pids.append(int(entry))
    return pids


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_launch(launch_id: str, grace_s: float = 1.0) -> int:
    """SIGTERM then SIGKILL every process of the launch; returns how many were found."""
    pids = _processes_with(launch_id)
    if not pids:
        return 0
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _processes_with(launch_id):
        time.sleep(0.05)
    _signal_all(_processes_with(launch_id), signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and _processes_with(launch_id):
        time.sleep(0.05)
    return len(pids)


def _read_node_rank_logs(log_dir: Path, nodes: NodeLaunch, world_size: int) -> tuple[RankLog, ...]:
    """Every launch rank's logs across the nodes (node 0's under `log_dir`, node k's under
    `log_dir`/node<k>), found by the node and local rank each rank recorded; empty for a rank that
    recorded none (it never started)."""
    where = rank_places(nodes.nodes_dir, nodes.label)
    logs = []
    for rank in range(world_size):
        texts = {"stdout": "", "stderr": ""}
        if rank in where:
            node, local = where[rank]
            base = (log_dir if node == 0 else log_dir / f"node{node}") / "ranks"
            for stream in texts:
                found = sorted(base.glob(f"**/attempt_*/{local}/{stream}.log"))
                texts[stream] = found[-1].read_text(errors="replace") if found else ""
        logs.append(RankLog(rank, texts["stdout"], texts["stderr"]))
    return tuple(logs)


def _read_rank_logs(log_dir: Path, world_size: int) -> tuple[RankLog, ...]:
    logs = []
    for rank in range(world_size):
        texts = {}
        for stream in ("stdout", "stderr"):
            found = sorted(log_dir.glob(f"**/attempt_*/{rank}/{stream}.log"))
            texts[stream] = found[-1].read_text(errors="replace") if found else ""
        logs.append(RankLog(rank, texts["stdout"], texts["stderr"]))
    return tuple(logs)
