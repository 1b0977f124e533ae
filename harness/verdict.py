"""From snapshots to per-cell verdicts and W x W matrices (the parent does this, never a rank)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cases.catalog import get_case
import torch

from harness.diff import DiffStats, OptimizerResult, Violation, check_snapshot, flat
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


def _trajectory(snap: dict, order: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every step's loss (rank 0's, or the mean of the local losses when split), gradients and
    parameters as one 1-D tensor, parameters in the order of `order`."""
    split = snap["cell"]["data_mode"] == "split"
    parts = []
    for rec in snap["steps"]:
        loss = rec["loss"].double().mean() if split else rec["loss"].double()[0]
        grad_order = [k for k in order if k in rec["grads"]]  # frozen parameters have no gradient
        parts += [loss.float().reshape(1), flat(rec["grads"], grad_order), flat(rec["params"], order)]
    return torch.cat(parts)


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
            traj = {}
            for _, c in entries:
                snap = snapshots.get((c.cell_id, spec.kind))
                traj[c.cell_id] = None if snap is None else _trajectory(snap, snap["init"]["params"])
            values = []
            for _, a in entries:
                row = []
                for _, b in entries:
                    ta, tb = traj[a.cell_id], traj[b.cell_id]
                    row.append(None if ta is None or tb is None else (ta.double() - tb.double()).abs().max().item())
                values.append(tuple(row))
            matrices.append(Matrix(case_name, impl, mode, spec.kind, tuple(l for l, _ in entries), tuple(values)))
    return cells, references, matrices
