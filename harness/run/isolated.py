"""A check of a big model run in a child Python process, so that the harness's own process (the
parent, which judges nothing of a model judged on the ranks) never holds a copy of the model or
its activations: the user case's validation (cases/user.py) and the batch-makeup probe
(harness/run/batch_makeup.py) of a case from JUDGE_ON_RANKS_FROM parameters on. The child is the
same interpreter, in the same working directory and environment, with this harness first on its
path; it prints one JSON value as its last line."""

from __future__ import annotations

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


_VALIDATE = ("import json, sys\n"
             "from cases.catalog import get_case\n"
             "from cases.user import validate_case\n"
             "try:\n"
             "    validate_case(get_case(sys.argv[1]), sys.argv[1])\n"
             "    print(json.dumps(None))\n"
             "except ValueError as e:\n"
             "    print(json.dumps(str(e)))\n")


def validate_case_in_a_child(spec: str) -> None:
    """cases/user.py `validate_case` of the case `spec`, run in a child: the same ValueError (its
    message) for a mistake; a ValueError saying so where the child could not validate."""
    try:
        mistake = run_child(_VALIDATE, spec)
    except ChildFailed as e:
        raise ValueError(f"case {spec!r}: its validation did not run ({e})") from None
    if mistake is not None:
        raise ValueError(mistake)
