"""Reports, rendered by the parent: report.md, report.html (heatmaps), summary.json, cells.csv,
steps.csv, matrices.csv and junit.xml, written as one set (harness/output.py), each naming the
run id. The verdict here is what the CLI maps to an exit code. NaN and Inf are rendered as
such (a non-finite value is evidence, not a rendering failure); summary.json stays strict JSON
by writing them as the strings "nan", "inf" and "-inf"."""

from __future__ import annotations

import html
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree as ET

import pandas as pd
import torch

from cases.catalog import get_case
from harness.orchestrate import RunOutcome
from harness.tolerance import TRAJECTORY_FACTOR
from harness.verdict import CellResult, Matrix


@dataclass(frozen=True)
class Report:
    verdict: str  # pass | fail
    cells: list[CellResult]
    references: list[CellResult]
    matrices: list[Matrix]
    environment: dict
    command: str
    wall_s: float
    skipped: tuple = ()  # (Cell, reason) of cells that cannot run here
    run_id: str = ""


def environment(plan_threads: int) -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).resolve().parent.parent).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "backend": "gloo",
        "device": "cpu",
        "threads_per_rank": plan_threads,
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def build_report(cells, references, matrices, outcome: RunOutcome, command: str) -> Report:
    bad = [c for c in cells + references if c.verdict != "pass"]
    return Report("fail" if bad or not cells else "pass", cells, references, matrices,
                  environment(outcome.plan.threads), command, outcome.wall_s, outcome.plan.skipped,
                  outcome.plan.run_id)


def _fmt(x: float | None) -> str:
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
    if r.verdict == "error":
        return "error"
    first = r.first_divergence
    return first.check if first is not None else ""


def cell_row(r: CellResult) -> dict:
    traj = r.trajectory()
    first = r.first_divergence
    margins = r.margins()
    return {
        "case": r.cell.case, "impl": r.cell.impl, "world_size": r.cell.world_size, "data": r.cell.data_mode,
        "verdict": r.verdict,
        "first_check": first_check(r),
        "max_abs_diff": traj.max_abs if traj else None,
        "max_rel_diff": traj.max_rel if traj else None,
        "max_ulp_diff": traj.max_ulp if traj else None,
        "num_diff": traj.num_diff if traj else None,
        "bitwise_equal": traj.bitwise_equal if traj else None,
        "margin_loss": margins.get("loss"), "margin_grad": margins.get("grad"), "margin_param": margins.get("param"),
        "first_divergence": first.describe(r.cell.cell_id) if first else None,
    }


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
        "references": [{"case": r.cell.case, "verdict": r.verdict, "error": r.error} for r in report.references],
        "skipped": [{"cell_id": c.cell_id, "case": c.case, "impl": c.impl, "world_size": c.world_size,
                     "data": c.data_mode, "reason": reason} for c, reason in report.skipped],
        "environment": report.environment,
        "command": report.command,
        "wall_s": round(report.wall_s, 2),
        "trajectory_factor": TRAJECTORY_FACTOR,
    })


def _md_table(rows: list[dict]) -> str:
    return pd.DataFrame(rows).to_markdown(index=False) if rows else "(none)"


def _error_model_rows(report: Report) -> list[dict]:
    """Per case, optimizer and check over its cells: the unit roundoff behind the tolerance, the
    elements compared, tolerance / |value| (largest median and max) and the largest margin."""
    groups: dict[tuple, list[dict]] = {}
    for r in report.cells:
        for opt in r.optimizers.values():
            for check, st in opt.checks.items():
                groups.setdefault((r.cell.case, opt.optimizer, check), []).append(st)

    def worst(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    return [{"case": case, "optimizer": opt, "check": check,
             "u": ", ".join(sorted({f"{st['u']:.3g}" for st in sts})) if any(st["u"] for st in sts) else "exact",
             "elements": sum(st["elements"] for st in sts),
             "tol/|value| median (worst cell)": _fmt(worst(st["tol_over_value_median"] for st in sts)),
             "tol/|value| max": _fmt(worst(st["tol_over_value_max"] for st in sts)),
             "margin (worst cell)": _fmt(worst(st["margin"] for st in sts))}
            for (case, opt, check), sts in sorted(groups.items())]


def render_markdown(report: Report) -> str:
    counts = {v: sum(r.verdict == v for r in report.cells) for v in ("pass", "fail", "error")}
    out = [f"# FSDP equivalence report\n",
           f"**Verdict: {report.verdict.upper()}** ({len(report.cells)} cells: {counts['pass']} pass, "
           f"{counts['fail']} fail, {counts['error']} error; wall time {report.wall_s:.0f}s)\n",
           f"Command: `{report.command}`\n",
           f"Run id: `{report.run_id}` (stamped into every snapshot and report file of this run)\n",
           "A cell is one (case, impl, world size, data mode); it trains once per optimizer of its case "
           "(SGD+momentum and AdamW) and passes only if every step of both is within tolerance. "
           "`max_abs_diff`/`max_ulp_diff` compare the cell's losses, gradients and parameters at every step "
           "with the reference run (impl=single, W = 1; exactly 0.0 when bitwise equal). The margins are the "
           "largest |diff| / tolerance of the per-step checks (docs/error_model.md); honest runs stay below 0.5.\n",
           "## Verdicts\n"]
    rows = []
    for r in report.cells:
        row = cell_row(r)
        rows.append({"case": row["case"], "impl": row["impl"], "W": row["world_size"], "data": row["data"],
                     "verdict": row["verdict"], "first check": row["first_check"] or "-",
                     "max_abs_diff": _fmt(row["max_abs_diff"]),
                     "max_ulp_diff": row["max_ulp_diff"] if row["max_ulp_diff"] is not None else "n/a",
                     "bitwise": row["bitwise_equal"],
                     "margin loss/grad/param": "/".join(_fmt(row[k]) for k in ("margin_loss", "margin_grad", "margin_param"))})
    out.append(_md_table(rows) + "\n")
    failing = [r for r in report.cells if r.verdict == "fail"]
    out.append("## First divergences\n")
    if failing:
        for r in failing:
            out.append(f"- {r.first_divergence.describe(r.cell.cell_id)}")
            other = [v for v in r.violations[1:4]]
            for v in other:
                out.append(f"  - then: {v.describe(r.cell.cell_id)}")
        out.append("")
    else:
        out.append("(none: no cell diverged)\n")
    errored = [r for r in report.cells + report.references if r.verdict == "error"]
    if errored:
        out.append("## Errors (crashed or hung ranks)\n")
        for r in errored:
            out.append(f"### {r.cell.cell_id}\n\n```\n{r.error}\n```\n")
    if report.skipped:
        out.append("## Skipped (cannot run here)\n")
        reasons = sorted({(c.case, c.impl, reason) for c, reason in report.skipped})
        out.append(_md_table([{"case": case, "impl": impl, "reason": reason} for case, impl, reason in reasons]) + "\n")
    out.append("## W x W matrices\n")
    out.append("Max abs diff over all steps of losses, gradients and parameters between the runs at two "
               "world sizes (`ref` = impl=single at W = 1). Informational: the free-running trajectories may "
               "drift by amplified rounding (AdamW); the verdict comes from the per-step checks.\n")
    for m in report.matrices:
        out.append(f"### {m.case} / {m.impl} / {m.data_mode} / {m.optimizer}\n")
        rows = [{"W": a, **{b: _fmt(v) for b, v in zip(m.labels, vals)}} for a, vals in zip(m.labels, m.values)]
        out.append(_md_table(rows) + "\n")
    out.append("## Tolerances used\n")
    out.append("Loss, init, replicas and padding are exact. Per element: grad tol = gamma_n(u) x sum|local "
               "term| / W with n = W x M + 2 (+1 for a cast into the reduce dtype), u the unit roundoff of the "
               "reduce dtype; param tol = that bound pushed through clipping and the optimizer with the shadow's "
               f"state; trajectory tol = {TRAJECTORY_FACTOR:g} x the perturbed references' deviation. "
               "See docs/error_model.md.\n")
    out.append(_md_table(_error_model_rows(report)) + "\n")
    out.append("## Environment\n")
    out.append(_md_table([{"key": k, "value": v} for k, v in report.environment.items()]) + "\n")
    return "\n".join(out)


def _heat(value: float | None) -> str:
    if value is None:
        return "#dddddd"
    if not math.isfinite(value):
        return "#7b1fa2"  # NaN / Inf: off the scale, and not a shade of it
    if value == 0:
        return "#e8f5e9"
    level = min(max((math.log10(value) + 10) / 8, 0.0), 1.0)  # 1e-10 .. 1e-2
    red, green = 255, int(235 - 180 * level)
    return f"rgb({red},{green},{int(200 - 180 * level)})"


def render_html(report: Report) -> str:
    e = html.escape
    parts = ["<!doctype html><meta charset='utf-8'><title>FSDP equivalence report</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:0.5em 0 1.5em}"
             "td,th{border:1px solid #999;padding:3px 8px;text-align:right;font-size:13px}"
             ".pass{background:#c8e6c9}.fail{background:#ffcdd2}.error{background:#ffe0b2}</style>",
             f"<h1>FSDP equivalence report: {e(report.verdict.upper())}</h1><p>{e(report.command)}</p>",
             f"<p>Run id: {e(report.run_id)}</p>",
             "<h2>Verdicts</h2><table><tr>"]
    headers = ["case", "impl", "W", "data", "verdict", "first check", "max_abs_diff", "max_ulp_diff", "first divergence"]
    parts.append("".join(f"<th>{h}</th>" for h in headers) + "</tr>")
    for r in report.cells:
        row = cell_row(r)
        parts.append(f"<tr class='{r.verdict}'><td>{e(r.cell.case)}</td><td>{e(r.cell.impl)}</td><td>{r.cell.world_size}</td>"
                     f"<td>{r.cell.data_mode}</td><td>{r.verdict}</td><td>{e(row['first_check'])}</td><td>{_fmt(row['max_abs_diff'])}</td>"
                     f"<td>{row['max_ulp_diff']}</td><td style='text-align:left'>{e(row['first_divergence'] or r.error or '')[:300]}</td></tr>")
    parts.append("</table><h2>W x W matrices (max abs diff, log-scale heat 1e-10 .. 1e-2)</h2>")
    for m in report.matrices:
        parts.append(f"<h3>{e(m.case)} / {e(m.impl)} / {e(m.data_mode)} / {e(m.optimizer)}</h3><table><tr><th>W</th>")
        parts.append("".join(f"<th>{e(l)}</th>" for l in m.labels) + "</tr>")
        for label, vals in zip(m.labels, m.values):
            cells = "".join(f"<td style='background:{_heat(v)}'>{_fmt(v)}</td>" for v in vals)
            parts.append(f"<tr><th>{e(label)}</th>{cells}</tr>")
        parts.append("</table>")
    parts.append("<h2>Environment</h2><table>" + "".join(
        f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in report.environment.items()) + "</table>")
    return "\n".join(parts)


def render_junit(report: Report, suite: str = "fsdp-equivalence") -> str:
    failures = sum(r.verdict == "fail" for r in report.cells)
    errors = sum(r.verdict == "error" for r in report.cells)
    root = ET.Element("testsuite", name=suite, tests=str(len(report.cells)), failures=str(failures),
                      errors=str(errors), time=f"{report.wall_s:.2f}")
    ET.SubElement(ET.SubElement(root, "properties"), "property", name="run_id", value=report.run_id)
    for r in report.cells:
        case = ET.SubElement(root, "testcase", classname=f"harness.{r.cell.case}", name=r.cell.cell_id)
        if r.verdict == "fail":
            first = r.first_divergence.describe(r.cell.cell_id)
            ET.SubElement(case, "failure", message=first).text = "\n".join(
                v.describe(r.cell.cell_id) for v in r.violations[:20])
        elif r.verdict == "error":
            ET.SubElement(case, "error", message=(r.error or "").splitlines()[0]).text = r.error
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def _csvs(report: Report) -> dict[str, str]:
    run = {"run_id": report.run_id}
    cells = pd.DataFrame([{**run, "cell_id": r.cell.cell_id, **cell_row(r)} for r in report.cells])
    steps = pd.DataFrame([{**run, "cell_id": r.cell.cell_id, **row} for r in report.cells
                          for o in r.optimizers.values() for row in o.per_step])
    matrices = pd.DataFrame([{**run, "case": m.case, "impl": m.impl, "data": m.data_mode, "optimizer": m.optimizer,
                              "w_row": a, "w_col": b, "max_abs_diff": v}
                             for m in report.matrices for a, vals in zip(m.labels, m.values)
                             for b, v in zip(m.labels, vals)])
    return {"cells.csv": cells.to_csv(index=False), "steps.csv": steps.to_csv(index=False),
            "matrices.csv": matrices.to_csv(index=False)}


def report_files(report: Report) -> dict[str, str]:
    """Every report file, rendered (nothing is written here: see OutputDir.write_report_set)."""
    return {
        "report.md": render_markdown(report),
        "report.html": render_html(report),
        "summary.json": json.dumps(summary_json(report), indent=1, default=str, allow_nan=False) + "\n",
        "junit.xml": render_junit(report),
        **_csvs(report),
    }


def console_summary(report: Report, stream=sys.stdout) -> None:
    for r in report.cells:
        if r.verdict == "fail":
            print(f"FAIL {r.first_divergence.describe(r.cell.cell_id)}", file=stream)
        elif r.verdict == "error":
            print(f"ERROR {r.cell.cell_id}:\n{r.error}", file=stream)
    for r in report.references:
        if r.verdict != "pass":
            print(f"REFERENCE {r.verdict.upper()} {r.cell.cell_id}: {r.error or r.first_divergence.describe(r.cell.cell_id)}", file=stream)
    for case, impl, reason in sorted({(c.case, c.impl, reason) for c, reason in report.skipped}):
        print(f"SKIP {case} ({impl}): {reason}", file=stream)
    counts = {v: sum(r.verdict == v for r in report.cells) for v in ("pass", "fail", "error")}
    print(f"verdict: {report.verdict} ({counts['pass']} pass, {counts['fail']} fail, {counts['error']} error, "
          f"{len(report.cells)} cells, {report.wall_s:.0f}s)", file=stream)
