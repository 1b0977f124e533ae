"""`python -m harness mutants`: every planted fault caught, the honest runs within half the
tolerance (harness/ci/mutants.py)."""

from __future__ import annotations

import argparse

from harness.verbs.common import out_dir

NAME = "mutants"
IMPORTS_PROJECT = True
TAKES_EXTRA = False


def add_parser(verbs) -> None:
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


def run(args, extra: list[str], argv: list[str]) -> bool:
    from harness.ci.mutants import main as mutants_main
    from harness.run.plan import parse_csv, parse_world_sizes

    return mutants_main(out_dir(args.out), args.timeout, parse_csv(args.only, "only") if args.only else None,
                      parse_world_sizes(args.world_sizes) if args.world_sizes else None,
                      impls=parse_csv(args.impls, "impls"),
                      **({} if args.cases is None else
                         {"arch_cases": () if args.cases == "none" else parse_csv(args.cases, "cases")}))
