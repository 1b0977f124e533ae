"""A check of a big model run in a child Python process, so that the harness's own process (the
parent, which judges nothing of a model judged on the ranks) never holds a copy of the model or
its activations: the user case's validation (cases/user.py) and the batch-makeup probe
(harness/run/batch_makeup.py) of a case from JUDGE_ON_RANKS_FROM parameters on. The child is the
same interpreter, in the same working directory and environment, with this harness first on its
path; it prints one JSON value as its last line."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

# A child runs one float64 or float32 forward (and backward) of the model on one batch.
CHILD_TIMEOUT_S = 600


class ChildFailed(Exception):
    """The child did not produce its value: why, in one line."""


def run_child(code: str, *args: str) -> object:
    """The JSON value the child `python -c code args...` prints last; ChildFailed otherwise."""
    root = str(Path(__file__).resolve().parents[2])  # where this harness is imported from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise ChildFailed(f"its child process ran past {CHILD_TIMEOUT_S} s") from None
    except OSError as e:
        raise ChildFailed(f"its child process did not start: {e}") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ChildFailed(f"its child process exited {proc.returncode}: {last}")
    return json.loads(lines[-1])


_CHECKS = ("import json, sys\n"
           "from cases.catalog import get_case\n"
           "from cases.user import validate_case\n"
           "from harness.run.batch_makeup import relative_difference\n"
           "spec, validate, splits = sys.argv[1], sys.argv[2] == '1', json.loads(sys.argv[3])\n"
           "mistake = None\n"
           "if validate:\n"
           "    try:\n"
           "        validate_case(get_case(spec), spec)\n"
           "    except ValueError as e:\n"
           "        mistake = str(e)\n"
           "measured = [] if mistake else [relative_difference(spec, w, m) for w, m in splits]\n"
           "print(json.dumps([mistake, measured]))\n")


@functools.lru_cache(maxsize=None)
def child_checks(spec: str, validate: bool, splits: tuple[tuple[int, int], ...]) -> tuple[str | None, list]:
    """In one child process: cases/user.py `validate_case` of the case `spec` (when `validate`),
    then, if it found no mistake, harness/run/batch_makeup.py `relative_difference` of each
    (world size, micro-batches) of `splits`. Returns (the mistake's message or None, the
    measurements); ChildFailed where the child could not say. Cached: the plan asks twice."""
    mistake, measured = run_child(_CHECKS, spec, "1" if validate else "0", json.dumps([list(s) for s in splits]))
    return mistake, measured


def validate_case_in_a_child(spec: str, splits: tuple[tuple[int, int], ...] = ()) -> None:
    """cases/user.py `validate_case` of the case `spec`, run in a child (with the batch-makeup
    measurements of `splits`, kept for the plan's later check): the same ValueError (its message)
    for a mistake; a ValueError saying so where the child could not validate."""
    try:
        mistake, _ = child_checks(spec, True, splits)
    except ChildFailed as e:
        raise ValueError(f"case {spec!r}: its validation did not run ({e})") from None
    if mistake is not None:
        raise ValueError(mistake)
