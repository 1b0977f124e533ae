"""Verdicts are an Enum (harness/judge/result.py `Verdict`): a misspelt verdict raises where it is
made, instead of reading as 'not pass' in one module and 'not fail' in another; on disk it is the
plain string every report, CSV and JUnit consumer already reads."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from harness.ci.mutants import Evidence
from harness.fuzz.check import ExampleResult
from harness.judge.diff import OptimizerResult
from harness.judge.result import Judgement, Verdict, Violation
from harness.judge.verdict import CellResult


def test_a_misspelt_verdict_is_refused_when_made_and_when_set():
    with pytest.raises(ValueError, match="'passs' is not a valid Verdict"):
        CellResult(None, "passs")
    result = CellResult(None, "pass")
    with pytest.raises(ValueError, match="'failed' is not a valid Verdict"):
        result.verdict = "failed"
    with pytest.raises(ValueError):
        dataclasses.replace(result, given="ok")


def test_a_cell_result_is_never_better_than_its_evidence():
    """Whatever verdict a cell was given, a violation of any optimizer makes it at least a fail and
    an error (its own or an optimizer's) an error; a worse verdict given stands."""
    violation = _violation(2.0)
    assert CellResult(None, "pass", {"sgd": OptimizerResult("sgd", violations=[violation])}).verdict is Verdict.FAIL
    assert CellResult(None, "pass", {"sgd": OptimizerResult("sgd", error="no shards")}).verdict is Verdict.ERROR
    assert CellResult(None, "pass", error="launch W=2 exited 1").verdict is Verdict.ERROR
    assert CellResult(None, "fail", {"sgd": OptimizerResult("sgd", violations=[violation])},
                      error="rank 1 died").verdict is Verdict.ERROR
    assert CellResult(None, "error", {"sgd": OptimizerResult("sgd", margins={"grad": 0.1})}).verdict is Verdict.ERROR
    assert CellResult(None, "fail", {"sgd": OptimizerResult("sgd", margins={"grad": 0.1})}).verdict is Verdict.FAIL
    passing = CellResult(None, "pass", {"sgd": OptimizerResult("sgd", margins={"grad": 0.1})})
    assert passing.verdict is Verdict.PASS
    passing.optimizers["adamw"] = OptimizerResult("adamw", violations=[violation])  # added after the verdict
    assert passing.verdict is Verdict.FAIL


def test_a_verdict_reads_and_writes_as_its_string():
    result = CellResult(None, "fail")
    assert result.verdict is Verdict.FAIL and result.verdict == "fail" and result.verdict != "pass"
    assert json.dumps({"verdict": result.verdict}) == '{"verdict": "fail"}'
    assert f"{result.verdict}" == str(result.verdict) == "fail" and f"{result.verdict:>6}" == "  fail"
    assert [v.value for v in Verdict] == ["pass", "fail", "error"]


def _violation(ratio: float, step: int = 1, check: str = "grad") -> Violation:
    return Violation("sgd", step, check, "w", ratio, 1.0, 1.0, 2.0, 1.0)


@pytest.mark.parametrize("result_type", ["OptimizerResult", "ExampleResult", "Evidence"])
def test_every_verb_reads_one_judgement(result_type):
    """The judge's run of a cell, a fuzz example and a mutants run are one type (Judgement): an
    error outranks any violation, a violation fails, the first divergence is the earliest step's
    first check, and a NaN ratio is the worst, whichever order the violations come in."""
    make = {"OptimizerResult": lambda **kw: OptimizerResult("sgd", **kw),
            "ExampleResult": lambda **kw: ExampleResult(None, (), **kw),
            "Evidence": lambda **kw: Evidence("gate c", **kw)}[result_type]
    assert isinstance(make(), Judgement)
    assert make(margins={"grad": 0.3}).verdict is Verdict.PASS
    late, early, nan = _violation(9.0, step=2), _violation(1.5, step=1, check="param"), _violation(math.nan)
    assert make(violations=[late, early]).verdict is Verdict.FAIL
    assert make(violations=[late, early]).first_divergence is early
    assert make(violations=[late], error="rank 1 died").verdict is Verdict.ERROR
    assert math.isnan(make(violations=[late, nan]).max_ratio) and math.isnan(make(violations=[nan, late]).max_ratio)
    assert make(margins={"grad": 0.3, "param": 0.7}).max_ratio == 0.7


def test_an_error_is_no_verdict_even_with_an_empty_message():
    """One rule for every judged result (judge/result.py `verdict_of`): an error set, an empty
    message included, is ERROR and never PASS; the baseline check restated it with `if error`, so
    an empty message read as no error."""
    from harness.ci.baseline import BaselineResult

    assert Judgement(error="").verdict is Verdict.ERROR
    assert BaselineResult("b.json", "mlp", error="").verdict is Verdict.ERROR
    assert BaselineResult("b.json", "mlp").verdict is Verdict.PASS
