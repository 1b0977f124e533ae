"""Verdicts are an Enum (harness/judge/verdict.py `Verdict`): a misspelt verdict raises where it is
made, instead of reading as 'not pass' in one module and 'not fail' in another; on disk it is the
plain string every report, CSV and JUnit consumer already reads."""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness.judge.verdict import CellResult, Verdict


def test_a_misspelt_verdict_is_refused_when_made_and_when_set():
    with pytest.raises(ValueError, match="'passs' is not a valid Verdict"):
        CellResult(None, "passs")
    result = CellResult(None, "pass")
    with pytest.raises(ValueError, match="'failed' is not a valid Verdict"):
        result.verdict = "failed"
    with pytest.raises(ValueError):
        dataclasses.replace(result, verdict="ok")


def test_a_verdict_reads_and_writes_as_its_string():
    result = CellResult(None, "fail")
    assert result.verdict is Verdict.FAIL and result.verdict == "fail" and result.verdict != "pass"
    assert json.dumps({"verdict": result.verdict}) == '{"verdict": "fail"}'
    assert f"{result.verdict}" == str(result.verdict) == "fail" and f"{result.verdict:>6}" == "  fail"
    assert [v.value for v in Verdict] == ["pass", "fail", "error"]
