"""From snapshots to per-cell verdicts and W x W matrices (the parent does this, never a rank)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cases.catalog import get_case
from harness.diff import DiffStats, OptimizerResult, Violation, check_snapshot, compare
from harness.orchestrate import RunOutcome
from harness.plan import Cell, RunPlan
from harness.snapshot import load_snapshot, load_state, snapshot_path


@dataclass
class CellResult:
    cell: Cell
    verdict: str  # pass | fail | error
    optimizers: dict[str, OptimizerResult] = field(default_factory=dict)
    error: str | None = None

    @property
    def violations(self) -> list[Violation]:
        return sorted((v for r in self.optimizers.values() for v in r.violations), key=Violation.sort_key)

    @property
    def first_divergence(self) -> Violation | None:
        violations = self.violations
        return violations[0] if violations else None

    def trajectory(self) -> DiffStats | None:
        stats = [s for r in self.optimizers.values() for s in r.trajectory.values()]
        return DiffStats.merge(stats) if stats else None

    def margins(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.optimizers.values():
            for check, value in r.margins.items():
                out[check] = max(out.get(check, 0.0), value)
        return out


@dataclass(frozen=True)
class Matrix:
    """Max abs diff over all steps of losses, gradients and parameters, between world sizes."""

    case: str
    impl: str
    data_mode: str
    optimizer: str
    labels: tuple[str, ...]  # 'ref' (impl=single, W = 1), then '1', '2', ...
    values: tuple[tuple[float | None, ...], ...]


def _trajectory_diff(a: dict, b: dict) -> float:
    stats = []
    split_a, split_b = (s["cell"]["data_mode"] == "split" for s in (a, b))
    for ra, rb in zip(a["steps"], b["steps"]):
        la = ra["loss"].double().mean() if split_a else ra["loss"].double()[0]
        lb = rb["loss"].double().mean() if split_b else rb["loss"].double()[0]
        stats.append(compare(la.float().reshape(1), lb.float().reshape(1)))
        for q in ("grads", "params"):
            stats.extend(compare(t, rb[q][n]) for n, t in ra[q].items())
    return DiffStats.merge(stats).max_abs


def evaluate(plan: RunPlan, outcome: RunOutcome) -> tuple[list[CellResult], list[CellResult], list[Matrix]]:
    """(results of the cells under test, results of the reference cells, W x W matrices)."""
    snapshots: dict[tuple[str, str], dict] = {}
    init_states = {name: load_state(plan.init_dir / f"{name}.pt") for name in {c.case for c in plan.cells + plan.references}}

    def result_for(cell: Cell) -> CellResult:
        if cell.cell_id in outcome.errors:
            return CellResult(cell, "error", error=outcome.errors[cell.cell_id])
        case = get_case(cell.case)
        result = CellResult(cell, "pass")
        for spec in case.optimizers:
            path = snapshot_path(plan.snapshot_dir, cell.cell_id, spec.kind)
            if not path.exists():
                return CellResult(cell, "error", error=f"no snapshot {path} (the launch ended before this cell)")
            snapshots[(cell.cell_id, spec.kind)] = load_snapshot(path)
        for spec in case.optimizers:
            snap = snapshots[(cell.cell_id, spec.kind)]
            ref_cell = next(r for r in plan.references if r.case == cell.case)
            ref = snapshots.get((ref_cell.cell_id, spec.kind))
            init = {n: init_states[cell.case][n] for n in snap["init"]["params"]}
            result.optimizers[spec.kind] = check_snapshot(snap, init, ref)
        if result.violations:
            result.verdict = "fail"
        return result

    references = [result_for(c) for c in plan.references]
    cells = [result_for(c) for c in plan.cells]

    matrices = []
    groups = sorted({(c.case, c.impl, c.data_mode) for c in plan.cells})
    for case_name, impl, mode in groups:
        members = sorted((c for c in plan.cells if (c.case, c.impl, c.data_mode) == (case_name, impl, mode)),
                         key=lambda c: c.world_size)
        ref_cell = next(r for r in plan.references if r.case == case_name)
        entries = [("ref", ref_cell)] + [(str(c.world_size), c) for c in members]
        for spec in get_case(case_name).optimizers:
            values = []
            for _, a in entries:
                row = []
                for _, b in entries:
                    sa, sb = snapshots.get((a.cell_id, spec.kind)), snapshots.get((b.cell_id, spec.kind))
                    row.append(None if sa is None or sb is None else _trajectory_diff(sa, sb))
                values.append(tuple(row))
            matrices.append(Matrix(case_name, impl, mode, spec.kind, tuple(l for l, _ in entries), tuple(values)))
    return cells, references, matrices
