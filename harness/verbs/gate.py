"""`python -m harness gate`: the CI configuration of a run (JUnit XML, a Markdown summary, a golden
baseline of the reference when given)."""

from __future__ import annotations

from harness.verbs.common import add_matrix_args
from harness.verbs.run import matrix

NAME = "gate"
IMPORTS_PROJECT = True
TAKES_EXTRA = False


def add_parser(verbs) -> None:
    gate = verbs.add_parser("gate", help="the CI configuration: JUnit XML + Markdown summary")
    add_matrix_args(gate, cases="mlp,transformer", impls="ours", world_sizes="1,2,4",
                     data=None, out="runs/gate")
    gate.add_argument("--full", action="store_true", help="world sizes 1,2,4,8")
    gate.add_argument("--baseline", default=None, metavar="FILE",
                      help="also fail when the single-process reference drifts from this golden baseline "
                           "(from `baseline record`; one from another torch/backend/device/threads is refused, exit 2)")


def run(args, extra: list[str], argv: list[str]) -> bool:
    return matrix(args, argv)
