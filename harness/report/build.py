"""Reports, rendered by the parent: report.md, report.html (harness/report/html.py: plots and
tolerance-scaled heatmaps), summary.json, cells.csv, steps.csv, matrices.csv and junit.xml
(harness/report/junit.py), written as one set (harness/run/output.py), each naming the run id. The verdict
here is what the CLI maps to an exit code. NaN and Inf are rendered as such (a non-finite value
is evidence, not a rendering failure); summary.json stays strict JSON by writing them as the
strings "nan", "inf" and "-inf". The environment comes from the run's plan
(harness/report/environment.py), never assumed."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field

import pandas as pd

from harness.judge.checks import CHECK_ORDER
from harness.judge.result import Verdict
from harness.report.environment import plan_environment
from harness.run.outcome import RunOutcome
from harness.reference.tolerance import TRAJECTORY_FACTOR
from harness.judge.verdict import CellResult, Matrix

EXACT_CHECKS = ("nonfinite", "init", "loss", "buffers", "replicas", "padding")  # tolerance 0: a violation is the failure


@dataclass(frozen=True)
class Report:
    verdict: Verdict  # PASS or FAIL (a cell's error fails the run)
    cells: list[CellResult]
    references: list[CellResult]
    matrices: list[Matrix]
    environment: dict
    command: str
    wall_s: float
    skipped: tuple = ()  # (Cell, reason) of cells that cannot run here
    run_id: str = ""
    cell_wall_s: dict[str, float] = field(default_factory=dict)  # cell_id -> seconds in its ranks


def build_report(cells, references, matrices, outcome: RunOutcome, command: str) -> Report:
    bad = [c for c in cells + references if c.verdict != Verdict.PASS]
    return Report(Verdict.FAIL if bad or not cells else Verdict.PASS, cells, references, matrices,
                  plan_environment(outcome.plan), command, outcome.wall_s, outcome.plan.skipped,
                  outcome.plan.run_id, dict(outcome.cell_wall_s))


def fmt_value(x: float | None) -> str:
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return str(x)  # nan, inf, -inf
    if x == 0:
        return "0.0"
    return f"{x:.2e}"


def json_safe(obj):
    """`obj` with every non-finite float replaced by "nan" / "inf" / "-inf" (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def first_check(r: CellResult) -> str:
    """The check of the first divergence ('nonfinite', 'grad', ...), 'error' or ''."""
    if r.verdict == Verdict.ERROR:
        return "error"
    first = r.first_divergence
    return first.check if first is not None else ""


def cell_row(r: CellResult) -> dict:
    traj = r.trajectory()
    first = r.first_divergence
    margins = r.margins
    return {
        "case": r.cell.case, "impl": r.cell.impl, "world_size": r.cell.world_size, "data": r.cell.data_mode,
        "verdict": r.verdict,
        "first_check": first_check(r),
        "max_abs_diff": traj.max_abs if traj else None,
        "max_rel_diff": traj.max_rel if traj else None,
        "max_ulp_diff": traj.max_ulp if traj else None,
        "num_diff": traj.num_diff if traj else None,
        "bitwise_equal": traj.bitwise_equal if traj else None,
        **{f"margin_{check}": margins.get(check) for check in CHECK_ORDER},
        "first_divergence": first.describe(r.cell.cell_id) if first else None,
        "bias_not_applied": bias_note(r),
    }


def bias_note(r: CellResult) -> str | None:
    """Why the bias check stopped being applied in this cell, in one line, or None."""
    off = r.bias_not_applied
    if off is None:
        return None
    return (f"bias check off from step {off['step']}: the local backward accumulated gradients in another order "
            f"than the plain model ('{off['name']}' at {off['ratio']:.3g} x the reduction bound, within the "
            f"reordering allowance), so its rounding errors are correlated across elements and the sign counts "
            f"do not apply (docs/error_model.md, 'Reordered accumulation')")


def step_rows(r: CellResult) -> list[dict]:
    """Per optimizer and step (step 0: the initial parameters), what the judge saw: the cell's
    mean loss over ranks, the shadow's replay and the reference's loss; per check, the element
    nearest its tolerance: `<check>_max_diff`, `_tol`, `_margin` (|diff| / tol) and `_name`;
    and the free-running trajectory against the reference (`<quantity>_vs_reference_*`).
    An exact check (tol 0) that found no violation at a step had |diff| 0 there; a check that
    compared nothing in this cell (no padding, no replicas) is left empty."""
    rows: list[dict] = []
    for opt in r.optimizers.values():
        by_step: dict[int, dict] = {}

        def row(step: int) -> dict:
            return by_step.setdefault(step, {"optimizer": opt.optimizer, "step": step})

        for entry in opt.losses:
            row(entry["step"]).update(loss=entry["loss"], loss_replay=entry["replay"],
                                      loss_reference=entry["reference"])
        steps = sorted({0} | {e["step"] for e in opt.losses} | {e["step"] for e in opt.step_checks})
        compared = {c for c, st in opt.checks.items() if st["elements"] > 0} | {"nonfinite"}
        for step in steps:
            for check in EXACT_CHECKS:
                judged_here = {"init": step == 0, "nonfinite": True, "buffers": True}.get(check, step > 0)
                if check in compared and judged_here:
                    row(step).update({f"{check}_max_diff": 0.0, f"{check}_tol": 0.0, f"{check}_margin": 0.0,
                                      f"{check}_name": ""})
        for v in opt.violations:  # the exact checks' evidence, and any check's failure
            entry = row(v.step)
            if not v.ratio <= entry.get(f"{v.check}_margin", -1.0):
                entry.update({f"{v.check}_max_diff": v.abs_diff, f"{v.check}_tol": v.tol,
                              f"{v.check}_margin": v.ratio, f"{v.check}_name": v.name})
        for entry in opt.step_checks:  # the element nearest its tolerance, failing or not
            row(entry["step"]).update({f"{entry['check']}_max_diff": entry["diff"], f"{entry['check']}_tol": entry["tol"],
                                       f"{entry['check']}_margin": entry["margin"],
                                       f"{entry['check']}_name": entry["name"]})
        for entry in opt.per_step:
            q = entry["quantity"]
            row(entry["step"]).update({f"{q}_vs_reference_max_abs": entry["max_abs"],
                                       f"{q}_vs_reference_max_ulp": entry.get("max_ulp"),
                                       f"{q}_vs_reference_bitwise": entry["bitwise_equal"]})
        rows += [by_step[s] for s in sorted(by_step)]
    return rows


STEP_COLUMNS = (["optimizer", "step", "loss", "loss_replay", "loss_reference"]
                + [f"{c}_{k}" for c in CHECK_ORDER for k in ("max_diff", "tol", "margin", "name")]
                + [f"{q}_vs_reference_{k}" for q in ("loss", "grad", "param") for k in ("max_abs", "max_ulp", "bitwise")])


def summary_json(report: Report) -> dict:
    cells = []
    for r in report.cells:
        row = cell_row(r)
        first = r.first_divergence
        row["first_divergence"] = first.to_json() if first else None
        row["first_divergence_text"] = first.describe(r.cell.cell_id) if first else None
        row["cell_id"] = r.cell.cell_id
        row["faults"] = list(r.cell.faults)
        row["optimizers"] = sorted(r.optimizers)
        row["wall_s"] = report.cell_wall_s.get(r.cell.cell_id)
        row["violations"] = [v.to_json() for v in r.violations[:50]]
        # Every check's evidence, whatever the 50 above cut off: what it compared and what failed.
        row["checks"] = {o.optimizer: o.checks for o in r.optimizers.values()}
        row["failed_checks"] = {}
        for v in r.violations:
            entry = row["failed_checks"].setdefault(v.check, {"violations": 0, "first": v.describe(r.cell.cell_id)})
            entry["violations"] += 1
        row["error"] = r.error
        cells.append(row)
    return json_safe({
        "verdict": report.verdict,
        "run_id": report.run_id,
        "cells": cells,
        "references": [{"case": r.cell.case, "verdict": r.verdict, "error": r.error,
                        "wall_s": report.cell_wall_s.get(r.cell.cell_id)} for r in report.references],
        "skipped": [{"cell_id": c.cell_id, "case": c.case, "impl": c.impl, "world_size": c.world_size,
                     "data": c.data_mode, "reason": reason} for c, reason in report.skipped],
        "environment": report.environment,
        "command": report.command,
        "wall_s": round(report.wall_s, 2),
        "trajectory_factor": TRAJECTORY_FACTOR,
    })


def error_model_rows(report: Report) -> list[dict]:
    """Per case, optimizer and check over its cells: the unit roundoff behind the tolerance, the
    elements compared, tolerance / |value| (largest median and max) and the largest margin."""
    groups: dict[tuple, list[dict]] = {}
    for r in report.cells:
        for opt in r.optimizers.values():
            for check, st in opt.checks.items():
                groups.setdefault((r.cell.case, opt.optimizer, check), []).append(st)

    def worst(values):
        values = [v for v in values if v is not None]
        return max(values, key=lambda v: math.inf if v != v else v) if values else None

    return [{"case": case, "optimizer": opt, "check": check,
             "u": ("sign test (elements: tensors tested)" if check == "bias" else
                   ", ".join(sorted({f"{st['u']:.3g}" for st in sts})) if any(st["u"] for st in sts) else "exact"),
             "elements": sum(st["elements"] for st in sts),
             "tol/|value| median (worst cell)": worst(st["tol_over_value_median"] for st in sts),
             "tol/|value| max": worst(st["tol_over_value_max"] for st in sts),
             "margin (worst cell)": worst(st["margin"] for st in sts)}
            for (case, opt, check), sts in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                                  CHECK_ORDER.index(kv[0][2])))]


def _csvs(report: Report) -> dict[str, str]:
    run = {"run_id": report.run_id}
    cells = pd.DataFrame([{**run, "cell_id": r.cell.cell_id, **cell_row(r),
                           "wall_s": report.cell_wall_s.get(r.cell.cell_id)} for r in report.cells])
    identity = lambda r: {**run, "cell_id": r.cell.cell_id, "case": r.cell.case, "impl": r.cell.impl,  # noqa: E731
                          "world_size": r.cell.world_size, "data": r.cell.data_mode}
    steps = pd.DataFrame([{**identity(r), **row} for r in report.references + report.cells for row in step_rows(r)],
                         columns=list(identity(report.cells[0]) if report.cells else ["run_id", "cell_id"])
                         + STEP_COLUMNS)
    matrices = pd.DataFrame([{**run, "case": m.case, "impl": m.impl, "data": m.data_mode, "optimizer": m.optimizer,
                              "w_row": a, "w_col": b, "max_abs_diff": v}
                             for m in report.matrices for a, vals in zip(m.labels, m.values)
                             for b, v in zip(m.labels, vals)])
    return {"cells.csv": cells.to_csv(index=False), "steps.csv": steps.to_csv(index=False),
            "matrices.csv": matrices.to_csv(index=False)}


def report_files(report: Report) -> dict[str, str]:
    """Every report file, rendered (nothing is written here: see OutputDir.write_report_set)."""
    from harness.report.junit import render_junit
    from harness.report.html import render_html
    from harness.report.markdown import render_markdown

    return {
        "report.md": render_markdown(report),
        "report.html": render_html(report),
        "summary.json": json.dumps(summary_json(report), indent=1, default=str, allow_nan=False) + "\n",
        "junit.xml": render_junit(report),
        **_csvs(report),
    }


def uncaught_faults(report: Report) -> list[str]:
    """One line per cell that ran with a planted fault (`--faults`) and passed: the fault left every
    check within its bounds (it did not reach the numbers on this case, or the checks missed it),
    which a pass must not hide from whoever planted it."""
    return [f"{r.cell.cell_id}: planted fault(s) {', '.join(r.cell.faults)} left every check within its bounds"
            for r in report.cells if r.cell.faults and r.verdict == Verdict.PASS]


def console_summary(report: Report, stream=sys.stdout) -> None:
    for r in report.cells:
        if r.verdict == Verdict.FAIL:
            print(f"FAIL {r.first_divergence.describe(r.cell.cell_id)}", file=stream)
        elif r.verdict == Verdict.ERROR:
            print(f"ERROR {r.cell.cell_id}:\n{r.error}", file=stream)
    for r in report.references:
        if r.verdict != Verdict.PASS:
            print(f"REFERENCE {r.verdict.upper()} {r.cell.cell_id}: {r.error or r.first_divergence.describe(r.cell.cell_id)}", file=stream)
    for case, impl, reason in sorted({(c.case, c.impl, reason) for c, reason in report.skipped}):
        print(f"SKIP {case} ({impl}): {reason}", file=stream)
    for line in uncaught_faults(report):
        print(f"NOT CAUGHT {line}", file=stream)
    counts = {v.value: sum(r.verdict == v for r in report.cells) for v in Verdict}
    print(f"verdict: {report.verdict} ({counts['pass']} pass, {counts['fail']} fail, {counts['error']} error, "
          f"{len(report.cells)} cells, {report.wall_s:.0f}s)", file=stream)
