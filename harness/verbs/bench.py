"""`python -m harness bench`: step time and communication against torch FSDP2, memory at W = 1..8,
the harness's throughput, the cost of verifying against training."""

from __future__ import annotations

import sys

from harness.errors import UserError, VerbFailed
from harness.verbs.common import out_dir

NAME = "bench"
IMPORTS_PROJECT = False
TAKES_EXTRA = False


def add_parser(verbs) -> None:
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

def run(args, extra: list[str], argv: list[str]) -> bool:
    from harness.bench.main import VERIFY_COST_MODULE, BenchConfig, BenchError, run_bench
    from harness.run.plan import parse_csv, parse_world_sizes

    try:
        from harness.bench.main import PARTS
        parts = PARTS if args.only is None else tuple(p.strip() for p in args.only.split(",") if p.strip())
        if args.no_throughput:
            parts = tuple(p for p in parts if p != "throughput")
        cfg = BenchConfig(out_dir(args.out), parse_world_sizes(args.speed_world_sizes, "speed-world-sizes"),
                          parse_world_sizes(args.memory_world_sizes, "memory-world-sizes"), args.iters, args.threads,
                          parts=parts, smoke=args.smoke,
                          verify_cases=tuple(f"{VERIFY_COST_MODULE}:{size}" for size in parse_csv(args.verify_sizes,
                                                                                                   "verify-sizes")),
                          verify_world_sizes=parse_world_sizes(args.verify_world_sizes, "verify-world-sizes"))
    except ValueError as e:  # a PlanError is a UserError, a ValueError too
        raise UserError(str(e)) from None
    try:
        run_bench(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except BenchError as e:
        raise VerbFailed(str(e)) from None
    print((cfg.out_dir / "bench.md").read_text())
    return True
