"""The parent process of a run: initial states, one launch per world size, then diff and report.

Every launch outcome counts. A cell is complete when every rank got past the barrier after it
(rank 0 then writes its completion record, stamped with the run id). When a launch fails (a
rank exits non-zero or is killed, or the launch times out):
- the first incomplete cell is the one it was running: it becomes an `error` with the ranks'
  tracebacks or stacks; the cells after it are launched again without it (not after a timeout:
  a hang is not retried, so the run ends within --timeout per launch);
- when every cell was complete, the failure came after the last cell (raising in
  destroy_process_group, hanging or exiting non-zero at interpreter exit): every cell of that
  launch becomes an `error`, snapshots or not. Evidence from a launch that did not end cleanly
  is not judged.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Callable

import torch

from cases.catalog import get_case
from harness.run.launch import launch
from harness.run.outcome import LaunchResult, RunOutcome
from harness.run.plan import Cell, RunPlan
from harness.run.snapshot import complete_path, save_state


def write_init_states(plan: RunPlan) -> None:
    """One reference initial state per case; every world size and impl loads this same state."""
    for case_name in sorted({c.case for c in plan.cells + plan.references}):
        case = get_case(case_name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(case.seed)
            model = case.build_model()
        save_state(plan.init_dir / f"{case.name}.pt", model.state_dict(), plan.run_id)


def _completion_record(plan: RunPlan, cell: Cell) -> dict | None:
    try:
        record = json.loads(complete_path(plan.snapshot_dir, cell.cell_id).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("run_id") == plan.run_id else None


def cell_done(plan: RunPlan, cell: Cell) -> bool:
    """Every rank of this run finished the cell (see the module docstring)."""
    return _completion_record(plan, cell) is not None


def cell_wall_s(plan: RunPlan, cell: Cell) -> float:
    """Seconds the completed cell ran in the ranks (0.0 when its record does not say)."""
    wall = (_completion_record(plan, cell) or {}).get("wall_s")
    return float(wall) if isinstance(wall, (int, float)) and not isinstance(wall, bool) else 0.0


class Progress:
    """'cells done / total, current world size' on stderr, rewritten in place on a terminal."""

    def __init__(self, plan: RunPlan, stream=sys.stderr) -> None:
        self.plan = plan
        self.all_cells = plan.references + plan.cells
        self.stream = stream
        self.tty = stream.isatty()
        self.last = ""
        self.start = time.monotonic()

    def update(self, world_size: int) -> None:
        done = sum(cell_done(self.plan, c) for c in self.all_cells)
        line = (f"[harness] {done}/{len(self.all_cells)} cells done, running W={world_size}, "
                f"{time.monotonic() - self.start:.0f}s")
        if line.split(",")[:2] != self.last.split(",")[:2]:
            self.stream.write(("\r" + line) if self.tty else (line + "\n"))
            self.stream.flush()
        self.last = line

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _launch_groups(plan: RunPlan, world_size: int) -> list[tuple[Cell, ...]]:
    cells = plan.cells_for(world_size)
    if plan.launch_per_cell:
        return [(c,) for c in cells]
    return [cells] if cells else []


def run_plan(plan: RunPlan, progress: Progress | None = None,
             on_launch: Callable[[LaunchResult], None] | None = None) -> RunOutcome:
    start = time.monotonic()
    outcome = RunOutcome(plan)
    write_init_states(plan)
    for world_size in plan.world_sizes:
        for group in _launch_groups(plan, world_size):
            pending = list(group)  # never resumed from files: every cell runs in this run
            attempt = 0
            while pending:
                label = f"w{world_size}-{pending[0].cell_id}-{attempt}" if plan.launch_per_cell else f"w{world_size}-{attempt}"
                poll = (lambda w=world_size: progress.update(w)) if progress else None
                result = launch(plan, world_size, tuple(pending), label, on_poll=poll)
                outcome.launches.append(result)
                if on_launch is not None:
                    on_launch(result)
                unfinished = [c for c in pending if not cell_done(plan, c)]
                for cell in pending:
                    if cell not in unfinished:
                        outcome.cell_wall_s[cell.cell_id] = cell_wall_s(plan, cell)
                if unfinished and not result.ok:  # the first unfinished cell ran until the launch ended
                    finished_s = sum(outcome.cell_wall_s[c.cell_id] for c in pending if c not in unfinished)
                    outcome.cell_wall_s[unfinished[0].cell_id] = max(0.0, result.wall_s - finished_s)
                if result.ok:
                    for cell in unfinished:  # exited 0 without finishing it: a worker bug
                        outcome.errors[cell.cell_id] = f"launch W={world_size} exited 0 without completing this cell"
                    break
                if not unfinished:
                    text = ("every cell of this launch had completed when it failed (a rank raised, hung or exited "
                            "non-zero after its last cell, e.g. at exit); its evidence is not judged.\n"
                            + result.failure_text())
                    for cell in pending:
                        outcome.errors[cell.cell_id] = text
                    break
                culprit, pending = unfinished[0], unfinished[1:]
                outcome.errors[culprit.cell_id] = result.failure_text()
                if result.timed_out:
                    # A hang is not retried: each retry could cost another --timeout, and the
                    # run must end within --timeout (per launch) plus a few seconds.
                    for cell in pending:
                        outcome.errors[cell.cell_id] = (f"not run: launch W={world_size} timed out while "
                                                        f"running {culprit.cell_id}")
                    break
                attempt += 1
    if progress is not None:
        progress.update(plan.world_sizes[-1])
        progress.finish()
    outcome.wall_s = time.monotonic() - start
    return outcome
