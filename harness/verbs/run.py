"""`python -m harness run`: a matrix of cells, judged, with its reports (the standard matrix into
runs/run by default)."""

from __future__ import annotations

import os
import shlex

from harness.verbs.common import RUN_GENERATED, add_matrix_args, plan_from_args

NAME = "run"
IMPORTS_PROJECT = True
TAKES_EXTRA = False


def add_parser(verbs) -> None:
    p = verbs.add_parser("run", help="run a matrix and write reports (default: the standard matrix into runs/run; "
                                     "--out reports regenerates the committed report)")
    add_matrix_args(p, cases="mlp,transformer", impls="ours,fsdp2", world_sizes="1,2,4,8", data=None, out="runs/run")


def run(args, extra: list[str], argv: list[str]) -> bool:
    return matrix(args, argv)


def matrix(args, argv: list[str]) -> bool:
    """Run the plan of the flags, judge it, write its reports: whether it passed (run and gate)."""
    from harness.run.orchestrate import Progress, run_plan
    from harness.run.output import OutputDir
    from harness.report.build import build_report, console_summary, report_files
    import importlib
    import threading

    import torch

    from harness.judge.result import Verdict
    from harness.judge.verdict import Judge, evaluate

    plan = plan_from_args(args)
    for note in plan.notes:
        print(f"note: {note}")
    baseline = None
    if getattr(args, "baseline", None):
        from harness.ci.baseline import load_baseline

        baseline = load_baseline(args.baseline, plan)  # refused before any rank starts
    with OutputDir(plan.out_dir, plan.run_id, RUN_GENERATED) as output:  # owned and locked, or exit 2
        progress = None if args.quiet else Progress(plan)
        # The parent's judging is many small tensor ops, next to the ranks on the same cores: one
        # intra-op thread is faster there (measured 3x per op on 2 loaded cores), and a judge's
        # float64 sums then do not depend on the machine's core count.
        torch.set_num_threads(1)
        # The report's plotting imports (seconds) load while the ranks train, not after them.
        threading.Thread(target=importlib.import_module, args=("harness.report.html",), daemon=True).start()
        judge = Judge(plan)
        outcome = run_plan(plan, progress, on_cell_complete=judge.judge_early)
        cells, references, matrices = evaluate(plan, outcome, None if progress is None else progress.judged, judge)
        command = "python -m harness " + " ".join(shlex.quote(a) for a in argv)
        report = build_report(cells, references, matrices, outcome, command)
        baseline_results = []
        if baseline is not None:
            from harness.ci.baseline import check_baseline
            from harness.ci.gate import apply_baseline

            baseline_results = check_baseline(plan, baseline, args.baseline)
            report = apply_baseline(report, baseline_results)
        files = report_files(report)
        if args.verb == "gate":
            from harness.ci.gate import add_gate_files

            files = add_gate_files(files, report, baseline_results)
        written = output.write_report_set(files)
        if not args.keep_evidence:
            _prune_passing_evidence(plan, cells)
    console_summary(report)
    if args.verb == "gate":
        from harness.ci.gate import print_baseline

        print_baseline(baseline_results)
        step_summary = os.environ.get("GITHUB_STEP_SUMMARY")  # GitHub Actions renders it on the run page
        if step_summary:
            with open(step_summary, "a") as f:
                f.write(files["summary.md"] + "\n")
    print(f"reports: {written['report.md']}")
    return report.verdict == Verdict.PASS


def _prune_passing_evidence(plan, cells) -> None:
    """Remove the snapshots of every cell that passed, and of every reference no other cell needs
    now, once the report is written: the evidence kept is where a person needs it, around a failure
    or an error (--keep-evidence keeps all)."""
    import shutil

    from harness.judge.result import Verdict

    needed = {f"ref.{r.cell.case_label}" for r in cells if r.verdict != Verdict.PASS}
    passed = [r.cell.cell_id for r in cells if r.verdict == Verdict.PASS]
    refs = [c.cell_id for c in plan.references if c.cell_id not in needed]
    for cell_id in passed + refs:
        shutil.rmtree(plan.snapshot_dir / cell_id, ignore_errors=True)
    scratch = plan.snapshot_dir / "scratch"
    if scratch.is_dir() and not any(scratch.iterdir()):
        scratch.rmdir()
