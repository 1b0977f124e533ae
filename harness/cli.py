"""`python -m harness VERB` (console script: fsdp-harness). The only place that maps outcomes to
exit codes (`main`, `_exit_code`):
    0    every cell equivalent;
    1    a cell not equivalent, or a rank crashed, hung or was lost;
    2    a mistake in the user's input (flags, files, adapters, baselines, the output directory,
         disk space, permissions): one line naming the input and the fix, before any rank starts
         where it can be known then;
    125  could not test at all (the project does not import; the `git bisect run` convention);
    128 + N  stopped by signal N (SIGINT, SIGTERM, SIGHUP) after killing every process of the run.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shlex
import signal
import sys
import threading
import traceback
from pathlib import Path

from harness.errors import PoolLost, UserError

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_CANNOT_TEST = 0, 1, 2, 125
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# OSErrors caused by where the user asked us to write, not by the harness.
USER_OS_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


class UsageError(UserError):
    pass


class CannotTest(Exception):
    """The project itself does not import: nothing can be tested (exit 125)."""


class Stopped(BaseException):
    """A stop signal, raised in the main thread (like KeyboardInterrupt) so that every `finally`
    on the way out runs: the launch kills its processes, bisect removes its worktree
    ([Note: No survivors] in harness/run/lifeline.py)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_stop_signal(signum, frame) -> None:
    # The first signal unwinds through the clean-ups; a second one must not cut them short.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise UsageError(f"{self.prog}: {message}")


def _add_matrix_args(p: argparse.ArgumentParser, *, cases, impls, world_sizes, data, out) -> None:
    p.add_argument("--cases", default=cases, help=f"comma-separated case names (default {cases})")
    p.add_argument("--impls", default=impls,
                   help=f"comma-separated: ours, fsdp2, ddp, single, or module:Class / file.py:Class (default {impls})")
    p.add_argument("--world-sizes", default=world_sizes, help=f"comma-separated (default {world_sizes})")
    p.add_argument("--data", default=data, help="identical,split (default: each case's own data_modes)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the case's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per world size (one torchrun runs them all, default 600)")
    p.add_argument("--out", default=out, help=f"output directory (default {out})")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads in every rank (default 1)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"), help="process-group backend (default gloo)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one rank per GPU (default cpu)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--keep-evidence", action="store_true",
                   help="keep every cell's snapshots (default: only those of cells that did not pass, and their "
                        "references; a passing cell leaves its report rows, not a copy of the model)")
    p.add_argument("--judge-on", default="auto", choices=("auto", "ranks", "parent"),
                   help="where each cell is judged: ranks (its own rank 0, as the evidence is taken: the parent gets "
                        "results, never a copy of the model), parent (from snapshots), auto (ranks for models of "
                        "2^20 parameters or more, unless --keep-evidence asks for the snapshots; default)")
    p.add_argument("--faults", default="", help=argparse.SUPPRESS)  # planted impl/ bugs, for tests
    # for tests: besides every cell, one copy of it per listed fault (a battery of planted bugs, one launch)
    p.add_argument("--fault-copies", default="", help=argparse.SUPPRESS)
    p.add_argument("--launch-per-cell", action="store_true", help=argparse.SUPPRESS)  # to measure batching


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="harness", description="Is this FSDP numerically the same training run as the unsharded model?")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    run = verbs.add_parser("run", help="run a matrix and write reports (default: the standard matrix into runs/run; "
                                       "--out reports regenerates the committed report)")
    _add_matrix_args(run, cases="mlp,transformer", impls="ours,fsdp2", world_sizes="1,2,4,8",
                     data=None, out="runs/run")
    gate = verbs.add_parser("gate", help="the CI configuration: JUnit XML + Markdown summary")
    _add_matrix_args(gate, cases="mlp,transformer", impls="ours", world_sizes="1,2,4",
                     data=None, out="runs/gate")
    gate.add_argument("--full", action="store_true", help="world sizes 1,2,4,8")
    gate.add_argument("--baseline", default=None, metavar="FILE",
                      help="also fail when the single-process reference drifts from this golden baseline "
                           "(from `baseline record`; one from another torch/backend/device/threads is refused, exit 2)")
    baseline = verbs.add_parser("baseline", help="golden baselines of the single-process reference (see gate --baseline)")
    baseline_verbs = baseline.add_subparsers(dest="baseline_verb", required=True, parser_class=_Parser)
    record = baseline_verbs.add_parser("record", help="run the reference (impl=single, W = 1) and store its digests")
    record.add_argument("--out", required=True, metavar="FILE", help="the baseline JSON file to write")
    record.add_argument("--cases", default="mlp,transformer", help="comma-separated case names (default mlp,transformer)")
    record.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the case's)")
    record.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1; part of the baseline's key)")
    record.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                        help="process-group backend (default gloo; part of the baseline's key)")
    record.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="device of the reference run (default cpu; part of the baseline's key with the GPU name)")
    record.add_argument("--timeout", type=float, default=600.0, help="seconds for the launch (default 600)")
    record.add_argument("--work-dir", default="runs/baseline", help="snapshots and logs (default runs/baseline)")
    record.add_argument("--quiet", action="store_true", help="no progress display")
    bisect = verbs.add_parser(
        "bisect", allow_abbrev=False,
        help="find the first commit whose gate fails: bisect --good REV --bad REV [gate flags]",
        description="Every other flag is passed to each commit's own `python -m harness gate`.")
    bisect.add_argument("--good", required=True, help="a revision whose gate passes")
    bisect.add_argument("--bad", required=True, help="a later revision whose gate fails")
    bisect.add_argument("--repo", default=".", help="the git repository (default: the current directory's)")
    bisect.add_argument("--out", default="runs/bisect", help="per-commit gate reports (default runs/bisect)")
    verbs.add_parser("list", help="cases, implementations and planted faults")
    bench = verbs.add_parser("bench", help="step time and comm bytes vs torch FSDP2, memory at W = 1..8, harness throughput")
    bench.add_argument("--out", default="runs/bench",
                       help="writes bench.json and bench.md here (default runs/bench; --out reports/bench "
                            "regenerates the committed figures)")
    bench.add_argument("--iters", type=int, default=10, help="timed steps per implementation and world size (default 10)")
    bench.add_argument("--speed-world-sizes", default="2,4", help="world sizes of the step-time comparison (default 2,4)")
    bench.add_argument("--memory-world-sizes", default="1,2,4,8", help="world sizes of the memory table (default 1,2,4,8)")
    bench.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    bench.add_argument("--no-throughput", action="store_true", help="skip the harness-throughput measurement")
    bench.add_argument("--only", default=None,
                       help="comma-separated parts to measure: speed, memory, medium, throughput (default: all)")
    bench.add_argument("--smoke", action="store_true", help="a tiny model, one step: checks that bench runs")
    bench.add_argument("--verify-sizes", default="d128,d256,d384",
                       help="the verify-cost part's GPT-2 sizes (tests/data/gpt2_sizes.py: d128, d256, d384, small; "
                            "default d128,d256,d384)")
    bench.add_argument("--verify-world-sizes", default="2",
                       help="the verify-cost part's world sizes, each size at each (default 2)")
    _add_search_verbs(verbs)
    return parser


def _out_dir(value: str, flag: str = "--out") -> Path:
    """An output path from the command line; '' is refused (Path('') would be the current directory)."""
    if value.strip() == "":
        raise UsageError(f"{flag} is empty; name a directory (for example {flag} runs/mine)")
    return Path(value)


def _plan_from_args(args):
    from harness.run.plan import build_plan, parse_csv, parse_world_sizes

    world_sizes = "1,2,4,8" if getattr(args, "full", False) else args.world_sizes
    return build_plan(
        cases=parse_csv(args.cases, "cases"),
        impls=parse_csv(args.impls, "impls"),
        world_sizes=parse_world_sizes(world_sizes),
        data_modes=parse_csv(args.data, "data") if args.data is not None else None,
        steps=args.steps,
        timeout_s=args.timeout,
        out_dir=args.out,
        faults=parse_csv(args.faults, "faults") if args.faults else (),
        fault_copies=parse_csv(args.fault_copies, "fault-copies") if getattr(args, "fault_copies", "") else (),
        backend=args.backend,
        device=args.device,
        threads=args.threads,
        launch_per_cell=args.launch_per_cell,
        judge_on=_judge_on(args),
    )


def _judge_on(args) -> str:
    """--judge-on, where `auto` with --keep-evidence or --baseline means the parent: the evidence
    asked for is the snapshots, which a cell judged on its ranks does not write."""
    judge_on = getattr(args, "judge_on", "auto")
    # A baseline is recorded from, and checked against, the reference cells' snapshots.
    wants_snapshots = getattr(args, "keep_evidence", False) or getattr(args, "baseline", None)
    return "parent" if judge_on == "auto" and wants_snapshots else judge_on


RUN_GENERATED = ("snapshots", "logs", "init")  # what a run writes besides its report set (plan.py dirs)


def cmd_run(args, argv: list[str]) -> int:
    from harness.run.orchestrate import Progress, run_plan
    from harness.run.output import OutputDir
    from harness.report.build import build_report, console_summary, report_files
    import importlib
    import threading

    import torch

    from harness.judge.result import Verdict
    from harness.judge.verdict import Judge, evaluate

    plan = _plan_from_args(args)
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
    return EXIT_PASS if report.verdict == Verdict.PASS else EXIT_FAIL


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


def cmd_list() -> int:
    from cases.catalog import CASES
    from harness.adapters.registry import BUILTIN_IMPLS

    print("cases:")
    for case in CASES.values():
        print(f"  {case.name}: {case.description}; optimizers {[o.kind for o in case.optimizers]}, "
              f"steps={case.steps}, global_batch={case.global_batch}, world sizes {list(case.world_sizes)}, "
              f"data {list(case.data_modes)}")
    print("impls: " + ", ".join(BUILTIN_IMPLS) + " (or module:Class / file.py:Class)")
    from harness.faults import of_layer

    for layer, title in (("impl", "faults (run --faults NAME, planted in impl=ours)"),
                         ("collective", "collective faults (run --faults NAME, in what torch.distributed delivers: any "
                                        "implementation, W > 1)"),
                         ("loop", "training-loop faults (run --faults NAME, in the loop the harness drives: any "
                                  "implementation, any W)")):
        print(title + ":")
        for fault in of_layer(layer).values():
            print(f"  {fault.name}: {fault.plants}")
    return EXIT_PASS


def cmd_baseline_record(args) -> int:
    from harness.ci.baseline import BaselineNotRecorded, baseline_from_snapshots, check_record_target, reference_plan, write_baseline
    from harness.run.orchestrate import Progress, run_plan
    from harness.run.output import OutputDir
    from harness.run.plan import build_plan, parse_csv

    plan = reference_plan(build_plan(cases=parse_csv(args.cases, "cases"), impls=("single",), world_sizes=(1,),
                                     data_modes=("identical",), steps=args.steps, timeout_s=args.timeout,
                                     out_dir=_out_dir(args.work_dir, "--work-dir"), threads=args.threads,
                                     backend=args.backend, device=args.device, judge_on="parent"))
    check_record_target(Path(args.out))  # an unwritable --out is refused before the reference runs
    with OutputDir(plan.out_dir, plan.run_id, RUN_GENERATED, flag="--work-dir"):
        outcome = run_plan(plan, None if args.quiet else Progress(plan))
        if outcome.errors:
            for cell_id, error in outcome.errors.items():
                print(f"ERROR {cell_id}:\n{error}")
            print("baseline record: the reference run failed; nothing written", file=sys.stderr)
            return EXIT_FAIL
        try:
            baseline = baseline_from_snapshots(plan)
        except BaselineNotRecorded as e:
            print(f"baseline record: {e}; nothing written", file=sys.stderr)
            return EXIT_FAIL
    write_baseline(Path(args.out), baseline)
    print(f"baseline: {args.out} (cases {sorted(baseline['cases'])}, key {baseline['key']})")
    return EXIT_PASS


def _add_search_verbs(verbs) -> None:
    fuzz = verbs.add_parser("fuzz", help="hypothesis-drawn models through a persistent pool of W ranks")
    fuzz.add_argument("--impls", default="ours", help="implementations fuzzed one after the other, each a built-in "
                      "name or a user's 'module:Class' / 'file.py:Class' (default ours)")
    fuzz.add_argument("--world-size", type=int, default=4, help="ranks in the pool (default 4)")
    fuzz.add_argument("--max-examples", type=int, default=40, help="examples hypothesis generates (default 40)")
    fuzz.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    fuzz.add_argument("--replay", default=None, help="run one spec (the JSON a failure prints) instead of fuzzing")
    fuzz.add_argument("--out", default="runs/fuzz", help="pool logs (default runs/fuzz)")
    fuzz.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    fuzz.add_argument("--pools", default="auto",
                      help="pools of W ranks training examples side by side (default auto: one per --threads cores, "
                           "up to 4, from 8 examples on; one below)")
    fuzz.add_argument("--example-timeout", type=float, default=60.0,
                      help="seconds per example before the pool is restarted (default 60)")
    fuzz.add_argument("--faults", default="", help=argparse.SUPPRESS)  # planted bugs: the fuzzer must fail
    mutants = verbs.add_parser("mutants", help="every planted fault caught (collective faults on any --impls, impl/'s "
                                               "on ours); honest runs within half the tolerance")
    mutants.add_argument("--impls", default="ours",
                         help="comma-separated implementations, each a built-in name or a user's 'module:Class' / "
                              "'file.py:Class' (default ours); the collective faults (dist_*) apply to each, the "
                              "faults planted inside impl/ to ours only")
    mutants.add_argument("--out", default="runs/mutants", help="output directory (default runs/mutants)")
    mutants.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun launch (default 900)")
    mutants.add_argument("--only", default="", help="comma-separated faults (default: every collective fault and "
                                                         "every impl fault of harness/faults.py)")
    mutants.add_argument("--world-sizes", default="", help=argparse.SUPPRESS)  # one W for a quick test
    mutants.add_argument("--cases", default=None,
                         help="real architectures every fault also runs on, with a table per case (default "
                              "gpt2,llama,moe: the models extra; 'none' for only the gate cases)")


def _import_project(args) -> None:
    try:
        import torch  # noqa: F401

        import cases.catalog  # noqa: F401
        import harness.run.orchestrate  # noqa: F401
        if args.verb in ("fuzz", "mutants") or "ours" in getattr(args, "impls", "").split(","):
            from harness.adapters.ours import planted_faults

            planted_faults()  # imports impl/
    except Exception as e:
        traceback.print_exc()
        raise CannotTest(f"{type(e).__name__}: {e}") from None


def _pools(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--pools={text!r} must be 'auto' or a whole number >= 1") from None


def cmd_fuzz_or_mutants(args) -> int:
    from harness.run.plan import parse_csv, parse_world_sizes

    if args.verb == "fuzz":
        from harness.fuzz.main import main as fuzz_main

        impls = parse_csv(args.impls, "impls")
        ok = True
        for impl in impls:  # every implementation gets its own pool (and its own logs with several)
            out_dir = _out_dir(args.out) if len(impls) == 1 else _out_dir(args.out) / re.sub(r"\W+", "_", impl)
            ok = fuzz_main(args.world_size, args.max_examples, args.seed,
                           parse_csv(args.faults, "faults") if args.faults else (), args.replay,
                           out_dir, args.threads, args.example_timeout, impl=impl, pools=_pools(args.pools)) and ok
    else:
        from harness.ci.mutants import main as mutants_main

        ok = mutants_main(_out_dir(args.out), args.timeout, parse_csv(args.only, "only") if args.only else None,
                          parse_world_sizes(args.world_sizes) if args.world_sizes else None,
                          impls=parse_csv(args.impls, "impls"),
                          **({} if args.cases is None else
                             {"arch_cases": () if args.cases == "none" else parse_csv(args.cases, "cases")}))
    return EXIT_PASS if ok else EXIT_FAIL


def cmd_bench(args) -> int:
    from harness.bench.main import VERIFY_COST_MODULE, BenchConfig, BenchError, run_bench
    from harness.errors import PlanError
    from harness.run.plan import parse_csv, parse_world_sizes

    try:
        from harness.bench.main import PARTS
        parts = PARTS if args.only is None else tuple(p.strip() for p in args.only.split(",") if p.strip())
        if args.no_throughput:
            parts = tuple(p for p in parts if p != "throughput")
        cfg = BenchConfig(_out_dir(args.out), parse_world_sizes(args.speed_world_sizes, "speed-world-sizes"),
                          parse_world_sizes(args.memory_world_sizes, "memory-world-sizes"), args.iters, args.threads,
                          parts=parts, smoke=args.smoke,
                          verify_cases=tuple(f"{VERIFY_COST_MODULE}:{size}" for size in parse_csv(args.verify_sizes,
                                                                                                   "verify-sizes")),
                          verify_world_sizes=parse_world_sizes(args.verify_world_sizes, "verify-world-sizes"))
    except (ValueError, PlanError) as e:
        print(f"harness bench: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        run_bench(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except BenchError as e:
        print(f"harness bench: {e}", file=sys.stderr)
        return EXIT_FAIL
    print((cfg.out_dir / "bench.md").read_text())
    return EXIT_PASS


def _dispatch(argv: list[str]) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra and args.verb != "bisect":  # bisect passes every other flag on to each commit's gate
        raise UsageError(f"harness {args.verb}: unrecognized arguments: {' '.join(extra)}")
    if args.verb == "list":
        return cmd_list()
    if args.verb == "bench":
        return cmd_bench(args)
    if args.verb == "bisect":  # imports nothing of the project: each commit is tested by its own code
        from harness.ci.bisect import bisect

        return bisect(args.repo, args.good, args.bad, extra, _out_dir(args.out))
    _import_project(args)
    if args.verb in ("fuzz", "mutants"):
        return cmd_fuzz_or_mutants(args)
    if args.verb == "baseline":
        return cmd_baseline_record(args)
    return cmd_run(args, argv)


def _exit_code(verb: str, e: BaseException) -> int:
    """The one mapping from an exception that ended a verb to its exit code and one line."""
    if isinstance(e, UsageError):
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, UserError):
        print(f"harness {verb}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, OSError) and e.errno in USER_OS_ERRNOS:
        where = f" {e.filename}" if e.filename else ""
        print(f"harness {verb}: error: cannot write{where}: {e.strerror}; free space or choose a writable --out",
              file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, CannotTest):
        print(f"harness: cannot test: {e}", file=sys.stderr)
        return EXIT_CANNOT_TEST
    if isinstance(e, PoolLost):
        print(f"harness {verb}: {e}", file=sys.stderr)
        return EXIT_FAIL
    if isinstance(e, (Stopped, KeyboardInterrupt)):
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        cleaned = " and removed its temporary worktree" if verb == "bisect" else ""
        print(f"harness {verb}: interrupted by {signal.Signals(signum).name}; stopped every process it "
              f"started{cleaned}", file=sys.stderr)
        return 128 + signum
    raise e


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = next((a for a in argv if not a.startswith("-")), "harness")
    in_main_thread = threading.current_thread() is threading.main_thread()  # where handlers can be set
    handlers = {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS} if in_main_thread else {}
    try:
        return _dispatch(argv)
    except (Exception, KeyboardInterrupt, Stopped, PoolLost) as e:
        return _exit_code(verb, e)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
