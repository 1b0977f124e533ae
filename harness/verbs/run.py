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
    from harness.run.output import OutputDir

    plan = plan_from_args(args)
    if plan.nodes.many and not plan.nodes.leads:
        return _follow(plan)
    for note in plan.notes:
        print(f"note: {note}")
    baseline = None
    if getattr(args, "baseline", None):
        from harness.ci.baseline import load_baseline

        baseline = load_baseline(args.baseline, plan)  # refused before any rank starts
    with OutputDir(plan.out_dir, plan.run_id, RUN_GENERATED) as output:  # owned and locked, or exit 2
        if plan.nodes.many:
            report, files, written, baseline_results = _lead(args, argv, plan, baseline, output)
        else:
            report, files, written, baseline_results = _judged_run(args, argv, plan, baseline, output)
    return _say(args, report, files, written, baseline_results)


def _lead(args, argv: list[str], plan, baseline, output):
    """`_judged_run` as node 0 of a run across nodes ([Note: Across nodes] in harness/run/nodes.py):
    its heartbeat and announcements, and its exit code for the other nodes, whatever ends it."""
    from harness.errors import UserError
    from harness.judge.result import Verdict
    from harness.run.nodes import Heartbeat, announce_leader, announce_verdict

    heartbeat = Heartbeat(plan.out_dir, 0).start()
    announce_leader(plan.out_dir, plan.run_id, plan.nodes.rdzv_id)
    try:
        ran = _judged_run(args, argv, plan, baseline, output)
    except BaseException as e:
        announce_verdict(plan.out_dir, plan.run_id, 2 if isinstance(e, UserError) else 1,
                         f"node 0 ended with {type(e).__name__}: {e}".splitlines()[0])
        raise
    finally:
        heartbeat.stop()
    verdict = ran[0].verdict
    announce_verdict(plan.out_dir, plan.run_id, 0 if verdict == Verdict.PASS else 1,
                     f"verdict: {verdict.value}; reports in {plan.out_dir} (node 0)")
    return ran


def _follow(plan) -> bool:
    """A node other than 0 ([Note: Across nodes] in harness/run/nodes.py): its ranks of every
    launch, then node 0's exit code."""
    from harness.errors import ExitWith
    from harness.run.launch import follower_launch
    from harness.run.nodes import Follower, nodes_dir

    nodes = plan.nodes
    code = Follower(plan.out_dir, nodes.rank, nodes.rdzv_id).run(
        lambda payload, log_dir: follower_launch(payload, log_dir, nodes.rank, nodes_dir(plan.out_dir)),
        wait_s=max(600.0, plan.timeout_s))
    if code in (0, 1):
        return code == 0
    raise ExitWith(code, f"node 0 exited {code}")


def _judged_run(args, argv: list[str], plan, baseline, output):
    """The plan run, judged, its report set written: (report, files, written, baseline results)."""
    from harness.run.orchestrate import Progress, run_plan
    from harness.report.build import build_report, report_files
    import importlib
    import threading

    import torch

    from harness.judge.verdict import Judge, evaluate

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
    return report, files, written, baseline_results


def _say(args, report, files, written, baseline_results) -> bool:
    """The console summary once the output directory is released: whether the run passed."""
    from harness.judge.result import Verdict
    from harness.report.build import console_summary

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
