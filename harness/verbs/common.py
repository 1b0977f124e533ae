"""What the verbs share: the parser class (one line, exit 2, for a refused flag), the matrix flags of
run and gate, the output directory, the plan from the flags, the import check of the project."""

from __future__ import annotations

import argparse
import traceback
from pathlib import Path

from harness.errors import CannotTest, UsageError, UserError

RUN_GENERATED = ("snapshots", "logs", "init", "nodes")  # what a run writes besides its report set (plan.py dirs)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise UsageError(f"{self.prog}: {message}")


def add_matrix_args(p: argparse.ArgumentParser, *, cases, impls, world_sizes, data, out) -> None:
    p.add_argument("--cases", default=cases, help=f"comma-separated case names (default {cases})")
    p.add_argument("--impls", default=impls,
                   help=f"comma-separated: ours, fsdp2, ddp, single, or module:Class / file.py:Class (default {impls})")
    p.add_argument("--world-sizes", default=world_sizes, help=f"comma-separated (default {world_sizes})")
    p.add_argument("--data", default=data, help="identical,split (default: each case's own data_modes)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the case's)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per world size (one torchrun runs them all; default 600 plus 5 us per parameter, "
                        "step and cell of that world size: minutes more for real models)")
    p.add_argument("--out", default=out, help=f"output directory (default {out})")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads in every rank (default 1)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "simulated"),
                   help="process-group backend (default gloo); simulated: the ranks as threads of one process, "
                        "up to 1024 of them (impl=ours)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one rank per GPU (default cpu)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--keep-evidence", action="store_true",
                   help="keep every cell's snapshots (default: only those of cells that did not pass, and their "
                        "references; a passing cell leaves its report rows, not a copy of the model)")
    p.add_argument("--judge-on", default="auto", choices=("auto", "ranks", "parent"),
                   help="where each cell is judged: ranks (its own rank 0, as the evidence is taken: the parent gets "
                        "results, never a copy of the model), parent (from snapshots), auto (ranks for models of "
                        "2^20 parameters or more, unless --keep-evidence asks for the snapshots; default)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes the launch spans, each running this same command with its own --node-rank "
                        "(docs/multinode.md; default 1)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's index: 0 runs the plan, judges and writes the reports; the others run "
                        "their ranks and exit with node 0's verdict (default 0)")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of torchrun's c10d rendezvous (with --nnodes > 1)")
    p.add_argument("--rdzv-id", default="harness", help="the rendezvous id every node of the run gives (default harness)")
    p.add_argument("--faults", default="", help=argparse.SUPPRESS)  # planted impl/ bugs, for tests
    # for tests: besides every cell, one copy of it per listed fault (a battery of planted bugs, one launch)
    p.add_argument("--fault-copies", default="", help=argparse.SUPPRESS)
    p.add_argument("--launch-per-cell", action="store_true", help=argparse.SUPPRESS)  # to measure batching


def out_dir(value: str, flag: str = "--out") -> Path:
    """An output path from the command line; '' is refused (Path('') would be the current directory)."""
    if value.strip() == "":
        raise UsageError(f"{flag} is empty; name a directory (for example {flag} runs/mine)")
    return Path(value)


def request_from_args(args):
    """The run the matrix flags ask for (harness/run/plan.py RunRequest), parsed once."""
    from harness.run.plan import Nodes, RunRequest, parse_csv, parse_world_sizes

    world_sizes = "1,2,4,8" if getattr(args, "full", False) else args.world_sizes
    return RunRequest(
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
        judge_on=judge_on(args),
        nodes=Nodes(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id),
    )


def plan_from_args(args):
    from harness.run.plan import build_plan

    return build_plan(request_from_args(args))


def judge_on(args) -> str:
    """--judge-on, where `auto` with --keep-evidence or --baseline means the parent: the evidence
    asked for is the snapshots, which a cell judged on its ranks does not write."""
    judge_on = getattr(args, "judge_on", "auto")
    # A baseline is recorded from, and checked against, the reference cells' snapshots.
    wants_snapshots = getattr(args, "keep_evidence", False) or getattr(args, "baseline", None)
    return "parent" if judge_on == "auto" and wants_snapshots else judge_on


def import_project(args) -> None:
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


def pools(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--pools={text!r} must be 'auto' or a whole number >= 1") from None
