"""Slow tier: the one launcher (harness/run/launch.py) that run, fuzz, mutants and bench share.

A rank that raises is named with its traceback, a hung launch ends at its timeout with every
rank's stacks, and no process of the launch survives either; bench reports a failed launch the
same way (it had a launcher of its own that printed torchrun's tail and no rank's traceback).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from harness.bench.main import BenchError, torchrun
from harness.run.launch import LAUNCH_ID_VAR, Launch, TorchrunSpec

pytestmark = pytest.mark.slow

RANK_SCRIPTS = str(Path(__file__).resolve().parents[2] / "rank_scripts")
# The hang must be a timeout, not slowness: a launch of two ranks finishes in seconds, the
# timeout leaves minutes for a loaded 2-core machine (the hang test ends sooner: see there).
HANG_TIMEOUT_S = 120.0
SETTLE_S = 3.0  # after both ranks said they hang: rank 0 is in its barrier, rank 1 asleep
LAUNCH_TIMEOUT_S = 900.0


def _processes_of(launch_id: str) -> list[int]:
    marker = f"{LAUNCH_ID_VAR}={launch_id}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


# Both ways a launch starts its ranks: torchrun's command line, and forked from one launcher that
# imported their module ([Note: Forked ranks], harness/run/prefork.py).
START = pytest.mark.parametrize("prefork", [False, True], ids=["torchrun", "forked"])


def _launch(tmp_path: Path, mode: str, timeout_s: float, overdue=None, prefork: bool = False) -> tuple[Launch, object]:
    spec = TorchrunSpec(2, "launch_probe", (mode,), tmp_path / mode, timeout_s, threads=1,
                        extra_pythonpath=(RANK_SCRIPTS,), prefork=prefork)
    launch = Launch(spec)
    return launch, launch.run(overdue=overdue(launch) if overdue else None)


def _once_both_hang(launch: Launch):
    """The launch's timeout, or SETTLE_S after both ranks printed that they hang, whichever comes
    first: the timeout path (stacks dumped, everything killed) without waiting minutes for it."""
    hung_at = None

    def overdue(timeout_s: float) -> bool:
        nonlocal hung_at
        if hung_at is None and all("hanging" in log.stdout for log in launch.rank_logs()):
            hung_at = time.monotonic()
        return (time.monotonic() - launch.started_at > timeout_s
                or hung_at is not None and time.monotonic() - hung_at > SETTLE_S)

    return overdue


@START
def test_an_honest_launch_succeeds_and_leaves_nothing(tmp_path, prefork):
    launch, result = _launch(tmp_path, "ok", LAUNCH_TIMEOUT_S, prefork=prefork)
    assert result.ok, result.failure_text()
    assert [("rank 0 of 2 done" in log.stdout, "rank 1 of 2 done" in log.stdout) for log in result.rank_logs] == \
        [(True, False), (False, True)]
    assert [f"named harness-rank{log.rank}" in log.stdout for log in result.rank_logs] == [True, True]
    assert _processes_of(launch.launch_id) == []


@START
@pytest.mark.parametrize("mode", ["exit3", "atexit"])
def test_a_rank_that_exits_non_zero_fails_the_launch(tmp_path, prefork, mode):
    """sys.exit(3) after the work, or an exit hook ending the process with 7 once everything else
    succeeded (a crash after the evidence is written): the launch fails, naming rank 1."""
    launch, result = _launch(tmp_path, mode, LAUNCH_TIMEOUT_S, prefork=prefork)
    assert not result.ok and not result.timed_out and result.returncode != 0, result.launcher_output[-2000:]
    assert result.first_failed_rank() == 1, result.launcher_output[-2000:]
    assert "exitcode  : " + ("3" if mode == "exit3" else "7") in result.launcher_output, result.launcher_output[-2000:]
    assert _processes_of(launch.launch_id) == []


@START
def test_a_rank_that_raises_is_named_with_its_traceback_and_nothing_survives(tmp_path, prefork):
    launch, result = _launch(tmp_path, "crash", LAUNCH_TIMEOUT_S, prefork=prefork)
    assert not result.ok and not result.timed_out and result.returncode != 0
    text = result.failure_text()
    assert text.startswith(f"launch W=2 exited {result.returncode}; first failure: rank 1\n"), text
    assert "[rank 1] Traceback" in text and "[rank 1] RuntimeError: planted crash on rank 1" in text, text
    assert _processes_of(launch.launch_id) == []


@START
def test_a_hung_launch_times_out_with_every_ranks_stack_and_nothing_survives(tmp_path, prefork, monkeypatch):
    import harness.run.launch as launch_module

    signalled = []  # (signal, the process's name) of every signal the launcher sends
    send = launch_module._signal_all

    def recording(pids, sig):
        signalled.extend((sig, Path(f"/proc/{pid}/comm").read_text().strip()) for pid in pids)
        send(pids, sig)

    monkeypatch.setattr(launch_module, "_signal_all", recording)
    launch, result = _launch(tmp_path, "hang", HANG_TIMEOUT_S, _once_both_hang, prefork=prefork)
    # The stack dump reaches the two ranks and nothing else (torchrun, a fork server die of it).
    assert sorted(name for sig, name in signalled if sig == signal.SIGUSR1) == ["harness-rank0", "harness-rank1"]
    assert result.timed_out and result.returncode == 124
    text = result.failure_text()
    assert text.startswith("launch W=2 timed out after"), text
    # faulthandler's dump (rank prologue, SIGUSR1 from the launcher): the barrier and the sleep.
    assert "[rank 0] " in text and "in barrier" in text, text
    assert "[rank 1] " in text and "in main" in text and "launch_probe.py" in text, text
    assert _processes_of(launch.launch_id) == []


def test_bench_reports_a_failed_launch_with_the_ranks_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([RANK_SCRIPTS, os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(BenchError) as failed:
        torchrun(2, ["launch_probe", "crash"], 1, LAUNCH_TIMEOUT_S, tmp_path / "bench")
    text = str(failed.value)
    assert text.startswith("bench launch launch_probe crash: launch W=2 exited"), text
    assert "[rank 1] RuntimeError: planted crash on rank 1" in text, text


def test_a_rank_killed_from_outside_is_named_with_its_likely_sender(tmp_path):
    """A rank the kernel's out-of-memory killer ended (torchrun: exitcode -9, SIGKILL) is named as
    ended from outside the run, with where to look, not left as a bare exit status."""
    from harness.run.outcome import LaunchResult

    root = ("Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-27_17:17:26\n"
            "  rank      : 1 (local_rank: 1)\n  exitcode  : {code} (pid: 21676)\n")

    def text(code: str) -> str:
        return LaunchResult(2, ("c",), 1, False, 1.0, (), root.format(code=code), tmp_path, 0).failure_text()

    killed = text("-9 (SIGKILL)")
    assert "first failure: rank 1; rank 1 was ended by SIGKILL from outside the run" in killed
    assert "out-of-memory killer" in killed and "dmesg" in killed
    assert "from outside the run" in text("-15 (SIGTERM)") and "out-of-memory" not in text("-15 (SIGTERM)")
    assert "from outside the run" not in text("1")  # a rank that raised: its traceback says why
