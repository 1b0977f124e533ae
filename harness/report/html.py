"""report.html: a jinja2 template (harness/report/templates/report.html.j2) filled with the report's data
and matplotlib figures inlined as SVG, so the page is one offline file.

The first screen holds what a reader needs first: the verdict, the failing cells with their
first divergence, the verdict grid per case (coloured by the worst margin) and the loss curves.
Below: the trajectory against its bound, the margin of every check per cell (|diff| / tolerance:
green below 0.5, amber to 1, red above), tolerances per check, skipped cells with reasons, and,
folded, every cell's per-step checks, the W x W matrices and the environment.
"""

from __future__ import annotations

import math
from pathlib import Path

import jinja2

from harness.judge.checks import CHECK_ORDER
from harness.judge.result import Verdict
from harness.report.plots import loss_figure, trajectory_figure
from harness.report.environment import ranks_label
from harness.report.build import Report, fmt_value, error_model_rows, step_rows
from harness.report.view import (case_views, cell_label, check_detail, check_margins, margin_class, margin_text,
                                 skipped_groups, verdict_counts, worst_judged)
from harness.reference.tolerance import TRAJECTORY_FACTOR
from harness.judge.verdict import CellResult

TEMPLATES = Path(__file__).resolve().parent / "templates"


def _entry(margin: float | None, title: str) -> dict:
    return {"css": margin_class(margin), "text": margin_text(margin), "title": title}


def _env_line(env: dict) -> str:
    gpu = f", {env['gpu']} (CUDA {env.get('cuda')})" if env.get("gpu") else ""
    return (f"torch {env.get('torch')}, {env.get('backend')} on {env.get('device')}{gpu}, "
            f"{env.get('threads_per_rank')} thread(s) per rank, git {str(env.get('git_commit', ''))[:10]}"
            f"{' (dirty)' if env.get('git_dirty') else ''}")


def _failures(report: Report) -> list[dict]:
    out = []
    for r in report.cells + report.references:
        if r.verdict == Verdict.FAIL:
            v = r.first_divergence
            out.append({"cell_id": r.cell.cell_id,
                        "headline": f"{v.check} at step {v.step}, |diff| / tol = {margin_text(v.ratio)}",
                        "detail": v.describe(r.cell.cell_id).removeprefix(r.cell.cell_id + " ")})
        elif r.verdict == Verdict.ERROR:
            lines = (r.error or "").strip().splitlines()
            out.append({"cell_id": r.cell.cell_id, "headline": "error (crashed, hung or not judged)",
                        "detail": lines[0] if lines else ""})
    return out


def _grid_entry(r: CellResult, time_s: float | None) -> dict:
    check, margin = worst_judged(r)
    took = f", {time_s:.1f} s" if time_s is not None else ""
    if r.verdict == Verdict.FAIL:
        first = r.first_divergence
        return {"css": "v-fail", "text": f"FAIL {first.check}", "title": first.describe(r.cell.cell_id)}
    if r.verdict == Verdict.ERROR:
        return {"css": "v-error", "text": "ERROR", "title": (r.error or "").strip()[:500]}
    return {"css": margin_class(margin), "text": f"pass {margin_text(margin)}",
            "title": f"{r.cell.cell_id}: worst margin {check}={margin_text(margin)}{took}; {check_detail(r, check)}"}


def _grids(report: Report) -> list[dict]:
    grids = []
    for view in case_views(report):
        skipped = [(c, reason) for c, reason in report.skipped if c.case == view.case]
        cells = [r.cell for r in view.cells] + [c for c, _ in skipped]
        sizes = sorted({c.world_size for c in cells})
        rows = {}
        for c in cells:
            rows.setdefault((c.impl_label + ("+" + ",".join(c.faults) if c.faults else ""), c.data_mode),
                            {w: None for w in sizes})
        for r in view.cells:
            key = (r.cell.impl_label + ("+" + ",".join(r.cell.faults) if r.cell.faults else ""), r.cell.data_mode)
            rows[key][r.cell.world_size] = _grid_entry(r, report.cell_wall_s.get(r.cell.cell_id))
        for c, reason in skipped:
            rows[(c.impl_label, c.data_mode)][c.world_size] = {"css": "v-skipped", "text": "skipped", "title": reason}
        grids.append({"case": view.case, "world_sizes": sizes,
                      "rows": [{"label": f"{impl} / {mode}", "entries": [entries[w] for w in sizes]}
                               for (impl, mode), entries in rows.items()]})
    return grids


def _heatmaps(report: Report) -> list[dict]:
    out = []
    for view in case_views(report):
        rows = []
        for r in view.cells:
            margins = check_margins(r)
            rows.append({"label": cell_label(r), "verdict": r.verdict,
                         "time": f"{report.cell_wall_s.get(r.cell.cell_id, 0.0):.1f}",
                         "entries": [_entry(margins[c], check_detail(r, c)) for c in CHECK_ORDER]})
        out.append({"case": view.case, "checks": CHECK_ORDER, "rows": rows})
    return out


def _cell_steps(report: Report) -> list[dict]:
    out = []
    for r in report.cells + report.references:
        rows = []
        for row in step_rows(r):
            entries = []
            for c in CHECK_ORDER:
                margin = row.get(f"{c}_margin")
                title = "" if margin is None else (f"max |diff|={fmt_value(row[f'{c}_max_diff'])} tol={fmt_value(row[f'{c}_tol'])}"
                                                   f" at '{row[f'{c}_name']}'")
                entries.append(_entry(margin, title))
            loss, ref = row.get("loss"), row.get("loss_reference")
            rows.append({"optimizer": row["optimizer"], "step": row["step"],
                         "loss": "" if loss is None else f"{loss:.7g}", "reference": "" if ref is None else f"{ref:.7g}",
                         "entries": entries})
        out.append({"cell_id": r.cell.cell_id, "verdict": r.verdict, "rows": rows})
    return out


def _magnitude_style(value: float | None) -> tuple[str, str]:
    """(inline style, css class) of a W x W entry: a neutral blue by order of magnitude."""
    if value is None:
        return "", "na"
    if not math.isfinite(value):
        return "", "nan"
    if value == 0:
        return "background:#ffffff", ""
    level = min(max((math.log10(value) + 12) / 12, 0.0), 1.0)  # 1e-12 .. 1
    return f"background:rgb({int(235 - 120 * level)},{int(242 - 90 * level)},255)", ""


def _matrices(report: Report) -> list[dict]:
    out = []
    for m in report.matrices:
        rows = []
        for label, values in zip(m.labels, m.values):
            entries = []
            for v in values:
                style, css = _magnitude_style(v)
                entries.append({"style": style, "css": css, "text": fmt_value(v)})
            rows.append({"label": label, "entries": entries})
        out.append({"title": f"{m.case} / {m.impl} / {m.data_mode} / {m.optimizer}", "labels": m.labels, "rows": rows})
    return out


def _tolerances(report: Report) -> tuple[list[str], list[dict]]:
    rows = error_model_rows(report)
    headers = list(rows[0]) if rows else []
    out = []
    for row in rows:
        values = [fmt_value(v) if isinstance(v, float) or v is None else v for v in row.values()]
        values[-1] = margin_text(row["margin (worst cell)"])
        css = ["text"] * 3 + [""] * (len(values) - 4) + [margin_class(row["margin (worst cell)"])]
        out.append({"cells": values, "css": css})
    return headers, out


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def render_html(report: Report) -> str:
    views = case_views(report)
    headers, tolerance_rows = _tolerances(report)
    context = {
        "verdict": report.verdict, "ranks_label": ranks_label(report.environment), "run_id": report.run_id, "command": report.command, "wall_s": report.wall_s,
        "counts": verdict_counts(report), "num_cells": len(report.cells), "num_skipped": len(report.skipped),
        "env_line": _env_line(report.environment), "environment": report.environment,
        "failures": _failures(report), "grids": _grids(report),
        "loss_figures": [loss_figure(v) for v in views if v.optimizers],
        "trajectory_figures": [f for f in (trajectory_figure(v) for v in views if v.optimizers) if f],
        "trajectory_factor": f"{TRAJECTORY_FACTOR:g}",
        "errors": [{"cell_id": r.cell.cell_id, "first_line": ((r.error or "").strip().splitlines() or [""])[0],
                    "text": r.error} for r in report.cells + report.references if r.verdict == Verdict.ERROR],
        "heatmaps": _heatmaps(report), "checks": CHECK_ORDER,
        "tolerance_headers": headers, "tolerance_rows": tolerance_rows,
        "skipped": skipped_groups(report), "cell_steps": _cell_steps(report), "matrices": _matrices(report),
    }
    return _environment().get_template("report.html.j2").render(context)
