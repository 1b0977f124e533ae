"""Per parameter tensor, the largest trajectory ratio of a run's cells against the first two
perturbed runs of its reference and against all of them (docs/error_model.md, "How many perturbed
runs"): what a two-run envelope would have judged, beside what the run judged.

    python -m harness run --cases mlp --steps 40 --judge-on parent --keep-evidence --out DIR
    python tests/trajectory_ratios.py DIR

The ratio is the check's own: max |p_cell - p_ref| / (TRAJECTORY_FACTOR * (envelope + 2u max|p_ref|)),
per step and tensor, u the unit roundoff of the parameter's dtype."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.reference.tolerance import TRAJECTORY_FACTOR, unit_roundoff  # noqa: E402
from harness.run.snapshot import load_snapshot  # noqa: E402


def ratios(run_dir: Path) -> dict[str, dict]:
    """tensor -> {"two": (ratio, cell, step), "all": (ratio, cell, step), "runs": count, "judged": n}."""
    out: dict[str, dict] = {}
    snapshots = run_dir / "snapshots"
    for ref_path in sorted(snapshots.glob("ref.*/*.pt")):
        ref = load_snapshot(ref_path)
        runs = ref["perturbed"]
        for cell_path in sorted(snapshots.glob(f"*/{ref_path.name}")):
            if cell_path.parent.name.startswith("ref."):
                continue
            cell = load_snapshot(cell_path)
            if cell["cell"]["case"] != ref["cell"]["case"]:
                continue
            for i, (rec, ref_rec) in enumerate(zip(cell["steps"], ref["steps"])):
                for name, p in rec["params"].items():
                    p_ref = ref_rec["params"][name].double()
                    deviation = (p.double() - p_ref).abs().max().item()
                    floor = 2 * unit_roundoff(ref_rec["params"][name].dtype) * p_ref.abs().max().item()
                    envelopes = [(run[i][name].double() - p_ref).abs().max().item() for run in runs]
                    row = out.setdefault(name, {"two": (0.0, "", 0), "all": (0.0, "", 0), "runs": len(runs),
                                                "judged": 0})
                    row["judged"] += 1
                    where = f"{cell_path.parent.name}/{ref_path.stem}"
                    for key, envelope in (("two", max(envelopes[:2])), ("all", max(envelopes))):
                        ratio = deviation / (TRAJECTORY_FACTOR * (envelope + floor))
                        if ratio > row[key][0]:
                            row[key] = (ratio, where, i + 1)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (Path(argv[0]) / "snapshots").is_dir():
        print("usage: python tests/trajectory_ratios.py RUN_DIR (a run made with --judge-on parent "
              "--keep-evidence)", file=sys.stderr)
        return 2
    rows = ratios(Path(argv[0]))
    if not rows:
        print("no reference snapshot with its cells under RUN_DIR/snapshots", file=sys.stderr)
        return 2
    print("| tensor | steps judged | largest ratio, first two runs (cell, step) | largest ratio, every run |")
    print("| --- | --- | --- | --- |")
    for name, row in rows.items():
        two, every = row["two"], row["all"]
        print(f"| {name} | {row['judged']} | {two[0]:.3f} ({two[1]}, {two[2]}) | {every[0]:.3f} of {row['runs']} "
              f"({every[1]}, {every[2]}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
