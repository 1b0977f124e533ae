"""The measured figures the documentation quotes, generated from what the runs wrote into reports/
(`python -m harness figures`): every report set's summary.json (a run, a gate) and the bench's
bench.json, one row each, with the command that measured it and where (the machine, torch, the
commit). docs/measured.md holds the table between FIGURES_BEGIN and FIGURES_END; `figures --check`
fails when it is not what reports/ says (tests/harness/report/test_figures.py). Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FIGURES_BEGIN = "<!-- figures: generated from reports/ by `python -m harness figures`; edit reports, not this -->"
FIGURES_END = "<!-- figures: end -->"
MARGINS = ("margin_grad", "margin_param", "margin_loss")


@dataclass(frozen=True)
class Figure:
    name: str  # what was measured: the report set's directory under reports/, and the part
    value: str
    command: str
    measured_on: str  # machine, torch, backend, commit


def _where(env: dict) -> str:
    commit = env.get("git_commit")
    at = f"commit {commit[:7]}{' + uncommitted changes' if env.get('git_dirty') else ''}" if commit else "commit not recorded"
    return (f"{env.get('cpu_count', '?')} CPU cores, torch {env.get('torch', '?')}, {env.get('backend', '?')} on "
            f"{env.get('device', '?')}, {at}")


def _num(x: float) -> str:
    return f"{x:.3g}"


def from_summary(path: Path, name: str) -> Figure:
    """A run's verdict, its cells, its wall time and its largest margins per check."""
    summary = json.loads(path.read_text())
    cells = summary.get("cells", [])
    passed = sum(c.get("verdict") == "pass" for c in cells)
    margins = []
    for key in MARGINS:
        values = [c[key] for c in cells if isinstance(c.get(key), (int, float))]
        if values:
            margins.append(f"{key.removeprefix('margin_')} {_num(max(values))}")
    value = (f"{summary.get('verdict')}: {passed}/{len(cells)} cells pass in {summary.get('wall_s', '?')} s"
             + (f"; largest margins {', '.join(margins)}" if margins else ""))
    return Figure(name, value, f"`{summary.get('command', '?')}`", _where(summary.get("environment", {})))


def from_bench(path: Path, name: str) -> list[Figure]:
    """One row per part the bench measured (harness/bench/main.py)."""
    bench = json.loads(path.read_text())
    env = bench.get("environment", {})
    where = _where(env) + (f", load average {env['load_average_at_start']} at start"
                           if "load_average_at_start" in env else "")
    out = []
    if bench.get("speed"):
        ratios = [r["step_time_ratio_vs_fsdp2"] for r in bench["speed"]]
        sizes = sorted({r["world_size"] for r in bench["speed"]})
        out.append(Figure(f"{name}: step time, ours / FSDP2", f"{_num(min(ratios))}-{_num(max(ratios))} at W = "
                          f"{', '.join(map(str, sizes))} ({len(ratios)} model x W pairs)",
                          "`python -m harness bench --only speed`", where))
    for part in ("memory", "medium"):
        rows = sorted(bench.get(part) or [], key=lambda r: r["world_size"])
        rows = [r for r in rows if r.get("ideal_bytes")]
        if rows:
            ours = " / ".join(_num(r["ours"]["peak_bytes"] / r["ideal_bytes"]) for r in rows)
            out.append(Figure(f"{name}: live-tensor peak / ideal, {rows[0]['config']}", f"{ours} at W = "
                              f"{' / '.join(str(r['world_size']) for r in rows)}",
                              f"`python -m harness bench --only {part}`", where))
    throughput = bench.get("throughput")
    if throughput:
        out.append(Figure(f"{name}: standard matrix wall / bare-launch floor",
                          f"{_num(throughput['batched_s'] / throughput['bare_launch_floor_s'])} "
                          f"({throughput['batched_s']:.1f} s / {throughput['bare_launch_floor_s']:.1f} s); "
                          f"fuzz {throughput['fuzz_examples_per_s']} examples/s at W = {throughput['fuzz_world_size']}",
                          "`python -m harness bench --only throughput`", where))
    return out


def figures(reports: Path) -> list[Figure]:
    """Every figure of `reports`, ordered by name."""
    reports = Path(reports)
    found: list[Figure] = []
    for path in sorted(reports.rglob("summary.json")):
        rel = path.parent.relative_to(reports).as_posix()
        found.append(from_summary(path, f"reports/{rel}" if rel != "." else "reports (the standard matrix)"))
    for path in sorted(reports.rglob("bench.json")):
        found += from_bench(path, f"reports/{path.parent.relative_to(reports).as_posix()}")
    return sorted(found, key=lambda f: f.name)


def table(found: list[Figure]) -> str:
    lines = ["| figure | value | command | measured on |", "| --- | --- | --- | --- |"]
    lines += [f"| {f.name} | {f.value} | {f.command} | {f.measured_on} |" for f in found]
    return "\n".join(lines)


def with_table(doc: str, found: list[Figure]) -> str:
    """`doc` with the table between its markers replaced (ValueError when it has none)."""
    begin, end = doc.find(FIGURES_BEGIN), doc.find(FIGURES_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no generated-figures block ({FIGURES_BEGIN!r} ... {FIGURES_END!r})")
    return doc[:begin] + FIGURES_BEGIN + "\n" + table(found) + "\n" + doc[end:]
