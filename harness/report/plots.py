"""The report's figures as inline SVG (matplotlib, offline, no pyplot state): per case, the loss
per world size and implementation, and the trajectory deviation against its judged bound.

One visual code in every figure: colour = world size, line style = implementation, marker =
data mode; the reference run is the wide grey line underneath.
"""

from __future__ import annotations

import io
import math
import re

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator

from harness.report.view import CaseView, cell_label
from harness.reference.tolerance import TRAJECTORY_FACTOR
from harness.judge.result import Verdict
from harness.judge.verdict import CellResult

WORLD_SIZE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
IMPL_STYLES = ("-", "--", ":", "-.")
DATA_MARKERS = {"identical": "o", "split": "x"}
REFERENCE_STYLE = {"color": "#b0b0b0", "linewidth": 5, "solid_capstyle": "round", "zorder": 1}
MAX_STEP_TICKS = 12
RC = {"svg.fonttype": "none", "font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8,
      "legend.fontsize": 7, "xtick.labelsize": 7, "ytick.labelsize": 7}


class _Style:
    """Colour per world size, line style per implementation, marker per data mode of a case."""

    def __init__(self, cells: list[CellResult]) -> None:
        sizes = sorted({r.cell.world_size for r in cells})
        impls = list(dict.fromkeys(r.cell.impl_label for r in cells))
        self.colour = {w: WORLD_SIZE_COLOURS[i % len(WORLD_SIZE_COLOURS)] for i, w in enumerate(sizes)}
        self.style = {impl: IMPL_STYLES[i % len(IMPL_STYLES)] for i, impl in enumerate(impls)}
        self.modes = sorted({r.cell.data_mode for r in cells})

    def of(self, r: CellResult) -> dict:
        failed = r.verdict != Verdict.PASS
        return {"color": self.colour[r.cell.world_size], "linestyle": self.style[r.cell.impl_label],
                "marker": DATA_MARKERS.get(r.cell.data_mode, "s"), "markersize": 4 if failed else 3,
                "linewidth": 2.2 if failed else 1.1, "zorder": 3 if failed else 2}

    def legend_handles(self, with_reference: bool = True) -> list[Line2D]:
        handles = [Line2D([], [], label="reference (single, W=1)", **REFERENCE_STYLE)] if with_reference else []
        handles += [Line2D([], [], color=c, linewidth=2, label=f"W={w}") for w, c in self.colour.items()]
        handles += [Line2D([], [], color="#333333", linestyle=s, label=impl) for impl, s in self.style.items()]
        handles += [Line2D([], [], color="#333333", linestyle="", marker=DATA_MARKERS.get(m, "s"), label=f"{m} data")
                    for m in self.modes]
        return handles


def _svg(fig: Figure, salt: str) -> str:
    """The figure as an SVG element to inline; `salt` keeps its internal ids unique on the page."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


# A fixed layout in inches: matplotlib's constrained layout measured every tick label for a
# handful of figures and took most of the report's time (13.5 s of it on a loaded machine).
PANEL_IN, LEFT_IN, GAP_IN, BOTTOM_IN, TOP_IN = 2.6, 0.62, 0.62, 0.42, 0.26
LEGEND_IN_PER_CHAR, LEGEND_HANDLE_IN = 0.058, 0.6  # 7-point legend text, its line sample and padding


def _figure(num_panels: int, legend_labels: list[str], height: float = 2.1) -> tuple[Figure, list]:
    """Panels side by side, the legend in a column on the right as wide as its longest label."""
    legend_in = LEGEND_HANDLE_IN + LEGEND_IN_PER_CHAR * max((len(label) for label in legend_labels), default=0)
    width = LEFT_IN + num_panels * PANEL_IN + (num_panels - 1) * GAP_IN + 0.2 + legend_in
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=LEFT_IN / width, right=(width - legend_in - 0.2) / width, bottom=BOTTOM_IN / height,
                        top=1 - TOP_IN / height, wspace=GAP_IN / PANEL_IN)
    axes = fig.subplots(1, num_panels, squeeze=False)[0]
    return fig, list(axes)


def _legend(fig: Figure, handles: list[Line2D]) -> None:
    right = fig.subplotpars.right
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(right + 0.1 / fig.get_figwidth(), 0.5),
               frameon=False)


def _title(ax, text: str) -> None:
    # At the default height, given explicitly: matplotlib otherwise measures every tick label of
    # the axes at each draw to place the title above any top axis (these have none).
    ax.set_title(text, y=1.0)


def _steps_axis(ax, steps) -> None:
    ax.set_xlabel("step")
    if len(steps) <= MAX_STEP_TICKS:
        ax.set_xticks(sorted(steps))
    else:  # a long run (--steps 100): a tick per step would be unreadable
        ax.xaxis.set_major_locator(MaxNLocator(nbins=MAX_STEP_TICKS, integer=True))
    ax.grid(True, alpha=0.3, linewidth=0.5)


def loss_figure(view: CaseView) -> str:
    """The loss per step of every cell of a case, per optimizer, over the reference's."""
    style = _Style(view.cells)
    handles = style.legend_handles()
    with matplotlib.rc_context(RC):
        fig, axes = _figure(len(view.optimizers), [h.get_label() for h in handles])
        for ax, opt in zip(axes, view.optimizers):
            ref = view.reference_loss(opt)
            if ref:
                ax.plot(list(ref), list(ref.values()), **REFERENCE_STYLE)
            steps = set(ref)
            for r in view.cells:
                losses = view.losses(r, opt)
                steps |= set(losses)
                ax.plot(list(losses), list(losses.values()), label=cell_label(r), **style.of(r))
            _title(ax, f"{view.case} / {opt}")
            ax.set_ylabel("loss (mean over ranks)")
            _steps_axis(ax, steps)
        _legend(fig, handles)
        return _svg(fig, f"loss-{view.case}")


def trajectory_figure(view: CaseView) -> str | None:
    """Per step: the free-running cell's parameter deviation from the reference (|diff|, solid)
    and the bound it is judged against (tol, dashed), on a log scale; None without a trajectory."""
    style = _Style(view.cells)
    series = {opt: [(r, view.trajectory(r, opt)) for r in view.cells] for opt in view.optimizers}
    values = [x for opt in series.values() for _, pts in opt for d, t in pts.values() for x in (d, t)
              if math.isfinite(x) and x > 0]
    if not values:
        return None
    floor = min(values) / 10  # where an exact 0 (bitwise equal) is drawn on the log axis
    any_zero = any(d == 0 for opt in series.values() for _, pts in opt for d, _ in pts.values())
    handles = style.legend_handles(with_reference=False)
    handles.insert(0, Line2D([], [], color="#333333", linestyle=(0, (2, 2)),
                             label=f"bound: {TRAJECTORY_FACTOR:g} x perturbed-reference deviation"))
    handles.insert(0, Line2D([], [], color="#333333", label="|diff| (solid)"))
    if any_zero:
        handles.append(Line2D([], [], linestyle="", label=f"0 (bitwise equal) drawn at {floor:.1e}"))
    with matplotlib.rc_context(RC):
        fig, axes = _figure(len(view.optimizers), [h.get_label() for h in handles])
        for ax, opt in zip(axes, view.optimizers):
            steps: set[int] = set()
            for r, points in series[opt]:
                if not points:
                    continue
                s = style.of(r)
                xs = list(points)
                diffs = [d if d > 0 else floor for d, _ in points.values()]
                steps |= set(xs)
                ax.plot(xs, diffs, **s)
                ax.plot(xs, [t for _, t in points.values()], color=s["color"], linestyle=(0, (2, 2)),
                        linewidth=0.9, alpha=0.8, zorder=1)
            ax.set_yscale("log")
            # Plain '1e-07' labels: the default mathtext ones are parsed by pyparsing at every draw.
            ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.0e}"))
            _title(ax, f"{view.case} / {opt}")
            ax.set_ylabel("max |param - reference|")
            _steps_axis(ax, steps or {1})
        _legend(fig, handles)
        return _svg(fig, f"trajectory-{view.case}")


def safe_id(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", text)
