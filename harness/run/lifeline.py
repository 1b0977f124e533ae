"""Every process of a run dies with the harness process that started it. Standard library only.

[Note: No survivors]
- Signals the harness can catch (SIGTERM from CI cancellation or `timeout`, SIGHUP, SIGINT):
  harness/cli.py turns them into an exception in the main thread, so the `finally` of the
  running launch kills its processes (harness/run/launch.py) and bisect removes its worktree.
- SIGKILL of the harness cannot be caught, so the children arrange their own end: torchrun is
  started with a parent-death signal (SIGKILL when the harness dies); every rank sets one in its
  prologue (harness/run/rank.py; SIGKILL when torchrun dies) and runs a watchdog thread that ends the rank when the
  harness process named in PARENT_VAR is gone, which also covers a rank whose launcher died
  before the rank could set its own death signal.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PARENT_VAR = "HARNESS_PARENT"  # "<pid>:<start time>" of the harness process that owns a launch
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
RANK_NAME_PREFIX = "harness-rank"  # a rank's process name: harness-rank<N> (harness/run/rank.py)
WATCH_INTERVAL_S = 0.5


def set_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread exits (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def name_process(name: str) -> bool:
    """Name this process (its main thread) as ps, top and /proc/PID/comm show it: at most 15 bytes."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat; a pid reused by
    another process has another one), or None when it is gone or a zombie (dead, not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def token(pid: int | None = None) -> str:
    """This process (or `pid`) as PARENT_VAR names it."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_start_time(pid)}"


def alive(parent: str) -> bool:
    pid, _, started = parent.partition(":")
    if started in ("", "None"):  # no /proc where the token was made: the pid alone
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        return True
    return _start_time(int(pid)) == started


def child_preexec() -> None:
    """preexec_fn for a launcher started by the harness: it dies with the harness."""
    set_death_signal(signal.SIGKILL)


def die_with_launch() -> None:
    """The first thing a rank does: die with its launcher and with the harness (see the Note)."""
    set_death_signal(signal.SIGKILL)
    parent = os.environ.get(PARENT_VAR)
    if not parent:
        return
    if not alive(parent):
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while alive(parent):
            time.sleep(WATCH_INTERVAL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="harness-parent-watchdog", daemon=True).start()
