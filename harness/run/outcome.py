"""What a run leaves for the judge: each launch's result (exit status, timeout, per-rank logs)
and the run's outcome. Plain data, so the judge and the reports read it without importing the
launcher (harness/run/launch.py) or the parent's loop (harness/run/orchestrate.py).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from harness.run.plan import RunPlan


@dataclass(frozen=True)
class RankLog:
    rank: int
    stdout: str
    stderr: str

    def prefixed(self, max_lines: int = 80) -> str:
        lines = (self.stderr.rstrip() or self.stdout.rstrip()).splitlines()[-max_lines:]
        own = f"[rank{self.rank}]:"  # torchrun's own prefix, replaced by ours
        return "\n".join(f"[rank {self.rank}] {line.removeprefix(own).removeprefix(' ')}" for line in lines)


@dataclass(frozen=True)
class LaunchResult:
    world_size: int
    cell_ids: tuple[str, ...]
    returncode: int
    timed_out: bool
    wall_s: float
    rank_logs: tuple[RankLog, ...]
    launcher_output: str
    log_dir: Path
    leftover_processes_killed: int
    note: str = ""  # what ended it besides its ranks (a node lost: harness/run/nodes.py)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def failure_text(self) -> str:
        """Why the launch failed, as one prefixed block per rank that said anything useful."""
        head = (f"launch W={self.world_size} timed out after {self.wall_s:.1f}s (stacks below)"
                if self.timed_out else f"launch W={self.world_size} exited {self.returncode}")
        if self.note:
            head = f"launch W={self.world_size} ended after {self.wall_s:.1f}s: {self.note} (stacks below)"
        root = self.first_failed_rank()
        if root is not None:
            head += f"; first failure: rank {root}"
        cause = self.root_cause_signal()
        if cause is not None and cause[1] in EXTERNAL_SIGNALS:
            head += f"; rank {cause[0]} was ended by {cause[1]} from outside the run"
            if cause[1] == "SIGKILL":  # the usual sender on a machine too small for the model
                head += (" (the kernel's out-of-memory killer sends SIGKILL when the machine runs out of "
                         "memory: `dmesg` names the process it killed)")
        return head + "\n" + failure_blocks(self.rank_logs, self.launcher_output, stacks=self.timed_out, first=root)

    def first_failed_rank(self) -> int | None:
        """The rank torchrun names as the root cause (first observed failure), if any."""
        _, _, root = self.launcher_output.partition("Root Cause (first observed failure)")
        match = re.search(r"rank\s*:\s*(\d+)", root)
        return int(match.group(1)) if match else None

    def root_cause_signal(self) -> tuple[int, str] | None:
        return root_cause_signal(self.launcher_output)

    def failed_ranks(self) -> list[int]:
        return [log.rank for log in self.rank_logs if is_informative(log, self.timed_out)]


# Signals that come from outside the run (an operator, CI cancellation, the OOM killer): a rank
# ended by one is lost to the infrastructure, not failed by the implementation.
EXTERNAL_SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP")


def root_cause_signal(launcher_output: str) -> tuple[int, str] | None:
    """(rank, signal name) when torchrun's first observed failure is a rank ended by a signal."""
    _, _, root = launcher_output.partition("Root Cause (first observed failure)")
    rank = re.search(r"rank\s*:\s*(\d+)", root)
    code = re.search(r"exitcode\s*:\s*(-\d+)", root)
    if not (rank and code):
        return None
    try:
        name = signal.Signals(-int(code.group(1))).name
    except ValueError:
        name = f"signal {-int(code.group(1))}"
    return int(rank.group(1)), name


def is_informative(log: RankLog, stacks: bool) -> bool:
    """A traceback, a fatal error (a C++ abort such as gloo's "collective mismatch", with the stacks
    faulthandler dumps), or the stacks of a hung launch."""
    text = log.stderr
    return ("Traceback" in text or "Fatal Python error" in text
            or (stacks and ("Thread 0x" in text or "Current thread" in text)))


@dataclass
class RunOutcome:
    plan: RunPlan
    launches: list[LaunchResult] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # cell_id -> why its evidence is not judged
    wall_s: float = 0.0
    # cell_id -> seconds the cell ran in its launch's ranks (its completion record); a cell that
    # broke its launch gets the launch's time after the cells completed before it, one never run 0.
    cell_wall_s: dict[str, float] = field(default_factory=dict)


def failure_blocks(rank_logs: tuple[RankLog, ...], launcher_output: str, stacks: bool,
                   first: int | None = None) -> str:
    """One prefixed block per rank that said something useful (a traceback; its stacks when they
    were dumped), the rank that failed `first` leading (the others' errors are often only that
    it went away), or torchrun's own tail when none did."""
    ordered = sorted(rank_logs, key=lambda log: log.rank != first)
    blocks = [log.prefixed() for log in ordered if is_informative(log, stacks)]
    if not blocks:
        tail = launcher_output.rstrip().splitlines()[-30:]
        blocks = ["\n".join(f"[torchrun] {line}" for line in tail)]
    return "\n".join(blocks)
