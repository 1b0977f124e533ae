"""A check of a big model run in a child Python process, so that the harness's own process (the
parent, which judges nothing of a model judged on the ranks) never holds a copy of the model or
its activations: the user case's validation (cases/user.py) and the batch-makeup probe
(harness/run/batch_makeup.py) of a case from JUDGE_ON_RANKS_FROM parameters on. The child is the
same interpreter, in the same working directory and environment, with this harness first on its
path; it prints one JSON value as its last line."""

from __future__ import annotations

import atexit
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


def _child_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])  # where this harness is imported from
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))


def start_child(code: str, *args: str) -> subprocess.Popen:
    """The child `python -c code args...`, started; `child_value` waits for what it prints."""
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_child_env())


def child_value(proc: subprocess.Popen) -> object:
    """The JSON value a started child prints last; ChildFailed otherwise."""
    try:
        stdout, stderr = proc.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise ChildFailed(f"its child process ran past {CHILD_TIMEOUT_S} s") from None
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ChildFailed(f"its child process exited {proc.returncode}: {last}")
    return json.loads(lines[-1])


def run_child(code: str, *args: str) -> object:
    """The JSON value the child `python -c code args...` prints last; ChildFailed otherwise."""
    try:
        proc = start_child(code, *args)
    except OSError as e:
        raise ChildFailed(f"its child process did not start: {e}") from None
    return child_value(proc)


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


# Children started ahead of their question (`start_child_checks`), by their arguments.
_started: dict[tuple, subprocess.Popen] = {}


def start_child_checks(spec: str, validate: bool, splits: tuple[tuple[int, int], ...]) -> None:
    """Start the child of `child_checks(spec, validate, splits)` now, so that it works while this
    process does something else (the plan sizes the model meanwhile); `child_checks` waits for
    it, `discard_child_checks` ends it unasked. Nothing where it cannot start (`child_checks`
    says why, when asked)."""
    key = (spec, validate, splits)
    if not _started:
        atexit.register(_end_started)  # a plan refused meanwhile leaves no child working
    if key not in _started:
        try:
            _started[key] = start_child(_CHECKS, spec, "1" if validate else "0", json.dumps([list(s) for s in splits]))
        except OSError:
            pass


def _end_started() -> None:
    for key in list(_started):
        discard_child_checks(*key)


def discard_child_checks(spec: str, validate: bool, splits: tuple[tuple[int, int], ...]) -> None:
    """End the child `start_child_checks` started with these arguments, if it is not needed."""
    proc = _started.pop((spec, validate, splits), None)
    if proc is not None:
        proc.kill()
        proc.communicate()


@functools.lru_cache(maxsize=None)
def child_checks(spec: str, validate: bool, splits: tuple[tuple[int, int], ...]) -> tuple[str | None, list]:
    """In one child process: cases/user.py `validate_case` of the case `spec` (when `validate`),
    then, if it found no mistake, harness/run/batch_makeup.py `relative_difference` of each
    (world size, micro-batches) of `splits`. Returns (the mistake's message or None, the
    measurements); ChildFailed where the child could not say. Cached: the plan asks twice."""
    proc = _started.pop((spec, validate, splits), None)
    if proc is None:
        mistake, measured = run_child(_CHECKS, spec, "1" if validate else "0", json.dumps([list(s) for s in splits]))
    else:
        mistake, measured = child_value(proc)
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
