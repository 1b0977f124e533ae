"""One torchrun launch per world size: a free port, a timeout, per-rank logs, no survivors.

Every process of a launch carries `HARNESS_LAUNCH_ID=<uuid>` in its environment. On timeout the
ranks (the processes that also carry LOCAL_RANK) get SIGUSR1, on which the worker's faulthandler
dumps every thread's stack into that rank's log; then every process carrying the id is killed.
The same scan runs after every launch, so no process outlives the run even if torchrun dies
first (its ranks run in sessions of their own, so killing torchrun's group alone is not enough).
When the harness itself is killed, torchrun and the ranks end themselves ([Note: No survivors]
in harness/run/lifeline.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

from harness.run import lifeline
from harness.run.outcome import LaunchResult, RankLog
from harness.run.plan import Cell, RunPlan, write_launch_plan

LAUNCH_ID_VAR = "HARNESS_LAUNCH_ID"
STACK_DUMP_GRACE_S = 1.5


def child_env(launch_id: str, threads: int, extra_pythonpath: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a launch's torchrun and ranks: pinned threads, the project on the path,
    the launch marker and the harness process they must die with."""
    repo_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join([repo_root, *extra_pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        LAUNCH_ID_VAR: launch_id,
        lifeline.PARENT_VAR: lifeline.token(),
    })
    return env


def start_launcher(cmd: list[str], env: dict[str, str], log) -> subprocess.Popen:
    """torchrun in a session of its own (the group kill), dying with this process (SIGKILL included)."""
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=lifeline.child_preexec)


def free_port() -> int:
    """A port the kernel just handed out; parallel runs each get their own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes_with(launch_id: str, also: str | None = None) -> list[int]:
    marker = f"{LAUNCH_ID_VAR}={launch_id}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue  # gone, or not ours to read
        if marker in env and (also is None or any(e.startswith(also.encode()) for e in env)):
            pids.append(int(entry))
    return pids


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_launch(launch_id: str, grace_s: float = 1.0) -> int:
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


def dump_rank_stacks(launch_id: str) -> None:
    """SIGUSR1 to every rank of the launch (the processes that carry LOCAL_RANK), on which the
    rank's faulthandler writes every thread's stack into its log; then the time to write them."""
    _signal_all(_processes_with(launch_id, also="LOCAL_RANK="), signal.SIGUSR1)
    time.sleep(STACK_DUMP_GRACE_S)


def read_rank_logs(log_dir: Path, world_size: int) -> tuple[RankLog, ...]:
    logs = []
    for rank in range(world_size):
        texts = {}
        for stream in ("stdout", "stderr"):
            found = sorted(log_dir.glob(f"**/attempt_*/{rank}/{stream}.log"))
            texts[stream] = found[-1].read_text(errors="replace") if found else ""
        logs.append(RankLog(rank, texts["stdout"], texts["stderr"]))
    return tuple(logs)


def launch(
    plan: RunPlan,
    world_size: int,
    cells: tuple[Cell, ...],
    label: str,
    on_poll: Callable[[], None] | None = None,
) -> LaunchResult:
    """Run `cells` in one torchrun of `world_size` ranks; never raises for a rank's failure."""
    log_dir = (plan.log_dir / label).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    plan_file = log_dir / "plan.json"
    write_launch_plan(plan_file, plan, world_size, cells)
    launch_id = uuid.uuid4().hex
    env = child_env(launch_id, plan.threads, plan.extra_pythonpath)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", f"--nproc-per-node={world_size}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        f"--log-dir={log_dir / 'ranks'}", "--redirects=3",
        "-m", "harness.run.worker", str(plan_file),
    ]
    start = time.monotonic()
    timed_out = False
    with open(log_dir / "torchrun.log", "wb") as launcher_log:
        proc = start_launcher(cmd, env, launcher_log)
        try:
            while proc.poll() is None:
                if time.monotonic() - start > plan.timeout_s:
                    timed_out = True
                    dump_rank_stacks(launch_id)
                    break
                if on_poll is not None:
                    on_poll()
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            leftovers = kill_launch(launch_id)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wall_s = time.monotonic() - start
    return LaunchResult(
        world_size=world_size,
        cell_ids=tuple(c.cell_id for c in cells),
        returncode=proc.returncode if not timed_out else 124,
        timed_out=timed_out,
        wall_s=wall_s,
        rank_logs=read_rank_logs(log_dir / "ranks", world_size),
        launcher_output=(log_dir / "torchrun.log").read_text(errors="replace"),
        log_dir=log_dir,
        leftover_processes_killed=leftovers,
    )
