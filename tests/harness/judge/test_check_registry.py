"""Fast tier: the judge's check registry (harness/judge/checks/__init__.py) is the one list of
checks: the judge's order and the vocabularies are derived from it, and each entry names the
module (and function) that computes it, which exists. Planted mistakes in a copy of the table are
each found."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from harness.judge.checks import BOUNDED, CHECK_ORDER, CHECKS, JUDGED, Check
from harness.judge.result import Violation

ROOT = Path(__file__).resolve().parents[3]


def registry_problems(checks: tuple[Check, ...]) -> list[str]:
    out = []
    names = [c.name for c in checks]
    out += [f"{n}: registered twice" for n in sorted({n for n in names if names.count(n) > 1})]
    for c in checks:
        path, _, functions = c.where.partition(" ")
        source = ROOT / path
        if not source.is_file():
            out.append(f"{c.name}: {path} does not exist")
            continue
        text = source.read_text()
        for function in (f.strip() for f in functions.split(",") if f.strip()):
            owner, _, name = function.rpartition(".")
            body = text
            if owner:  # a method: looked for in its class's body only
                start = re.search(rf"^class {re.escape(owner)}\b", text, re.M)
                after = "" if start is None else text[text.index("\n", start.end()) + 1:]
                end = re.search(r"^\S", after, re.M)  # the next top-level line ends the class
                body = after[:end.start()] if end else after
            if not re.search(rf"^\s*def {re.escape(name)}\(", body, re.M):
                out.append(f"{c.name}: {path} defines no {function}")
    return out


def test_every_registered_check_names_code_that_computes_it():
    assert registry_problems(CHECKS) == []


def test_the_vocabularies_are_the_registry_s():
    assert CHECK_ORDER == tuple(c.name for c in CHECKS)
    assert set(BOUNDED) <= set(JUDGED) <= set(CHECK_ORDER)
    assert BOUNDED == ("grad", "param", "trajectory") and JUDGED == ("grad", "param", "bias", "trajectory")
    # the first divergence is ordered by the registry: an earlier-registered check first at one step
    early, late = (Violation("sgd", 1, c, "w", 2.0, 1.0, 0.5, 0.0, 0.0) for c in (CHECK_ORDER[0], CHECK_ORDER[-1]))
    assert early.sort_key() < late.sort_key()


PLANTED = [
    (lambda checks: checks + (checks[0],), "registered twice"),
    (lambda checks: (replace(checks[3], where="harness/judge/checks/nowhere.py"),) + checks[4:], "does not exist"),
    (lambda checks: (replace(checks[3], where="harness/judge/diff.py CellJudge.no_such_check"),), "defines no"),
    (lambda checks: (replace(checks[4], where="harness/judge/diff.py CellJudge.step_flat"),), "defines no"),
]


@pytest.mark.parametrize("plant, found", PLANTED, ids=[p[1] for p in PLANTED])
def test_a_planted_mistake_in_the_table_is_found(plant, found):
    problems = registry_problems(plant(CHECKS))
    assert any(found in p for p in problems), problems


def test_a_tolerance_of_no_known_kind_is_refused():
    with pytest.raises(ValueError, match="tolerance"):
        Check("x", "holds nothing", "roughly", "harness/judge/diff.py")
