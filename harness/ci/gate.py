"""What `gate` adds to a run's reports: the CI-facing outputs, written by the parent.

- junit.xml: harness/report/junit.py's one test case per cell, plus one per reference cell (a crashed
  reference fails the gate, so CI must show it) and, with --baseline, one per case checked
  against the golden baseline (harness/ci/baseline.py); the failure message is the first divergence.
- summary.md: one row per cell (crashed and hung cells included) with its first divergence (the
  CLI also appends it to $GITHUB_STEP_SUMMARY when that is set: GitHub Actions renders it).
- report.md: a "Golden baseline" section when --baseline was given.
These are added to the run's report set before it is written, so the set is replaced as a whole.
"""

from __future__ import annotations

from dataclasses import replace
from xml.etree import ElementTree as ET

from harness.ci.baseline import BaselineResult
from harness.report.junit import MAX_FAILURE_LINES, add_cell_outcome, add_testcase, recount
from harness.judge.result import Verdict
from harness.report.build import Report


def apply_baseline(report: Report, results: list[BaselineResult]) -> Report:
    if any(r.verdict != Verdict.PASS for r in results):
        return replace(report, verdict=Verdict.FAIL)
    return report


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def _cell_rows(report: Report) -> list[tuple[str, str, str, str]]:
    """(cell id, verdict, max_abs_diff, first divergence or first error line) for cells, then references."""
    rows = []
    for r in report.cells + [r for r in report.references if r.verdict != Verdict.PASS]:
        traj = r.trajectory()
        first = r.first_divergence.describe(r.cell.cell_id) if r.first_divergence else _first_line(r.error)
        rows.append((r.cell.cell_id, r.verdict, f"{traj.max_abs:.3g}" if traj else "n/a", first))
    return rows


def render_summary(report: Report, baseline: list[BaselineResult]) -> str:
    lines = [f"## FSDP equivalence gate: {report.verdict.upper()}", "",
             f"`{report.command}`", "", f"Run id: `{report.run_id}`", "",
             "| cell | verdict | max_abs_diff | first divergence |", "| --- | --- | --- | --- |"]
    for cell_id, verdict, max_abs, first in _cell_rows(report):
        lines.append(f"| {cell_id} | {verdict} | {max_abs} | {first.replace('|', '/')} |")
    for b in baseline:
        first = b.violations[0].describe(b.path) if b.violations else (b.error or f"{b.num_checked} values within tolerance")
        lines.append(f"| {b.cell_id} | {b.verdict} | | {first.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def render_baseline_section(baseline: list[BaselineResult]) -> str:
    out = ["", "## Golden baseline", "",
           f"The single-process reference of this run against `{baseline[0].path}` (losses and the "
           "sum/norm digests of every gradient and parameter, per step; [Note: Baseline tolerance] in "
           "harness/ci/baseline.py).", ""]
    for b in baseline:
        out.append(f"- {b.cell_id}: **{b.verdict}** ({b.num_checked} values checked)")
        if b.error:
            out.append(f"  - {b.error}")
        for v in b.violations[:5]:
            out.append(f"  - {v.describe(b.path)}")
    return "\n".join(out) + "\n"


def extend_junit(junit: str, report: Report, baseline: list[BaselineResult]) -> str:
    root = ET.fromstring(junit)
    for r in report.references:
        case = add_testcase(root, "harness.reference", r.cell.cell_id, report.cell_wall_s.get(r.cell.cell_id, 0.0))
        add_cell_outcome(case, r)
    for b in baseline:
        case = add_testcase(root, "harness.baseline", b.cell_id, b.wall_s)
        if b.error:
            ET.SubElement(case, "error", message=b.error)
        elif b.violations:
            ET.SubElement(case, "failure", message=b.violations[0].describe(b.path)).text = "\n".join(
                v.describe(b.path) for v in b.violations[:MAX_FAILURE_LINES])
    recount(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def add_gate_files(files: dict[str, str], report: Report, baseline: list[BaselineResult]) -> dict[str, str]:
    """The run's report files (harness/report/build.py report_files) with junit.xml extended, report.md
    given its baseline section and summary.md added."""
    out = dict(files)
    out["junit.xml"] = extend_junit(files["junit.xml"], report, baseline)
    if baseline:
        out["report.md"] = files["report.md"] + render_baseline_section(baseline)
    out["summary.md"] = render_summary(report, baseline)
    return out


def print_baseline(baseline: list[BaselineResult]) -> None:
    for b in baseline:
        if b.error:
            print(f"BASELINE ERROR {b.cell_id}: {b.error}")
        for v in b.violations[:5]:
            print(f"BASELINE FAIL {v.describe(b.path)}")
        if b.verdict == Verdict.PASS:
            print(f"baseline {b.path}: case={b.case} pass ({b.num_checked} values within tolerance)")
