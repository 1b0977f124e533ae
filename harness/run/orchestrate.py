"""The parent process of a run: initial states, one launch for every world size, then diff and report.

[Note: One launch, every world size]
Start-up (torchrun, python and torch imports in every rank, the first optimizer's lazy imports)
is paid once per run: one torchrun of max(W) ranks runs the cells of every world size in
ascending order. The cells of world size W run side by side in teams of W ranks (team t: launch
ranks t*W .. t*W + W - 1; as many teams as the launch's ranks hold, on CPUs at most as many as
the cores keep busy, harness/run/plan.py `max_teams`), each team in a default process group of
its own (harness/run/worker.py `_join_world`) taking the next unclaimed cell until none is left;
the ranks in no team wait for a larger world size, and every rank arrives before the next world
size starts. Each team's process group is a fresh W-rank world, as in a launch of W ranks, so
adapters that build meshes over the world need nothing else; tests/harness/run/test_one_launch.py checks
that every cell's evidence, whichever team ran it, is bitwise that of a launch of its own.
--timeout applies to each world size: counted from the launch's start for the first, from the
completion of the previous world size's last cell for the others. Once every cell of a launch is
complete its ranks have EXIT_GRACE_S (or --timeout, if shorter) to exit: a rank that hangs at exit
(in destroy_process_group, in an atexit hook) costs a minute, not a whole --timeout. An adapter whose library keeps
process-wide state across process groups (`Adapter.process_per_world`: DeepSpeed caches groups and
counts module ids per process) gets a launch per world size after the shared one.

Every launch outcome counts. A cell's rank 0 writes its started record (the launch ranks that run
it) before it starts; a cell is complete when every rank of its team got past the fence after it
(rank 0 then writes its completion record, stamped with the run id). When a launch fails (a rank
exits non-zero or is killed, or the launch times out):
- the failure is charged to the cell that was running in the ranks that failed (the rank torchrun
  names first; the first cell running when none matches; the first incomplete cell when none had
  started): it becomes an `error` with the ranks' tracebacks or stacks; the other incomplete cells
  are launched again without it. After a timeout every cell that was running is charged (the
  stacks show which hung), and only cells of larger world sizes run again: a hang is not retried,
  so each world size ends within --timeout;
- when every cell was complete, the failure came after the last cell (raising in
  destroy_process_group, hanging or exiting non-zero at interpreter exit): every cell of that
  launch becomes an `error`, snapshots or not. Evidence from a launch that did not end cleanly
  is not judged.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Callable

from cases.catalog import get_case
from harness.run.launch import EXIT_GRACE_S, launch
from harness.run.outcome import LaunchResult, RunOutcome
from harness.run.plan import Cell, RunPlan
from harness.run.snapshot import build_init, complete_path, save_state, started_path


def write_init_states(plan: RunPlan) -> None:
    """One reference initial state per case; every world size and impl loads this same state (and
    the model's buffers as built, non-persistent ones included: the reference of the buffers check)."""
    # A case judged on the ranks is built by every rank itself (harness/run/judged.py): its state
    # is the size of the model, on disk and in the parent.
    for case_name in sorted({c.case for c in plan.cells + plan.references} - set(plan.judged_on_ranks)):
        case = get_case(case_name)
        state, buffers = build_init(case)
        save_state(plan.init_dir / f"{case.name}.pt", state, plan.run_id, buffers)


def _completion_record(plan: RunPlan, cell: Cell) -> dict | None:
    try:
        record = json.loads(complete_path(plan.snapshot_dir, cell.cell_id).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("run_id") == plan.run_id else None


def launch_ranks(plan: RunPlan, cell: Cell) -> list[int] | None:
    """The launch ranks running (or that ran) `cell` in this run's latest launch of it, from its
    started record; None when it has not started."""
    try:
        record = json.loads(started_path(plan.snapshot_dir, cell.cell_id).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("run_id") != plan.run_id:
        return None
    ranks = record.get("launch_ranks")
    return [int(r) for r in ranks] if isinstance(ranks, list) else None


def _charged(plan: RunPlan, result: LaunchResult, unfinished: list[Cell]) -> list[Cell]:
    """The cells a failed launch is charged to (the module docstring): the cells it was running
    when it timed out; else the one whose ranks include the rank torchrun names as the first
    failure; else the first one running; else the first one it had not finished."""
    ranks = {c.cell_id: launch_ranks(plan, c) for c in unfinished}
    running = [c for c in unfinished if ranks[c.cell_id] is not None]
    if not running:
        return unfinished[:1]
    if result.timed_out:
        return running
    first = result.first_failed_rank()
    return [c for c in running if first in ranks[c.cell_id]][:1] or running[:1]


def _ran_in(plan: RunPlan, cell: Cell) -> str:
    """A line for the error of a cell that ran in other launch ranks than 0..W-1."""
    ranks = launch_ranks(plan, cell) or []
    if not ranks or ranks[0] == 0:
        return ""
    return (f"this cell ran in launch ranks {ranks[0]}-{ranks[-1]} as its ranks 0-{len(ranks) - 1} (the logs below "
            f"are named by launch rank)\n")


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
        self.done: set[str] = set()  # cell ids seen complete (a completion record is never taken back)

    def mark(self, cell: Cell) -> None:
        self.done.add(cell.cell_id)

    def update(self, world_size: int, recount: bool = False) -> None:
        """The line, counting the cells marked complete (every cell's record read again with
        `recount`: once, at the end, rather than dozens of files at every poll)."""
        if recount:
            self.done = {c.cell_id for c in self.all_cells if cell_done(self.plan, c)}
        done = len(self.done)
        line = (f"[harness] {done}/{len(self.all_cells)} cells done, running W={world_size}, "
                f"{time.monotonic() - self.start:.0f}s")
        if line.split(",")[:2] != self.last.split(",")[:2]:
            self.stream.write(("\r" + line) if self.tty else (line + "\n"))
            self.stream.flush()
        self.last = line

    def judged(self, done: int, total: int) -> None:
        """'cells judged / total' while the parent judges (minutes for long runs of big models)."""
        line = f"[harness] judging: {done}/{total} cells judged, {time.monotonic() - self.start:.0f}s"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        if self.tty and done == total:
            self.stream.write("\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _launch_groups(plan: RunPlan) -> list[tuple[Cell, ...]]:
    """Cells in the order they run, one tuple per launch: the references, then every world size
    ascending, in one launch; the cells of an adapter with `process_per_world` (DeepSpeed) in a
    launch per world size after it (the references join the first of those when nothing else is
    shared)."""
    from harness.adapters.registry import resolve_impl

    cells = tuple(c for w in plan.world_sizes for c in plan.cells_for(w))
    if plan.launch_per_cell:
        return [(c,) for c in cells]
    apart = {impl for impl in {c.impl for c in plan.cells} if resolve_impl(impl).process_per_world}
    shared = [c for c in cells if c.impl not in apart]
    groups = [[c for c in plan.cells if c.world_size == w and c.impl in apart] for w in plan.world_sizes]
    groups = [g for g in groups if g]
    if groups and all(c.is_reference for c in shared):
        groups[0] = shared + groups[0]
        shared = []
    return [tuple(g) for g in ([shared] if shared else []) + groups]


def _runs_at(plan: RunPlan, cell: Cell) -> int:
    """The world size whose ranks run `cell`: the references run with the smallest (rank 0 alone)."""
    return plan.world_sizes[0] if cell.is_reference else cell.world_size


class _WorldSizeClock:
    """Whether a launch has run past its timeout: the current world size counted since the launch
    started for the first, since the previous world size's last cell completed for the others;
    once every cell is complete, the exit counted since then against EXIT_GRACE_S."""

    def __init__(self, plan: RunPlan, cells: list[Cell]) -> None:
        self.plan, self.cells = plan, cells
        self.done = 0  # cells[:done] are complete
        self.world_size = _runs_at(plan, cells[0]) if cells else 0
        self.since = time.monotonic()
        self.exiting = False  # every cell complete: the ranks are exiting

    def current(self) -> Cell | None:
        while self.done < len(self.cells) and cell_done(self.plan, self.cells[self.done]):
            self.done += 1
        return self.cells[self.done] if self.done < len(self.cells) else None

    def tick(self) -> None:
        cell = self.current()
        if cell is None and not self.exiting:
            self.exiting, self.since = True, time.monotonic()
        elif cell is not None and _runs_at(self.plan, cell) != self.world_size:
            self.world_size, self.since = _runs_at(self.plan, cell), time.monotonic()

    def overdue(self, timeout_s: float) -> bool:
        """Past the current world size's own timeout (`timeout_s`, the launch's, is the largest)."""
        self.tick()
        own = min(timeout_s, self.plan.timeout_for(self.world_size))
        limit = min(own, EXIT_GRACE_S) if self.exiting else own
        return time.monotonic() - self.since > limit


def _poller(clock: _WorldSizeClock, progress: Progress | None,
            on_cell_complete: Callable[[Cell], None] | None) -> Callable[[], None]:
    """What the launch's poll loop calls: the clock, the cells completed since the last call, the
    progress line."""
    reported = 0

    def poll() -> None:
        nonlocal reported
        clock.tick()
        while reported < clock.done:
            if on_cell_complete is not None:
                on_cell_complete(clock.cells[reported])
            if progress is not None:
                progress.mark(clock.cells[reported])
            reported += 1
        if progress is not None:
            progress.update(clock.world_size)

    return poll


def run_plan(plan: RunPlan, progress: Progress | None = None,
             on_launch: Callable[[LaunchResult], None] | None = None,
             on_cell_complete: Callable[[Cell], None] | None = None) -> RunOutcome:
    """Every cell of the plan run (see the module docstring). `on_cell_complete(cell)` is called
    from the launch's poll loop once per cell whose completion record appeared while its launch
    still ran, in run order (the parent judges it then: [Note: Judging while the ranks train] in
    harness/judge/verdict.py); the launch's timeout is checked between such calls."""
    start = time.monotonic()
    outcome = RunOutcome(plan)
    write_init_states(plan)
    for group in _launch_groups(plan):
        pending = list(group)  # never resumed from files: every cell runs in this run
        attempt = 0
        while pending:
            sizes = sorted({_runs_at(plan, c) for c in pending})
            label = (f"w{sizes[0]}-{pending[0].cell_id}-{attempt}" if plan.launch_per_cell
                     else f"w{'_'.join(map(str, sizes))}-{attempt}")
            clock = _WorldSizeClock(plan, pending)
            poll = _poller(clock, progress, on_cell_complete) if progress or on_cell_complete else None
            for cell in pending:  # a started record of an earlier launch is not this launch's
                started_path(plan.snapshot_dir, cell.cell_id).unlink(missing_ok=True)
            result = launch(plan, sizes[-1], tuple(pending), label, on_poll=poll, overdue=clock.overdue)
            unfinished = [c for c in pending if not cell_done(plan, c)]
            if unfinished and len(sizes) > 1:  # name the world size the launch was running
                result = dataclasses.replace(result, world_size=_runs_at(plan, unfinished[0]))
            outcome.launches.append(result)
            if on_launch is not None:
                on_launch(result)
            for cell in pending:
                if cell not in unfinished:
                    outcome.cell_wall_s[cell.cell_id] = cell_wall_s(plan, cell)
            charged = _charged(plan, result, unfinished) if unfinished and not result.ok else []
            for cell in charged:  # it ran until the launch ended
                finished_s = sum(outcome.cell_wall_s[c.cell_id] for c in pending if c not in unfinished)
                outcome.cell_wall_s[cell.cell_id] = max(0.0, result.wall_s - finished_s)
            if result.ok:
                for cell in unfinished:  # exited 0 without finishing it: a worker bug
                    outcome.errors[cell.cell_id] = f"launch W={sizes[-1]} exited 0 without completing this cell"
                break
            if not unfinished:
                how = (f"its ranks did not exit within {min(plan.timeout_s, EXIT_GRACE_S):g} s of the last cell's "
                       f"completion (their stacks below)" if result.timed_out else
                       "a rank raised or exited non-zero after its last cell, e.g. at exit")
                text = (f"every cell of this launch had completed when it failed ({how}); its evidence is not "
                        "judged.\n" + result.failure_text())
                for cell in pending:
                    outcome.errors[cell.cell_id] = text
                break
            for cell in charged:
                outcome.errors[cell.cell_id] = _ran_in(plan, cell) + result.failure_text()
            pending = [c for c in unfinished if c not in charged]  # the others run again
            if result.note:  # a node is lost ([Note: Across nodes] in harness/run/nodes.py): nothing can run
                for cell in pending:
                    outcome.errors[cell.cell_id] = f"not run: {result.note}"
                pending = []
            if result.timed_out:
                # A hang is not retried: each retry could cost another --timeout, and each world
                # size must end within --timeout plus a few seconds. Larger world sizes still run.
                hung = _runs_at(plan, charged[0])
                running = ", ".join(c.cell_id for c in charged)
                for cell in [c for c in pending if _runs_at(plan, c) == hung]:
                    outcome.errors[cell.cell_id] = f"not run: launch W={hung} timed out while running {running}"
                pending = [c for c in pending if _runs_at(plan, c) != hung]
            attempt += 1
    if progress is not None:
        progress.update(plan.world_sizes[-1], recount=True)
        progress.finish()
    outcome.wall_s = time.monotonic() - start
    return outcome
