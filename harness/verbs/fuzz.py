"""`python -m harness fuzz`: hypothesis-drawn models through a persistent pool of W ranks, each
judged as a cell is."""

from __future__ import annotations

import argparse
import re

from harness.verbs.common import out_dir, pools

NAME = "fuzz"
IMPORTS_PROJECT = True
TAKES_EXTRA = False


def add_parser(verbs) -> None:
    fuzz = verbs.add_parser("fuzz", help="hypothesis-drawn models through a persistent pool of W ranks")
    fuzz.add_argument("--impls", default="ours", help="implementations fuzzed one after the other, each a built-in "
                      "name or a user's 'module:Class' / 'file.py:Class' (default ours)")
    fuzz.add_argument("--world-size", type=int, default=4, help="ranks in the pool (default 4); with --backend "
                      "simulated, the largest W an example draws (up to 1024)")
    fuzz.add_argument("--backend", choices=("gloo", "simulated"), default="gloo",
                      help="gloo: a pool of W rank processes (default); simulated: each example on W threads of "
                           "this process, W drawn per example and shrunk with the model (impl=ours)")
    fuzz.add_argument("--max-examples", type=int, default=40, help="examples hypothesis generates (default 40)")
    fuzz.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    fuzz.add_argument("--replay", default=None, help="run one spec (the JSON a failure prints) instead of fuzzing")
    fuzz.add_argument("--out", default="runs/fuzz", help="pool logs (default runs/fuzz)")
    fuzz.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    fuzz.add_argument("--pools", default="auto",
                      help="pools of W ranks training examples side by side (default auto: one per --threads cores, "
                           "up to 4, from 8 examples on; one below)")
    fuzz.add_argument("--example-timeout", type=float, default=None,
                      help="seconds per example before the pool is restarted (default 60; with --backend "
                           "simulated 0.3 s per rank of --world-size where that is longer)")
    fuzz.add_argument("--faults", default="", help=argparse.SUPPRESS)  # planted bugs: the fuzzer must fail


def run(args, extra: list[str], argv: list[str]) -> bool:
    from harness.fuzz.main import main as fuzz_main
    from harness.run.plan import parse_csv

    impls = parse_csv(args.impls, "impls")
    ok = True
    for impl in impls:  # every implementation gets its own pool (and its own logs with several)
        where = out_dir(args.out) if len(impls) == 1 else out_dir(args.out) / re.sub(r"\W+", "_", impl)
        ok = fuzz_main(args.world_size, args.max_examples, args.seed,
                       parse_csv(args.faults, "faults") if args.faults else (), args.replay,
                       where, args.threads, args.example_timeout, impl=impl, pools=pools(args.pools),
                       backend=args.backend) and ok
    return ok
