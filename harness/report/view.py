"""The report's data arranged per case, shared by the Markdown and HTML renderings (one source
for both, so the text twin and the page cannot disagree)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.judge.checks import CHECK_ORDER, JUDGED
from harness.judge.result import Verdict
from harness.report.build import Report
from harness.judge.verdict import CellResult

# |diff| / tol bands: honest runs stay below NEAR; up to 1 passes near the bound; above fails.
NEAR = 0.5


def margin_class(margin: float | None) -> str:
    """CSS class and legend key of a margin: ok (< 0.5), near (0.5..1), over (> 1), nan, na."""
    if margin is None:
        return "na"
    if math.isnan(margin):
        return "nan"
    if margin < NEAR:
        return "ok"
    return "near" if margin <= 1.0 else "over"


def margin_text(margin: float | None) -> str:
    """Below 1, truncated to two decimals so that the text never rounds into the next band
    (0.4996 reads 0.49, shown green, not 0.5)."""
    if margin is None:
        return "-"
    if not math.isfinite(margin):
        return str(margin)
    if margin == 0:
        return "0.0"
    if margin < 0.01:
        return f"{margin:.0e}"
    return f"{math.floor(margin * 100) / 100:.2f}" if margin < 1 else f"{margin:.3g}"


def cell_label(r: CellResult) -> str:
    c = r.cell
    faults = f" +{','.join(c.faults)}" if c.faults else ""
    return f"{c.impl} W={c.world_size} {c.data_mode}{faults}"


def verdict_counts(report: Report) -> dict[str, int]:
    return {v.value: sum(r.verdict == v for r in report.cells) for v in Verdict}


def skipped_groups(report: Report) -> list[dict]:
    """Skipped cells grouped by (case, impl, reason), with their world sizes and data modes."""
    groups: dict[tuple, list] = {}
    for cell, reason in report.skipped:
        groups.setdefault((cell.case, cell.impl, reason), []).append(cell)
    return [{"case": case, "impl": impl, "cells": len(cells),
             "world sizes": ",".join(str(w) for w in sorted({c.world_size for c in cells})),
             "data": ",".join(sorted({c.data_mode for c in cells})), "reason": reason}
            for (case, impl, reason), cells in sorted(groups.items())]


def worst_judged(r: CellResult) -> tuple[str, float | None]:
    """(check, margin) of the judged check nearest or furthest past its tolerance."""
    margins = r.margins
    found = [(c, margins[c]) for c in JUDGED if c in margins]
    if not found:
        return "", None
    return max(found, key=lambda cm: math.inf if math.isnan(cm[1]) else cm[1])


def check_margins(r: CellResult) -> dict[str, float | None]:
    """Per check of CHECK_ORDER: its margin over all steps and optimizers; an exact check is 0 when
    it found nothing and inf when it failed; None when the cell compared nothing for it."""
    margins = r.margins
    out: dict[str, float | None] = {}
    for check in CHECK_ORDER:
        compared = any(o.checks.get(check, {}).get("elements", 0) > 0 for o in r.optimizers.values())
        failed = [v.ratio for v in r.violations if v.check == check]
        if failed:
            out[check] = max(failed, key=lambda x: math.inf if math.isnan(x) else x)
        elif compared or check == "nonfinite":
            out[check] = margins.get(check, 0.0)
        else:
            out[check] = None
    return out


def check_detail(r: CellResult, check: str) -> str:
    """Where the check came nearest its tolerance: step, parameter, |diff| and tol (a tooltip)."""
    worst = None
    for o in r.optimizers.values():
        for e in o.step_checks:
            if e["check"] == check and (worst is None or not e["margin"] <= worst[1]["margin"]):
                worst = (o.optimizer, e)
    failed = [v for v in r.violations if v.check == check]
    if failed:
        v = failed[0]
        return f"first failure: optimizer={v.optimizer} step={v.step} '{v.name}' |diff|={v.abs_diff:.3g} tol={v.tol:.3g}"
    if worst is None:
        return ""
    opt, e = worst
    return f"optimizer={opt} step={e['step']} '{e['name']}' |diff|={e['diff']:.3g} tol={e['tol']:.3g}"


@dataclass
class CaseView:
    case: str
    cells: list[CellResult]
    reference: CellResult | None
    optimizers: list[str]

    def losses(self, r: CellResult, optimizer: str) -> dict[int, float]:
        o = r.optimizers.get(optimizer)
        return {e["step"]: e["loss"] for e in o.losses} if o else {}

    def reference_loss(self, optimizer: str) -> dict[int, float]:
        if self.reference is not None and optimizer in self.reference.optimizers:
            return self.losses(self.reference, optimizer)
        for r in self.cells:  # the reference crashed or was not judged: the cells kept its losses
            o = r.optimizers.get(optimizer)
            if o and o.losses and o.losses[0]["reference"] is not None:
                return {e["step"]: e["reference"] for e in o.losses}
        return {}

    def trajectory(self, r: CellResult, optimizer: str) -> dict[int, tuple[float, float]]:
        """step -> (|diff|, tol) of the trajectory check's element nearest its bound."""
        o = r.optimizers.get(optimizer)
        if not o:
            return {}
        return {e["step"]: (e["diff"], e["tol"]) for e in o.step_checks if e["check"] == "trajectory"}


def case_views(report: Report) -> list[CaseView]:
    views = []
    for case in dict.fromkeys(r.cell.case for r in report.cells):
        cells = [r for r in report.cells if r.cell.case == case]
        reference = next((r for r in report.references if r.cell.case == case), None)
        optimizers = list(dict.fromkeys(o for r in cells + ([reference] if reference else []) for o in r.optimizers))
        views.append(CaseView(case, cells, reference, optimizers))
    return views
