"""`python -m harness bisect --good REV --bad REV [gate flags]`: the first commit whose gate fails
(each commit tested by its own code: this verb imports nothing of the project)."""

from __future__ import annotations

from harness.verbs.common import out_dir

NAME = "bisect"
IMPORTS_PROJECT = False
TAKES_EXTRA = True  # every other flag goes on to each commit's gate


def add_parser(verbs) -> None:
    bisect = verbs.add_parser(
        "bisect", allow_abbrev=False,
        help="find the first commit whose gate fails: bisect --good REV --bad REV [gate flags]",
        description="Every other flag is passed to each commit's own `python -m harness gate`.")
    bisect.add_argument("--good", required=True, help="a revision whose gate passes")
    bisect.add_argument("--bad", required=True, help="a later revision whose gate fails")
    bisect.add_argument("--repo", default=".", help="the git repository (default: the current directory's)")
    bisect.add_argument("--out", default="runs/bisect", help="per-commit gate reports (default runs/bisect)")


def run(args, extra: list[str], argv: list[str]) -> bool:
    from harness.ci.bisect import bisect

    return bisect(args.repo, args.good, args.bad, extra, out_dir(args.out)) == 0
