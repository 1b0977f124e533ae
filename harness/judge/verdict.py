"""From snapshots to per-cell verdicts and W x W matrices (the parent does this, never a rank).

Nothing reaches the judge unchecked: a cell whose launch failed, whose initial state or snapshot
is missing, unreadable, from another run or short of what the plan asked for
(harness/run/evidence.py) becomes an `error` row naming what is missing; so does a cell whose
checks raised. Every cell of the plan gets a row.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cases.catalog import get_case
from harness.judge.diff import (
    DiffStats,
    OptimizerResult,
    ReferenceDiverged,
    TrajectoryDeviation,
    check_snapshot,
    complete_trajectory,
    result_from_record,
    trajectory_row,
)
from harness.judge.layouts import (
    GatheredMismatch,
    LayoutError,
    check_layouts,
    parameter_names,
)
from harness.judge.contracts import broken_at
from harness.judge.result import Verdict, Violation, first_of, nan_max, worst_verdict
from harness.run.evidence import (
    EvidenceError,
    check_same_steps,
    check_snapshot_evidence,
    model_buffers,
    model_parameters,
)
from harness.run.outcome import RunOutcome
from harness.run.plan import Cell, RunPlan
from harness.run.snapshot import (
    judged_path,
    load_init,
    load_judged,
    load_snapshot,
    snapshot_path,
)


@dataclass
class CellResult:
    """A cell's verdict and the Judgement of each of its optimizers' runs (harness/judge/result.py):
    its violations, first divergence and margins are theirs together.

    `verdict` is never better than the evidence: the verdict the judge gave (`given`) or the one its
    own error, its optimizers' errors and violations make, whichever is worse. A path that forgets
    to turn a cell with a violation into a fail, or an error into an error, cannot report a pass."""

    cell: Cell
    given: Verdict
    optimizers: dict[str, OptimizerResult] = field(default_factory=dict)
    error: str | None = None

    def __setattr__(self, name, value) -> None:
        super().__setattr__(name, Verdict(value) if name == "given" else value)

    @property
    def verdict(self) -> Verdict:
        own = Verdict.ERROR if self.error is not None else Verdict.PASS
        return worst_verdict(self.given, own, *(r.verdict for r in self.optimizers.values()))

    @verdict.setter
    def verdict(self, value: Verdict) -> None:
        self.given = value

    @property
    def violations(self) -> list[Violation]:
        return sorted((v for r in self.optimizers.values() for v in r.violations), key=Violation.sort_key)

    @property
    def first_divergence(self) -> Violation | None:
        return first_of(self.violations)

    def trajectory(self) -> DiffStats | None:
        stats = [s for r in self.optimizers.values() for s in r.trajectory.values()]
        return DiffStats.merge(stats) if stats else None

    @property
    def bias_not_applied(self) -> dict | None:
        """The first step (with the tensor and why) from which the bias check was not applied, over
        its optimizers ([Note: Reordered accumulation]), or None."""
        found = [r.checks.get("bias", {}).get("not_applied_from") for r in self.optimizers.values()]
        found = [f for f in found if f]
        return min(found, key=lambda f: f["step"]) if found else None

    @property
    def margins(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.optimizers.values():
            for check, value in r.margins.items():
                out[check] = nan_max(out.get(check, 0.0), value)
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
    """Every step's `trajectory_row` as one 1-D tensor."""
    split = snap["cell"]["data_mode"] == "split"
    return torch.cat([trajectory_row(rec, order, split) for rec in snap["steps"]])


def _no_reference(cell: Cell, ref_cell: Cell, kind: str) -> CellResult:
    return CellResult(cell, Verdict.ERROR, error=(
        f"optimizer={kind}: the reference {ref_cell.cell_id} left no usable evidence (see its row), so the "
        f"trajectory check cannot run: no verdict"))


def _add_gathered_mismatches(opt, kind: str, mismatches) -> None:
    """A full parameter that differs from the raw shards its valid layout names fails the cell:
    the implementation's gathered state contradicts its own shards ([Note: Layout validation])."""
    for m in mismatches:
        opt.violations.append(Violation(kind, m.step, "replicas", m.name, float("inf"), abs(m.full - m.shard), 0.0,
                                        m.full, m.shard, index=m.index, rank=m.rank, num_violating=m.count,
                                        gathered=True))
    if mismatches:
        opt.margins["replicas"] = float("inf")


class Judge:
    """The judging of one run's cells: each against its case's reference, references first.

    [Note: Judging while the ranks train]
    The ranks finish the references and the small world sizes first, and while they train the
    larger ones the parent would wait. So `judge_early` judges a cell as soon as its completion
    record exists (the launch's poll loop calls it), and `evaluate` later takes that result instead
    of judging again, but only where its inputs are the same: the cell did not become an error
    (a launch that fails after the cell completed turns it into one: "Evidence from a launch that
    did not end cleanly is not judged", harness/run/orchestrate.py), and the reference's evidence it
    was judged against is the evidence the final pass has (the reference itself judged, not an
    error). Otherwise the early result is discarded and the cell judged again, so every verdict and
    every error is what judging after the launch gives. A completed cell's files never change (no
    launch reruns a completed cell), and an early judge that raises only leaves the cell to the
    final pass.
    """

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        self._inputs: tuple[dict, dict, dict] | None = None
        self.early: dict[str, tuple[CellResult, dict | None, tuple]] = {}  # cell_id -> (result, evidence, ref key)
        self.early_snapshots: dict[tuple[str, str], dict] = {}

    def inputs(self) -> tuple[dict, dict, dict]:
        """(initial state or why there is none, parameters, layout names) per case; read once the
        run has written its initial states."""
        if self._inputs is None:
            plan = self.plan
            # Cells their own ranks judge need none of it ([Note: Judged where the evidence lives]).
            case_names = sorted({c.case for c in plan.cells + plan.references} - set(plan.judged_on_ranks))
            init_states: dict[str, tuple[dict, dict] | str] = {}  # (state, buffers), or why there is none
            for name in case_names:
                path = plan.init_dir / f"{get_case(name).name}.pt"
                try:
                    init_states[name] = load_init(path, plan.run_id)
                except Exception as e:
                    init_states[name] = f"initial state {path} unusable: {type(e).__name__}: {e}"
            parameters = {name: (*model_parameters(name), model_buffers(name)) for name in case_names}
            layout_names = {name: parameter_names(get_case(name).build_shapes()) for name in case_names}
            self._inputs = init_states, parameters, layout_names
        return self._inputs

    def _reference_of(self, cell: Cell) -> Cell:
        return next(r for r in self.plan.references if r.case == cell.case)

    def _ref_key(self, cell: Cell, snapshots: dict) -> tuple:
        """Which of the reference's snapshots a judge of `cell` would be handed."""
        ref_cell = self._reference_of(cell)
        return tuple(sorted(kind for cell_id, kind in snapshots if cell_id == ref_cell.cell_id))

    def load_evidence(self, cell: Cell, kind: str) -> dict:
        plan = self.plan
        _, parameters, layout_names = self.inputs()
        path = snapshot_path(plan.snapshot_dir, cell.cell_id, kind)
        if not path.exists():
            raise EvidenceError(f"no snapshot {path} (the launch ended before this cell)")
        try:
            snap = load_snapshot(path)
        except Exception as e:
            raise EvidenceError(f"snapshot {path} unreadable: {type(e).__name__}: {e}") from None
        sizes, grad_names, buffer_sizes = parameters[cell.case]
        try:
            check_snapshot_evidence(snap, cell, kind, plan.run_id, sizes, grad_names, buffer_sizes)
        except EvidenceError as e:
            raise EvidenceError(f"snapshot {path}: {e}") from None
        try:
            features, contracts = get_case(cell.case).features, tuple(snap.get("contracts", ()))
            snap["gathered_mismatches"] = check_layouts(
                snap, *layout_names[cell.case],
                unchecked=lambda rec: broken_at(contracts, rec, features, int(snap["world_size"])))
        except LayoutError as e:
            raise LayoutError(f"optimizer={kind}: {e}") from None
        return snap

    def load_record(self, cell: Cell, kind: str) -> dict:
        """The judged record of a cell its own rank 0 judged ([Note: Judged where the evidence
        lives] in harness/run/judged.py), checked against the plan."""
        path = judged_path(self.plan.snapshot_dir, cell.cell_id, kind)
        if not path.exists():
            raise EvidenceError(f"no judged record {path} (the launch ended before this cell)")
        try:
            record = load_judged(path)
        except Exception as e:
            raise EvidenceError(f"judged record {path} unreadable: {type(e).__name__}: {e}") from None
        if record.get("run_id") != self.plan.run_id:
            raise EvidenceError(f"{path}: run_id={record.get('run_id')!r} is not this run's (evidence of another run)")
        if record.get("cell") != cell.to_json() or record.get("optimizer") != kind:
            raise EvidenceError(f"{path}: it is the record of {record.get('cell')} optimizer={record.get('optimizer')!r}")
        if record["error"] is None:
            if record["steps"] != list(range(1, cell.steps + 1)):
                raise EvidenceError(f"{path}: steps {record['steps'][:12]} judged, the plan has steps 1..{cell.steps}")
            if not isinstance(record.get("result"), dict):
                raise EvidenceError(f"{path}: no result")
        return record

    def judge_record(self, cell: Cell, records: dict) -> tuple[CellResult, dict | None]:
        """`judge` of a cell its own rank 0 judged: its result, the trajectory judged against the
        reference's envelope in `records`."""
        ref_cell = self._reference_of(cell)
        loaded = {}
        try:
            for spec in get_case(cell.case).optimizers:
                loaded[spec.kind] = self.load_record(cell, spec.kind)
        except EvidenceError as e:
            return CellResult(cell, Verdict.ERROR, error=f"incomplete evidence: {e}"), None
        result = CellResult(cell, Verdict.PASS)
        for kind, record in loaded.items():
            if record["error"] is not None:
                return CellResult(cell, Verdict.ERROR, error=record["error"]), None
            opt = result_from_record(record["result"])
            if not cell.is_reference:
                ref = records.get((ref_cell.cell_id, kind))
                if ref is None:
                    return _no_reference(cell, ref_cell, kind), None
                if ref["init_digest"] != record["init_digest"]:
                    return CellResult(cell, Verdict.ERROR, error=(
                        f"the case's build_model() built another initial state for this cell than for the reference "
                        f"{ref_cell.cell_id} (digests {record['init_digest']} and {ref['init_digest']}); a case must "
                        f"build the same model in every process (seed it, or give its weights)")), None
                if ref["steps"] != record["steps"]:
                    return CellResult(cell, Verdict.ERROR, error=(
                        f"incomplete evidence: steps {record['steps'][:12]} but the reference {ref_cell.cell_id} has "
                        f"steps {ref['steps'][:12]}")), None
                try:
                    complete_trajectory(opt, [TrajectoryDeviation.from_record(d) for d in record["trajectory"]],
                                        ref["envelopes"])
                except Exception:
                    return CellResult(cell, Verdict.ERROR, error=f"the checks of optimizer={kind} raised "
                                                           f"(no verdict):\n{traceback.format_exc()}"), None
            if opt.error is not None:
                return CellResult(cell, Verdict.ERROR, optimizers={kind: opt}, error=f"optimizer={kind}: {opt.error}"), None
            _add_gathered_mismatches(opt, kind, [GatheredMismatch(**m) for m in record["gathered_mismatches"]])
            result.optimizers[kind] = opt
        if result.violations:
            result.verdict = Verdict.FAIL
        return result, loaded

    def judge(self, cell: Cell, snapshots: dict) -> tuple[CellResult, dict | None]:
        """(the cell's result, its evidence by optimizer when it was judged pass or fail) against
        the reference evidence in `snapshots`."""
        if cell.case in self.plan.judged_on_ranks:
            return self.judge_record(cell, snapshots)
        init = self.inputs()[0][cell.case]
        if isinstance(init, str):
            return CellResult(cell, Verdict.ERROR, error=init), None
        init_state, init_buffers = init
        case = get_case(cell.case)
        ref_cell = self._reference_of(cell)
        loaded = {}
        try:
            for spec in case.optimizers:
                loaded[spec.kind] = self.load_evidence(cell, spec.kind)
                ref = snapshots.get((ref_cell.cell_id, spec.kind))
                if ref is not None and not cell.is_reference:
                    check_same_steps(loaded[spec.kind], ref, ref_cell)
        except EvidenceError as e:
            return CellResult(cell, Verdict.ERROR, error=f"incomplete evidence: {e}"), None
        except LayoutError as e:  # [Note: Layout validation]
            return CellResult(cell, Verdict.ERROR, error=f"the adapter's layouts contradict its raw shards: {e}"), None
        result = CellResult(cell, Verdict.PASS)
        for kind, snap in loaded.items():
            ref = snapshots.get((ref_cell.cell_id, kind))
            if ref is None and not cell.is_reference:
                return _no_reference(cell, ref_cell, kind), None
            try:
                opt = check_snapshot(snap, {n: init_state[n] for n in snap["init"]["params"]}, ref,
                                     init_buffers=init_buffers)
            except ReferenceDiverged as e:
                return CellResult(cell, Verdict.ERROR, error=f"optimizer={kind}: {e}"), None
            except Exception:
                return CellResult(cell, Verdict.ERROR, error=f"the checks of optimizer={kind} raised "
                                                       f"(no verdict):\n{traceback.format_exc()}"), None
            if opt.error is not None:
                return CellResult(cell, Verdict.ERROR, optimizers={kind: opt}, error=f"optimizer={kind}: {opt.error}"), None
            _add_gathered_mismatches(opt, kind, snap.get("gathered_mismatches", ()))
            result.optimizers[kind] = opt
        if result.violations:
            result.verdict = Verdict.FAIL
        return result, loaded

    def judge_early(self, cell: Cell) -> None:
        """Judge a completed cell while the launch goes on (see the class docstring)."""
        if not cell.is_reference and self._reference_of(cell).cell_id not in self.early:
            return  # its reference is not judged yet: the final pass judges it
        try:
            result, loaded = self.judge(cell, self.early_snapshots)
        except Exception:
            return  # the final pass judges it again and reports what it raises
        self.early[cell.cell_id] = (result, loaded, self._ref_key(cell, self.early_snapshots))
        for kind, snap in (loaded or {}).items():
            self.early_snapshots[(cell.cell_id, kind)] = snap

    def final(self, cell: Cell, outcome: RunOutcome, snapshots: dict) -> CellResult:
        """The cell's result after the run: an error where its launch failed, else the early
        result where its inputs are the same, else judged now; its evidence added to `snapshots`."""
        if cell.cell_id in outcome.errors:
            return CellResult(cell, Verdict.ERROR, error=outcome.errors[cell.cell_id])
        early = self.early.get(cell.cell_id)
        if early is not None and early[2] == self._ref_key(cell, snapshots):
            result, loaded = early[0], early[1]
        else:
            result, loaded = self.judge(cell, snapshots)
        for kind, snap in (loaded or {}).items():
            snapshots[(cell.cell_id, kind)] = snap
        return result


def evaluate(plan: RunPlan, outcome: RunOutcome, judged: Callable[[int, int], None] | None = None,
             judge: Judge | None = None) -> tuple[list[CellResult], list[CellResult], list[Matrix]]:
    """(results of the cells under test, results of the reference cells, W x W matrices).

    `judged(done, total)` is called before the first cell and after each one (long runs judge for
    minutes: the caller shows it). `judge`: the run's Judge when it judged cells early (during the
    launch), whose results are taken where they stand ([Note: Judging while the ranks train])."""
    judge = judge if judge is not None else Judge(plan)
    snapshots: dict[tuple[str, str], dict] = {}  # only evidence that passed check_snapshot_evidence
    order = plan.references + plan.cells  # references first: the cells are judged against them
    results: list[CellResult] = []
    for cell in order:
        if judged is not None:
            judged(len(results), len(order))
        results.append(judge.final(cell, outcome, snapshots))
    if judged is not None:
        judged(len(results), len(order))
    references, cells = results[:len(plan.references)], results[len(plan.references):]

    matrices = []
    groups = sorted({(c.case, c.impl, c.data_mode) for c in plan.cells})
    for case_name, impl, mode in groups:
        members = sorted((c for c in plan.cells if (c.case, c.impl, c.data_mode) == (case_name, impl, mode)),
                         key=lambda c: c.world_size)
        ref_cell = next(r for r in plan.references if r.case == case_name)
        entries = [("ref", ref_cell)] + [(str(c.world_size), c) for c in members]
        for spec in get_case(case_name).optimizers:
            if case_name in plan.judged_on_ranks:
                values = _judged_matrix(entries, [snapshots.get((c.cell_id, spec.kind)) for _, c in entries])
                matrices.append(Matrix(case_name, impl, mode, spec.kind, tuple(l for l, _ in entries), values))
                continue
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


def _judged_matrix(entries: list, records: list[dict | None]) -> tuple[tuple[float | None, ...], ...]:
    """A matrix of cells their ranks judged (entries[0]: the reference): a cell's distance from
    the reference is its record's, exact; two cells whose trajectories have the same digest are
    0 apart (NaN where one is not finite, as the subtraction of a snapshot's matrix gives), and a
    cell with the reference's digest is as far from any other as the reference is; any other pair
    is not known (None, as for a cell without evidence)."""
    matrix = [r["matrix"] if r is not None else None for r in records]

    def distance(i: int, j: int) -> float | None:
        a, b = matrix[i], matrix[j]
        if a is None or b is None:
            return None
        ref = matrix[0]
        if i == 0 or (ref is not None and a["digest"] == ref["digest"]):
            return b["vs_reference"] if j else a["vs_reference"]
        if j == 0 or (ref is not None and b["digest"] == ref["digest"]):
            return a["vs_reference"]
        if a["digest"] == b["digest"]:
            return 0.0 if a["finite"] and b["finite"] else float("nan")
        return None

    return tuple(tuple(distance(i, j) for j in range(len(entries))) for i in range(len(entries)))
