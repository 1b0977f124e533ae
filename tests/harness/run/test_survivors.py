"""Nothing left running, nothing lost (slow tier: real launches).

- SIGTERM or SIGKILL of the harness while a rank hangs: no process of the run is alive 10 s later,
  found by the launch marker (HARNESS_LAUNCH_ID) in /proc/*/environ;
- a rank of the fuzzer's pool killed from outside: one clear line and exit 1, not a flaky example;
- a run with the default --out leaves `git status` clean.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.scratch_repo import REPO, copy_project, git, harness, init_repo

PLUGINS = "tests/harness/adapters/test_harness_plugins.py"
TAG_VAR = "HARNESS_TEST_TAG"  # set by the test, inherited by every process the harness starts
# How long the test waits for processes to go: a guard against waiting forever on a loaded machine,
# not a speed claim (the parent-death signal and the watchdog end them; `bench` measures nothing here).
GONE_WITHIN_S = 120.0


def _processes(tag: str, *markers: str, name: str = "") -> list[int]:
    """Processes started for this test (TAG_VAR=tag) that carry every one of `markers` and whose
    name starts with `name` (a rank's is harness-rank<N>: a forked rank's environ is its launcher's)."""
    wanted = [f"{TAG_VAR}={tag}".encode()] + [m.encode() for m in markers]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue  # gone
        if all(any(e.startswith(w) for e in env) for w in wanted) and comm.startswith(name):
            found.append(int(entry))
    return found


def _describe(pids: list[int]) -> str:
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            out.append(f"{pid}: (gone)")
    return "\n".join(out)


def _wait_gone(tag: str) -> list[int]:
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:
        alive = _processes(tag, "HARNESS_LAUNCH_ID=")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _start(args: list[str], tag: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", TAG_VAR: tag}
    return subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_process_of_the_run_survives_its_parent(tmp_path, sig):
    tag, out = uuid.uuid4().hex, tmp_path / "out"
    proc = _start(["run", "--cases", "mlp", "--impls", f"{PLUGINS}:HangOnRank1", "--world-sizes", "2", "--data",
                   "identical", "--steps", "1", "--timeout", "600", "--out", str(out), "--quiet"], tag)
    # Rank 0 reports the reference cell once every rank got past it; then rank 1 blocks in the
    # adapter's wrap (HangOnRank1) and rank 0 waits for it in a collective.
    deadline = time.monotonic() + 300
    while not any("cell 1/2 ref.mlp" in p.read_text() for p in out.glob("logs/w2-0/ranks/*/attempt_0/0/stdout.log")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.5)
    run = _processes(tag, "HARNESS_LAUNCH_ID=")
    ranks = _processes(tag, "HARNESS_LAUNCH_ID=", name="harness-rank")
    assert len(ranks) == 2 and len(run) >= 3, _describe(run)  # torchrun and both ranks

    os.kill(proc.pid, sig)
    stdout, stderr = proc.communicate(timeout=120)
    left = _wait_gone(tag)
    assert left == [], f"alive {GONE_WITHIN_S:.0f}s after {signal.Signals(sig).name} of the harness:\n{_describe(left)}"
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM, (stdout, stderr)
        assert stderr.strip() == "harness run: interrupted by SIGTERM; stopped every process it started", stderr
    else:
        assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_a_killed_pool_rank_is_one_clear_line_and_exit_1(tmp_path):
    tag = uuid.uuid4().hex
    proc = _start(["fuzz", "--world-size", "2", "--max-examples", "1000", "--seed", "3", "--out", str(tmp_path)], tag)
    line = ""
    # 1000 examples: `--pools auto` starts one pool per core, so with 2 cores or more a rank of
    # one pool dies while the other pool trains beside it.
    while "2 ranks started" not in line:  # the pools serve examples from here on
        line = proc.stdout.readline()
        assert line or proc.poll() is None, proc.communicate()
    rank1 = [pid for pid in _processes(tag, "HARNESS_LAUNCH_ID=", name="harness-rank1")
             if Path(f"/proc/{pid}/comm").read_text().strip() == "harness-rank1"]
    assert len(rank1) == (2 if "2 pools" in line else 1), line
    os.kill(rank1[0], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, (stdout[-3000:], stderr[-3000:])
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("harness fuzz: pool W=2: rank 1 was ended by SIGKILL from outside the run"), lines
    assert "Traceback" not in stdout + stderr and "Flaky" not in stdout + stderr
    assert "FAIL" not in stdout and "PASS" not in stdout  # no verdict either way
    assert _wait_gone(tag) == []


@pytest.mark.slow
def test_a_run_with_the_default_out_leaves_git_status_clean(tmp_path):
    project = copy_project(tmp_path / "project")
    init_repo(project)
    before = git(project, "status", "--porcelain", "--untracked-files=all")
    assert before == ""
    rc, out = harness(["run", "--cases", "mlp", "--impls", "ours", "--world-sizes", "1", "--data", "identical",
                       "--steps", "1", "--quiet"], cwd=project, timeout=600)
    assert rc == 0, out[-3000:]
    assert (project / "runs" / "run" / "summary.json").exists()  # the default --out, git-ignored
    assert git(project, "status", "--porcelain", "--untracked-files=all") == ""
