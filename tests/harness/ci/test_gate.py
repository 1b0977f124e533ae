"""`python -m harness gate`: the CI configuration, its JUnit XML, summary and exit codes."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from tests.support.judged import assert_judged
from tests.support.scratch_repo import REPO, harness

sys.path.insert(0, str(REPO))
from harness.cli import build_parser  # noqa: E402
from harness.verbs.common import plan_from_args  # noqa: E402

PLUGINS = "tests/harness/adapters/test_harness_plugins.py"


def _junit(out: Path) -> dict[str, ET.Element]:
    root = ET.parse(out / "junit.xml").getroot()
    assert root.tag == "testsuite"
    cases = {c.get("name"): c for c in root.findall("testcase")}
    assert int(root.get("tests")) == len(cases)
    assert int(root.get("failures")) == sum(c.find("failure") is not None for c in cases.values())
    assert int(root.get("errors")) == sum(c.find("error") is not None for c in cases.values())
    return cases


def test_default_gate_covers_w_1_2_4_both_data_modes_and_full_adds_8(tmp_path):
    args = build_parser().parse_args(["gate", "--out", str(tmp_path)])
    plan = plan_from_args(args)
    assert plan.world_sizes == (1, 2, 4)
    assert {c.data_mode for c in plan.cells} == {"identical", "split"}
    full = plan_from_args(build_parser().parse_args(["gate", "--full", "--out", str(tmp_path)]))
    assert full.world_sizes == (1, 2, 4, 8)


def test_the_example_workflow_installs_cpu_torch_first_and_runs_the_gate():
    text = (REPO / ".github" / "workflows" / "fsdp-equivalence.yml").read_text()
    torch_at, project_at, gate_at = (text.index(s) for s in ('"torch==2.13.0"', "pip install -e", "python -m harness gate"))
    assert torch_at < project_at < gate_at
    assert "junit.xml" in text and "upload-artifact" in text


@pytest.mark.slow
def test_gate_passes_with_junit_per_cell_and_a_step_summary(tmp_path):
    out, step_summary = tmp_path / "gate", tmp_path / "step_summary.md"
    step_summary.write_text("earlier step\n")
    rc, log = harness(["gate", "--cases", "mlp", "--world-sizes", "1,2", "--steps", "2", "--out", str(out), "--quiet"],
                      cwd=REPO, timeout=900, env={"GITHUB_STEP_SUMMARY": str(step_summary)})
    assert rc == 0, log[-4000:]
    cases = _junit(out)
    cells = {f"mlp.ours.w{w}.{d}" for w in (1, 2) for d in ("identical", "split")}
    assert set(cases) == cells | {"ref.mlp"}
    assert all(len(c) == 0 for c in cases.values())  # no failure, no error
    rows = {c["cell_id"]: c for c in json.loads((out / "summary.json").read_text())["cells"]}
    assert set(rows) == cells, sorted(rows)
    for row in rows.values():
        assert_judged(out, row, steps=2, padding=True)
    summary = (out / "summary.md").read_text()
    assert summary.startswith("## FSDP equivalence gate: PASS")
    assert all(f"| {cell} | pass |" in summary for cell in cells)
    assert step_summary.read_text() == "earlier step\n" + summary + "\n"  # appended, not overwritten


@pytest.mark.slow
def test_a_planted_bug_fails_naming_the_parameter_and_a_crash_gets_its_row(tmp_path):
    out = tmp_path / "gate"
    rc, log = harness(["gate", "--cases", "mlp", "--world-sizes", "2", "--data", "identical", "--steps", "1",
                       "--impls", f"ours,{PLUGINS}:RaiseOnRank1", "--faults", "no_grad_average",
                       "--out", str(out), "--quiet"], cwd=REPO, timeout=900)
    assert rc == 1, log[-4000:]
    cases = _junit(out)
    assert set(cases) == {"mlp.ours.w2.identical.no_grad_average", "mlp.raise_on_rank1.w2.identical", "ref.mlp"}, \
        sorted(cases)
    assert len(cases["ref.mlp"]) == 0  # the reference itself passed
    failure = cases["mlp.ours.w2.identical.no_grad_average"].find("failure")
    assert failure is not None
    # the first divergence: a gradient, named by its parameter, at step 1
    assert re.match(r"mlp\.ours\.w2\.identical\.no_grad_average optimizer=\w+ step=1 grad: 'layers\.\d\.(weight|bias)'",
                    failure.get("message")), failure.get("message")
    error = cases["mlp.raise_on_rank1.w2.identical"].find("error")
    assert error is not None and "rank 1" in error.text and "planted failure" in error.text
    summary = (out / "summary.md").read_text()
    assert summary.startswith("## FSDP equivalence gate: FAIL")
    assert "| mlp.raise_on_rank1.w2.identical | error |" in summary
    assert "| mlp.ours.w2.identical.no_grad_average | fail |" in summary
