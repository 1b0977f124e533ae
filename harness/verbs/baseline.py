"""`python -m harness baseline record`: a golden baseline of the single-process reference (the
digests `gate --baseline` checks)."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.verbs.common import RUN_GENERATED, Parser, out_dir

NAME = "baseline"
IMPORTS_PROJECT = True
TAKES_EXTRA = False


def add_parser(verbs) -> None:
    baseline = verbs.add_parser("baseline", help="golden baselines of the single-process reference (see gate --baseline)")
    baseline_verbs = baseline.add_subparsers(dest="baseline_verb", required=True, parser_class=Parser)
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

def run(args, extra: list[str], argv: list[str]) -> bool:
    from harness.ci.baseline import BaselineNotRecorded, baseline_from_snapshots, check_record_target, reference_plan, write_baseline
    from harness.run.orchestrate import Progress, run_plan
    from harness.run.output import OutputDir
    from harness.run.plan import build_plan, parse_csv

    plan = reference_plan(build_plan(cases=parse_csv(args.cases, "cases"), impls=("single",), world_sizes=(1,),
                                     data_modes=("identical",), steps=args.steps, timeout_s=args.timeout,
                                     out_dir=out_dir(args.work_dir, "--work-dir"), threads=args.threads,
                                     backend=args.backend, device=args.device, judge_on="parent"))
    check_record_target(Path(args.out))  # an unwritable --out is refused before the reference runs
    with OutputDir(plan.out_dir, plan.run_id, RUN_GENERATED, flag="--work-dir"):
        outcome = run_plan(plan, None if args.quiet else Progress(plan))
        if outcome.errors:
            for cell_id, error in outcome.errors.items():
                print(f"ERROR {cell_id}:\n{error}")
            print("baseline record: the reference run failed; nothing written", file=sys.stderr)
            return False
        try:
            baseline = baseline_from_snapshots(plan)
        except BaselineNotRecorded as e:
            print(f"baseline record: {e}; nothing written", file=sys.stderr)
            return False
    write_baseline(Path(args.out), baseline)
    print(f"baseline: {args.out} (cases {sorted(baseline['cases'])}, key {baseline['key']})")
    return True
