"""The verbs of `python -m harness VERB`, one module each, registered once here: each has its NAME,
`add_parser(verbs)` (its sub-command and flags), `run(args, extra, argv) -> bool` (whether it
passed), IMPORTS_PROJECT (the project must import first: exit 125 where it does not) and
TAKES_EXTRA (flags it passes on, as bisect to each commit's gate). harness/cli.py builds the
parser from them and maps every outcome to an exit code. Adding a verb: its module and its line
here."""

from __future__ import annotations

from harness.verbs import baseline, bench, bisect, figures, fuzz, gate, listing, mutants, run

VERBS = {module.NAME: module for module in (run, gate, baseline, bisect, listing, bench, fuzz, mutants, figures)}
