"""Reports people read and CI renders (fast, one process, no ranks): junit.xml read by a real
JUnit parser, steps.csv carrying losses and every check's |diff|, tolerance and margin, report.html
with its verdict, failures, loss curves and tolerance-scaled heatmaps, the environment taken
from the plan, and baselines refused across backends, devices and thread counts."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import yaml
from junitparser import Error, Failure, JUnitXml, Skipped

from harness.ci.baseline import FORMAT, BaselineRefused, BaselineResult, environment_key, load_baseline
from harness.judge.diff import DiffStats, OptimizerResult
from harness.judge.checks import CHECK_ORDER
from harness.judge.result import Violation
from harness.ci.gate import add_gate_files
from harness.run.outcome import RunOutcome
from harness.run.plan import Cell, build_plan
from harness.report.build import build_report, report_files, step_rows
from harness.report.view import margin_class, margin_text
from harness.judge.verdict import CellResult
from tests.support.scratch_repo import REPO, harness

STEPS = 3


def _checks(elements: int = 100, **margins) -> dict:
    out = {}
    for check in CHECK_ORDER:
        compared = 0 if check in ("padding", "nonfinite") else elements  # this cell has no padding
        out[check] = {"u": 6e-8 if check in ("grad", "param", "trajectory") else 0.0, "elements": compared,
                      "margin": margins.get(check, 0.0), "tol_over_value_median": 1e-7, "tol_over_value_max": 1e-5}
    return out


def _optimizer(kind: str, grad_margins: list[float], violations=(), loss_offset: float = 0.0) -> OptimizerResult:
    """A judged optimizer run of STEPS steps whose grad check came grad_margins[s - 1] of its
    tolerance at step s (tol 1e-9 at 'w'); trajectory |diff| 1e-8 against tol 1e-7."""
    losses = [{"optimizer": kind, "step": s, "loss": 2.0 / s + loss_offset, "replay": 2.0 / s + loss_offset,
               "reference": 2.0 / s} for s in range(1, STEPS + 1)]
    step_checks = [{"optimizer": kind, "step": 0, "check": "init", "margin": 0.0, "diff": 0.0, "tol": 0.0, "name": "w"}]
    for s, m in enumerate(grad_margins, start=1):
        step_checks += [
            {"optimizer": kind, "step": s, "check": "grad", "margin": m, "diff": m * 1e-9, "tol": 1e-9, "name": "w"},
            {"optimizer": kind, "step": s, "check": "param", "margin": 0.1, "diff": 1e-10, "tol": 1e-9, "name": "b"},
            {"optimizer": kind, "step": s, "check": "trajectory", "margin": 0.1, "diff": 1e-8, "tol": 1e-7, "name": "w"}]
    per_step = [{"optimizer": kind, "step": s, "quantity": q, "max_abs": 0.0, "max_rel": 0.0, "max_ulp": 0,
                 "num_diff": 0, "numel": 10, "bitwise_equal": True}
                for s in range(1, STEPS + 1) for q in ("loss", "grad", "param")]
    margins = {"grad": max(grad_margins), "param": 0.1, "trajectory": 0.1}
    return OptimizerResult(kind, violations=list(violations), margins={**{c: 0.0 for c in CHECK_ORDER}, **margins},
                           trajectory={"loss": DiffStats(0.0, 0.0, 0, 0, 1)}, per_step=per_step,
                           checks=_checks(**margins), step_checks=step_checks, losses=losses)


def _report(tmp_path, **plan_kwargs):
    """mlp at W = 2: a passing identical cell, a split cell failing its grad check at step 2 and its
    exact loss check at step 3, a crashed cell, and a skipped one; every cell with its time."""
    plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(2,), data_modes=("identical", "split"),
                      steps=STEPS, out_dir=tmp_path / "out", **plan_kwargs)
    passing, failing = plan.cells
    crashed = dataclasses.replace(passing, impl="fsdp2")
    skipped = Cell("mlp", "ddp", 2, "identical", STEPS)
    plan = dataclasses.replace(plan, cells=plan.cells + (crashed,), skipped=((skipped, "no counterpart here"),))
    grad_violation = Violation("sgd", 2, "grad", "w", 56.0, 5.6e-8, 1e-9, 1.0, 1.0, index=3, coords=(0, 3), rank=1)
    loss_violation = Violation("sgd", 3, "loss", "<loss>", math.inf, 2.5e-7, 0.0, 0.5, 0.5, rank=0)
    results = [
        CellResult(passing, "pass", {"sgd": _optimizer("sgd", [0.2, 0.3, 0.1]), "adamw": _optimizer("adamw", [0.7, 0.2, 0.1])}),
        CellResult(failing, "fail", {"sgd": _optimizer("sgd", [0.2, 56.0, 0.3], [grad_violation, loss_violation], 1e-3)}),
        CellResult(crashed, "error", error="launch W=2 exited 1\n[rank 1] RuntimeError: planted failure"),
    ]
    reference = CellResult(plan.references[0], "pass", {"sgd": _optimizer("sgd", [0.0] * STEPS)})
    outcome = RunOutcome(plan, wall_s=12.5, cell_wall_s={passing.cell_id: 3.25, failing.cell_id: 4.5,
                                                          crashed.cell_id: 1.75, reference.cell.cell_id: 0.5})
    return plan, build_report(results, [reference], [], outcome, "python -m harness gate (test)")


# -- junit.xml ------------------------------------------------------------------------------------

def test_junit_parsed_by_junitparser_has_time_skipped_failures_errors_and_the_environment(tmp_path):
    plan, report = _report(tmp_path)
    baseline = [BaselineResult("b.json", "mlp", num_checked=4, wall_s=0.25)]
    (xml,) = JUnitXml.fromstring(add_gate_files(report_files(report), report, baseline)["junit.xml"].encode())
    cases = {case.name: case for case in xml}
    assert set(cases) == {c.cell_id for c in plan.cells} | {"mlp.ddp.w2.identical", "ref.mlp", "baseline.mlp"}
    assert {name: case.time for name, case in cases.items()} == {
        "mlp.ours.w2.identical": 3.25, "mlp.ours.w2.split": 4.5, "mlp.fsdp2.w2.identical": 1.75,
        "mlp.ddp.w2.identical": 0.0, "ref.mlp": 0.5, "baseline.mlp": 0.25}

    (failure,) = cases["mlp.ours.w2.split"].result
    assert isinstance(failure, Failure) and failure.type == "grad"
    assert failure.message.startswith("mlp.ours.w2.split optimizer=sgd step=2 grad: 'w'[3] at (0, 3) in rank 1's shard")
    assert "step=3 loss" in failure.text  # every violation listed, not only the first
    (error,) = cases["mlp.fsdp2.w2.identical"].result
    assert isinstance(error, Error) and error.message == "launch W=2 exited 1" and "planted failure" in error.text
    (skipped,) = cases["mlp.ddp.w2.identical"].result
    assert isinstance(skipped, Skipped) and skipped.message == "no counterpart here"
    assert cases["mlp.ours.w2.identical"].is_passed and cases["ref.mlp"].is_passed

    assert (xml.tests, xml.failures, xml.errors, xml.skipped) == (6, 1, 1, 1)
    props = {p.name: p.value for p in xml.properties()}
    assert props["run_id"] == plan.run_id
    assert (props["environment.backend"], props["environment.device"], props["environment.threads_per_rank"]) == \
        ("gloo", "cpu", "1")
    assert props["environment.torch"] == report.environment["torch"]


@pytest.mark.slow
def test_a_real_gates_junit_has_times_a_skipped_cell_and_the_first_divergence(tmp_path):
    """A real gate: ours with a planted bug fails on mlp (zero1 never reduce-scatters, so the bug is
    not on its path), fsdp2 passes, fsdp2 on zero1 is skipped."""
    out = tmp_path / "gate"
    rc, log = harness(["gate", "--cases", "mlp,zero1", "--impls", "ours,fsdp2", "--world-sizes", "2", "--data",
                       "identical", "--steps", "1", "--faults", "no_grad_average", "--out", str(out), "--quiet"],
                      cwd=REPO, timeout=900)
    assert rc == 1, log[-4000:]
    (suite,) = JUnitXml.fromfile(str(out / "junit.xml"))
    cases = {case.name: case for case in suite}
    ran = ["mlp.ours.w2.identical.no_grad_average", "mlp.fsdp2.w2.identical", "zero1.ours.w2.identical.no_grad_average"]
    assert all(cases[name].time > 0 for name in ran), {n: c.time for n, c in cases.items()}
    assert cases["mlp.fsdp2.w2.identical"].is_passed and cases["zero1.ours.w2.identical.no_grad_average"].is_passed
    (failure,) = cases[ran[0]].result
    assert isinstance(failure, Failure) and failure.message.startswith(f"{ran[0]} optimizer=")
    assert " grad: '" in failure.message and "> tol=" in failure.message, failure.message
    (skipped,) = cases["zero1.fsdp2.w2.identical"].result
    assert isinstance(skipped, Skipped) and "ZeRO-1" in skipped.message
    assert (suite.tests, suite.failures, suite.errors, suite.skipped) == (6, 1, 0, 1)  # + ref.mlp, ref.zero1
    summary = json.loads((out / "summary.json").read_text())
    assert {p.name: p.value for p in suite.properties()}["environment.torch"] == summary["environment"]["torch"]


# -- steps.csv ------------------------------------------------------------------------------------

def test_steps_csv_has_losses_and_every_checks_diff_tolerance_and_margin_per_step(tmp_path):
    _, report = _report(tmp_path)
    steps = pd.read_csv(io.StringIO(report_files(report)["steps.csv"]))
    failing = steps[(steps.cell_id == "mlp.ours.w2.split") & (steps.optimizer == "sgd")].set_index("step")
    assert list(failing.index) == [0, 1, 2, 3]
    assert failing.loc[2, "loss"] == pytest.approx(1.001) and failing.loc[2, "loss_reference"] == 1.0
    assert failing.loc[2, "loss_replay"] == pytest.approx(1.001)
    # the judged checks: the element nearest its tolerance at each step
    assert (failing.loc[2, "grad_max_diff"], failing.loc[2, "grad_tol"], failing.loc[2, "grad_margin"]) == \
        pytest.approx((5.6e-8, 1e-9, 56.0))
    assert failing.loc[2, "grad_name"] == "w" and failing.loc[1, "grad_margin"] == pytest.approx(0.2)
    assert failing.loc[1, "trajectory_max_diff"] == pytest.approx(1e-8) and failing.loc[1, "trajectory_tol"] == 1e-7
    # the exact checks: 0 where they found nothing, the violation where they failed
    assert failing.loc[2, "loss_max_diff"] == 0.0 and failing.loc[2, "loss_margin"] == 0.0
    assert failing.loc[3, "loss_max_diff"] == pytest.approx(2.5e-7) and failing.loc[3, "loss_margin"] == math.inf
    assert failing.loc[0, "init_margin"] == 0.0 and math.isnan(failing.loc[1, "init_margin"])
    assert failing["padding_margin"].isna().all()  # no padding in this cell: nothing compared, not "0"
    assert set(steps.cell_id) == {"ref.mlp", "mlp.ours.w2.identical", "mlp.ours.w2.split"}  # crashed: no steps
    for check in CHECK_ORDER:
        assert {f"{check}_max_diff", f"{check}_tol", f"{check}_margin"} <= set(steps.columns)


def test_step_rows_of_a_cell_without_optimizers_are_empty(tmp_path):
    _, report = _report(tmp_path)
    assert step_rows(report.cells[2]) == []


# -- report.html ----------------------------------------------------------------------------------

class _Page(HTMLParser):
    """Text in document order with the classes around it, and the position of every <svg>."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[tuple[str, tuple[str, ...]]] = []
        self.svg_at: list[int] = []
        self.stack: list[str] = []
        self.scripts = 0
        self.external = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "svg":
            self.svg_at.append(len(self.texts))
        if tag == "script":
            self.scripts += 1
        for key in ("src", "href"):
            if attrs.get(key, "").startswith(("http:", "https:", "//")):
                self.external.append(attrs[key])
        self.stack.append(attrs.get("class") or "")

    def handle_endtag(self, tag):
        if self.stack:
            self.stack.pop()

    def handle_data(self, data):
        if data.strip():
            self.texts.append((data.strip(), tuple(self.stack)))

    def index(self, needle: str) -> int:
        return next(i for i, (t, _) in enumerate(self.texts) if needle in t)

    def cls(self, needle: str) -> str:
        return next(c[-1] for t, c in self.texts if t == needle)


def test_the_html_shows_verdict_failures_and_loss_curves_first_and_colours_margins_by_tolerance(tmp_path):
    _, report = _report(tmp_path)
    page = _Page()
    page.feed(report_files(report)["report.html"])
    assert page.scripts == 0 and page.external == []  # one offline file
    verdict = page.index("FSDP equivalence: FAIL")
    failures = page.index("Failing cells")
    loss = page.index("Loss per world size and implementation")
    assert verdict < failures < loss < page.index("Trajectory against its judged bound")
    assert page.index("mlp.ours.w2.split") < loss and page.index("mlp.fsdp2.w2.identical") < loss
    # the loss figure (one svg per case) sits right under its heading, before the trajectory figure
    assert len(page.svg_at) == 2 and loss < page.svg_at[0] < page.index("Trajectory against its judged bound")
    # verdict grid: the failing cell, the crashed one, the skipped one, a pass with its worst margin
    assert page.cls("FAIL grad") == "v-fail" and page.cls("ERROR") == "v-error" and page.cls("skipped") == "v-skipped"
    assert page.cls("pass 0.70") == "near"  # the passing cell's adamw grad came 0.7 of its tolerance
    # heatmap of margins: by |diff| / tolerance, not by |diff|
    assert page.cls("56") == "over" and page.cls("inf") == "over"
    assert "no counterpart here" in {t for t, _ in page.texts}


@pytest.mark.parametrize("margin, css", [(0.0, "ok"), (0.49, "ok"), (0.5, "near"), (1.0, "near"), (1.01, "over"),
                                         (math.inf, "over"), (math.nan, "nan"), (None, "na")])
def test_margin_bands(margin, css):
    assert margin_class(margin) == css


@pytest.mark.parametrize("margin, text", [(0.4996, "0.49"), (0.5, "0.50"), (0.999, "0.99"), (1.0, "1"), (56.3, "56.3"),
                                          (0.0, "0.0"), (0.004, "4e-03"), (math.inf, "inf"), (None, "-")])
def test_margin_text_never_rounds_into_the_next_band(margin, text):
    assert margin_text(margin) == text


# -- the environment and baselines ---------------------------------------------------------------

def test_the_environment_comes_from_the_plan(tmp_path):
    plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(2,), steps=1, out_dir=tmp_path, threads=3)
    gpu_plan = dataclasses.replace(plan, backend="nccl", device="cuda")  # built here without a GPU
    for p in (plan, gpu_plan):
        report = build_report([], [], [], RunOutcome(p), "cmd")
        env = report.environment
        assert (env["backend"], env["device"], env["threads_per_rank"]) == (p.backend, p.device, 3)
        summary = json.loads(report_files(report)["summary.json"])
        assert summary["environment"]["backend"] == p.backend
    assert environment_key(gpu_plan)["backend"] == "nccl" and environment_key(gpu_plan)["device"] == "cuda"


def _baseline_for(plan) -> dict:
    """A well-formed baseline of mlp (2 steps, both optimizers) recorded under `plan`'s key."""
    record = lambda t: {"step": t, "loss": 1.0, "grads": {"w": [0.5, 1.0]}, "params": {"w": [0.5, 1.0]},  # noqa: E731
                        "buffers": {}}
    optimizers = {kind: {"init": {"w": [0.0, 1.0]}, "init_buffers": {}, "steps": [record(1), record(2)]}
                  for kind in ("sgd", "adamw")}
    return {"format": FORMAT, "key": environment_key(plan), "recorded": {},
            "cases": {"mlp": {"steps": 2, "optimizers": optimizers}}}


@pytest.mark.parametrize("recorded_with, checked_with, field", [
    ({}, {"threads": 2}, "threads"),
    ({"threads": 4}, {}, "threads"),
    ({}, {"backend": "nccl", "device": "cuda"}, "backend"),
    ({"backend": "nccl", "device": "cuda"}, {}, "backend"),
])
def test_a_baseline_recorded_under_one_backend_device_or_thread_count_is_refused_under_another(
        tmp_path, recorded_with, checked_with, field):
    def plan_with(**changes):
        plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(1,), steps=2, out_dir=tmp_path / "gate",
                          threads=changes.pop("threads", 1))
        return dataclasses.replace(plan, **changes)  # nccl/cuda without a GPU: the key is all that is used

    recorded, checked = plan_with(**recorded_with), plan_with(**checked_with)
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(_baseline_for(recorded)))
    with pytest.raises(BaselineRefused, match=f"recorded under another environment .*{field}: baseline="):
        load_baseline(path, checked)
    load_baseline(path, recorded)  # the same environment: accepted


# -- the example workflow -------------------------------------------------------------------------

WORKFLOW = Path(__file__).resolve().parents[3] / ".github" / "workflows" / "fsdp-equivalence.yml"


def _schema_check(path: Path) -> subprocess.CompletedProcess:
    """check-jsonschema against the GitHub-workflow schema it ships (SchemaStore's, vendored in the
    package: no network)."""
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
                           str(path)], capture_output=True, text=True, timeout=120)


def test_the_example_workflow_passes_the_github_workflow_schema(tmp_path):
    result = _schema_check(WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / "broken.yml"  # the check can fail: a permission level GitHub does not know
    broken.write_text(WORKFLOW.read_text().replace("checks: write", "checks: writ"))
    result = _schema_check(broken)
    assert result.returncode == 1 and "'writ' is not one of" in result.stdout, result.stdout + result.stderr


def test_the_example_workflow_pins_actions_by_commit_publishes_junit_and_grants_least_privilege():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    assert workflow["permissions"] == {}  # nothing by default
    (job,) = workflow["jobs"].values()
    assert job["permissions"] == {"contents": "read", "checks": "write"}
    uses = [step["uses"] for step in job["steps"] if "uses" in step]
    assert uses and all(re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", u) for u in uses), uses
    publish = next(s for s in job["steps"] if s.get("uses", "").startswith("EnricoMi/publish-unit-test-result-action@"))
    gate = next(s for s in job["steps"] if "python -m harness gate" in s.get("run", ""))
    out = re.search(r"--out (\S+)", gate["run"]).group(1)
    assert publish["with"]["files"] == f"{out}/junit.xml"
    assert publish["with"]["comment_mode"] == "off"  # a PR comment would need pull-requests: write
    assert publish["if"] == "${{ !cancelled() }}"  # published when the gate fails, too


def test_a_planted_fault_that_passes_is_said_on_the_console_and_in_the_report(tmp_path):
    """A cell run with a planted fault (`--faults`) that passes left the fault uncaught: said as
    NOT CAUGHT before the verdict line and under the verdicts of report.md; a caught one is not."""
    from harness.report.build import console_summary
    from harness.report.markdown import render_markdown

    plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(2,), data_modes=("identical", "split"),
                      steps=STEPS, out_dir=tmp_path / "out", fault_copies=("grad_scale_1e-5",))
    faulty = [c for c in plan.cells if c.faults]
    assert len(faulty) == 2
    escaped, caught = faulty
    violation = Violation("sgd", 1, "grad", "w", 56.0, 5.6e-8, 1e-9, 1.0, 1.0, index=3, coords=(0, 3), rank=1)
    results = [CellResult(c, "pass", {"sgd": _optimizer("sgd", [0.1] * STEPS)}) for c in plan.cells if not c.faults]
    results += [CellResult(escaped, "pass", {"sgd": _optimizer("sgd", [0.1] * STEPS)}),
                CellResult(caught, "fail", {"sgd": _optimizer("sgd", [56.0, 0.1, 0.1], [violation])})]
    report = build_report(results, [CellResult(plan.references[0], "pass", {"sgd": _optimizer("sgd", [0.0] * STEPS)})],
                          [], RunOutcome(plan, wall_s=1.0), "python -m harness run (test)")
    out = io.StringIO()
    console_summary(report, out)
    lines = out.getvalue().splitlines()
    said = [line for line in lines if line.startswith("NOT CAUGHT")]
    assert said == [f"NOT CAUGHT {escaped.cell_id}: planted fault(s) grad_scale_1e-5 left every check within its bounds"]
    assert lines.index(said[0]) < len(lines) - 1 and lines[-1].startswith("verdict: fail")
    text = render_markdown(report)
    assert "Planted faults not caught:" in text and f"- {escaped.cell_id}: planted fault(s)" in text
    assert caught.cell_id not in text.split("Planted faults not caught:")[1].split("## First divergences")[0]
