"""Run one of tests/rank_scripts under a bare torchrun, for the tests of impl/ that need several
ranks without the harness in between.

A launch that outlives its timeout is a hang (ranks out of step in a collective, most often).
Its ranks (torchrun starts each in a session of its own; they are found as the harness finds its
own, by the launch's marker in their environment: harness/run/launch.py) are sent SIGABRT, which
PYTHONFAULTHANDLER turns into each thread's Python stack on stderr, and the test fails with those
stacks instead of a bare timeout; then nothing of the launch is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from harness.run.launch import LAUNCH_ID_VAR, _processes_with, _signal_all

ROOT = Path(__file__).resolve().parent.parent
RANK_SCRIPTS = Path(__file__).resolve().parent / "rank_scripts"
TAIL_CHARS = 6000  # of a failed launch's output
STACKS_CHARS = 30000  # of a hung one's: every thread of every process


def run_rank_script(name: str | Path, world_size: int, out_dir: Path, *args: str, timeout_s: float = 300) -> list[dict]:
    """Launch rank_scripts/`name` (or a script at an absolute path) at `world_size` with `out_dir` and
    `args`; each rank's JSON."""
    # The checkout under test first: an editable install may point at another checkout (or none).
    tag = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **{LAUNCH_ID_VAR: tag},
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           str(RANK_SCRIPTS / name), str(out_dir), *args]
    what = f"{Path(name).name} at W={world_size}" + (f" with {' '.join(args)}" if args else "")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _abort_one_by_one(_processes_with(tag, ranks_only=True), agent=proc.pid)
        try:
            output, _ = proc.communicate(timeout=30)  # torchrun sees its ranks fail and ends
        except subprocess.TimeoutExpired:
            _signal_all(_processes_with(tag), signal.SIGKILL)
            output, _ = proc.communicate()
        _signal_all(_processes_with(tag), signal.SIGKILL)
        raise AssertionError(f"{what} still running after {timeout_s:.0f} s; "
                             f"the stacks of its processes:\n{output[-STACKS_CHARS:]}") from None
    assert proc.returncode == 0, f"{what} failed:\n{output[-TAIL_CHARS:]}"
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _abort_one_by_one(ranks: list[int], agent: int) -> None:
    """SIGABRT to each rank in turn, the next once the last is dead, so their stacks do not
    interleave; torchrun is stopped meanwhile, or it would end the others at the first death."""
    _signal_all([agent], signal.SIGSTOP)
    try:
        for pid in sorted(ranks):
            _signal_all([pid], signal.SIGABRT)
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        _signal_all([agent], signal.SIGCONT)


def _alive(pid: int) -> bool:
    """Running, and not a zombie (a dead rank stays one while torchrun is stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

