"""report.md: the text twin of report.html (harness/report/html.py), the same sections as tables."""

from __future__ import annotations

import pandas as pd

from harness.judge.checks import JUDGED
from harness.judge.result import Verdict
from harness.report.build import Report, bias_note, fmt_value, cell_row, error_model_rows, first_check, uncaught_faults
from harness.report.environment import ranks_label
from harness.report.view import case_views, cell_label, margin_text, skipped_groups, verdict_counts
from harness.reference.tolerance import TRAJECTORY_FACTOR


def _md_table(rows: list[dict]) -> str:
    # disable_numparse: "0.49" and "4e-03" stay as written, not reformatted as numbers
    return pd.DataFrame(rows).to_markdown(index=False, disable_numparse=True) if rows else "(none)"


def _verdict_rows(report: Report) -> list[dict]:
    rows = []
    for r in report.cells:
        row = cell_row(r)
        rows.append({"case": row["case"], "impl": row["impl"], "W": row["world_size"], "data": row["data"],
                     "verdict": row["verdict"], "first check": first_check(r) or "-",
                     **{f"margin {c}": (f"off from step {r.bias_not_applied['step']}"
                                         if c == "bias" and r.bias_not_applied else margin_text(row[f"margin_{c}"]))
                        for c in JUDGED},
                     "exact checks": "fail" if any(v.check not in JUDGED for v in r.violations) else
                                     ("pass" if r.optimizers else "n/a"),
                     "bitwise = reference": row["bitwise_equal"] if row["bitwise_equal"] is not None else "n/a",
                     "time s": f"{report.cell_wall_s.get(r.cell.cell_id, 0.0):.1f}"})
    return rows


def _neighbourhood_lines(r) -> list[str]:
    """The evidence around the first element a per-step check found beyond its tolerance (the
    judge's `neighbourhood`), as an indented table: one row per flat index, the element marked."""
    hood = next((o.neighbourhood for o in r.optimizers.values() if o.neighbourhood), None)
    if hood is None:
        return []
    labels = list(hood["rows"])
    lines = [f"  - around it: optimizer={hood['optimizer']} step={hood['step']} {hood['check']} "
             f"'{hood['name']}', flat indices from {hood['start']} (the element marked):", "",
             "    | index | " + " | ".join(labels) + " |", "    | --- |" + " --- |" * len(labels)]
    width = max(len(v) for v in hood["rows"].values())
    for k in range(width):
        index = hood["start"] + k
        mark = f"**{index}**" if index == hood["index"] else str(index)
        cells = [f"{vals[k]:.9g}" if k < len(vals) else "" for vals in hood["rows"].values()]
        lines.append(f"    | {mark} | " + " | ".join(cells) + " |")
    return lines + [""]


def render_markdown(report: Report) -> str:
    counts = verdict_counts(report)
    env = report.environment
    out = ["# FSDP equivalence report\n",
           f"**Verdict: {report.verdict.upper()}{ranks_label(env)}** ({len(report.cells)} cells: {counts['pass']} pass, "
           f"{counts['fail']} fail, {counts['error']} error, {len(report.skipped)} skipped; wall time "
           f"{report.wall_s:.0f}s)\n",
           f"Command: `{report.command}`\n",
           f"Run id: `{report.run_id}` (stamped into every snapshot and report file of this run)\n",
           f"Ran on: torch {env.get('torch')}, backend {env.get('backend')}, device {env.get('device')}"
           f"{' (' + str(env['gpu']) + ', CUDA ' + str(env.get('cuda')) + ')' if env.get('gpu') else ''}, "
           f"{env.get('threads_per_rank')} intra-op thread(s) per rank\n",
           "A cell is one (case, impl, world size, data mode); it trains once per optimizer of its case and "
           "passes only if every check of every step of each holds. A margin is the largest |diff| / tolerance "
           "of a check over all steps and optimizers (docs/error_model.md): below 0.5 is what honest runs "
           "show, 0.5 to 1 passes near the bound, above 1 fails. The exact checks (no NaN/Inf, initial state, "
           "per-rank loss, replicas, padding) have tolerance 0. `bitwise = reference`: the free-running cell "
           "equals the reference run (impl=single, W = 1) bit for bit at every step.\n",
           "## Verdicts\n", _md_table(_verdict_rows(report)) + "\n"]
    notes = [(r.cell.cell_id, bias_note(r)) for r in report.cells if r.bias_not_applied]
    if notes:
        out.append("Checks not applied:\n")
        out.extend(f"- {cell_id}: {note}" for cell_id, note in notes)
        out.append("")
    uncaught = uncaught_faults(report)
    if uncaught:
        out.append("Planted faults not caught:\n")
        out.extend(f"- {line}" for line in uncaught)
        out.append("")
    failing = [r for r in report.cells if r.verdict == Verdict.FAIL]
    out.append("## First divergences\n")
    if failing:
        for r in failing:
            out.append(f"- {r.first_divergence.describe(r.cell.cell_id)}")
            for v in r.violations[1:4]:
                out.append(f"  - then: {v.describe(r.cell.cell_id)}")
            out.extend(_neighbourhood_lines(r))
        out.append("")
    else:
        out.append("(none: no cell diverged)\n")
    errored = [r for r in report.cells + report.references if r.verdict == Verdict.ERROR]
    if errored:
        out.append("## Errors (crashed or hung ranks)\n")
        for r in errored:
            out.append(f"### {r.cell.cell_id}\n\n```\n{r.error}\n```\n")
    if report.skipped:
        out.append("## Skipped (cannot run here)\n")
        out.append(_md_table(skipped_groups(report)) + "\n")

    out.append("## Loss per step\n")
    out.append("The cell's loss (mean over ranks) at every step, per world size and implementation; `reference` "
               "is the unsharded run (impl=single, W = 1). Equivalent runs coincide to the printed digits.\n")
    for view in case_views(report):
        for opt in view.optimizers:
            out.append(f"### {view.case} / {opt}\n")
            rows = [{"run": "reference", **{f"step {s}": f"{v:.7g}" for s, v in view.reference_loss(opt).items()}}]
            for r in view.cells:
                rows.append({"run": cell_label(r), **{f"step {s}": f"{v:.7g}" for s, v in view.losses(r, opt).items()}})
            out.append(_md_table(rows) + "\n")

    out.append("## Trajectory against its bound\n")
    out.append(f"Per step, the free-running cell's largest parameter deviation from the reference, |diff|, and "
               f"the judged bound, tol = {TRAJECTORY_FACTOR:g} x the deviation of perturbed reference runs "
               f"(the element nearest its bound: `|diff| / tol`).\n")
    for view in case_views(report):
        for opt in view.optimizers:
            rows = []
            for r in view.cells:
                points = view.trajectory(r, opt)
                if points:
                    rows.append({"run": cell_label(r), **{f"step {s}": f"{fmt_value(d)} / {fmt_value(t)}"
                                                          for s, (d, t) in points.items()}})
            if rows:
                out.append(f"### {view.case} / {opt}\n")
                out.append(_md_table(rows) + "\n")

    out.append("## W x W matrices\n")
    out.append("Max abs diff over all steps of losses, gradients and parameters between the runs at two "
               "world sizes (`ref` = impl=single at W = 1). Informational, with no tolerance of its own: the "
               "free-running trajectories may drift by amplified rounding (AdamW); the verdict comes from the "
               "per-step checks and the trajectory bound above. n/a: no evidence for one of the two, or two "
               "cells judged on their own ranks (big models, `--judge-on`) whose trajectories differ: their "
               "distance from `ref` is exact, from each other only known where bitwise equal.\n")
    for m in report.matrices:
        out.append(f"### {m.case} / {m.impl} / {m.data_mode} / {m.optimizer}\n")
        rows = [{"W": a, **{b: fmt_value(v) for b, v in zip(m.labels, vals)}} for a, vals in zip(m.labels, m.values)]
        out.append(_md_table(rows) + "\n")
    out.append("## Tolerances used\n")
    out.append("Loss, init, replicas and padding are exact. Per element: grad tol = gamma_n(u) x sum|local "
               "term| / W with n = W x M + 2 (+1 for a cast into the reduce dtype), u the unit roundoff of the "
               "reduce dtype; param tol = that bound pushed through clipping and the optimizer with the shadow's "
               f"state; trajectory tol = {TRAJECTORY_FACTOR:g} x the perturbed references' deviation. "
               "See docs/error_model.md.\n")
    rows = [{k: (fmt_value(v) if isinstance(v, float) or v is None else v) for k, v in row.items()}
            for row in error_model_rows(report)]
    out.append(_md_table(rows) + "\n")
    out.append("## Environment\n")
    out.append(_md_table([{"key": k, "value": v} for k, v in report.environment.items()]) + "\n")
    return "\n".join(out)
