"""No false PASS from bad evidence (fast, one process): snapshots short of the plan, from another
run or unreadable, a bad initial state, a malformed or truncated baseline, two implementations
with one name, and reports of a cell whose values are not finite."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import xml.etree.ElementTree as ET

import pandas as pd
import pytest
import torch

from cases.catalog import get_case
from harness import cli
from harness.judge import diff
from harness.ci.baseline import BaselineRefused, BaselineResult, _check_digests, load_baseline
from harness.report.environment import baseline_key
from harness.judge.diff import DiffStats, OptimizerResult
from harness.judge.result import Violation
from harness.adapters import RankContext
from harness.run.orchestrate import write_init_states
from harness.run.outcome import RunOutcome
from harness.run.output import OutputDir
from harness.run.plan import build_plan
from harness.report.build import build_report, report_files
from harness.run.snapshot import load_init, load_snapshot, save_snapshot, snapshot_path
from harness.judge.verdict import CellResult, Matrix, evaluate
from harness.run.worker import run_cell

STEPS = 2


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """A real run of mlp (impl=single, W = 1) against its reference, produced in this process."""
    out = tmp_path_factory.mktemp("evidence") / "out"
    plan = build_plan(cases=("mlp",), impls=("single",), world_sizes=(1,), data_modes=("identical",), steps=STEPS,
                      out_dir=out)
    write_init_states(plan)
    init, _ = load_init(plan.init_dir / "mlp.pt", plan.run_id)
    for cell in plan.references + plan.cells:
        for spec in get_case("mlp").optimizers:
            snap = run_cell(cell, spec, init, RankContext(0, 1, None), out / "scratch")
            snap["run_id"] = plan.run_id
            save_snapshot(snapshot_path(plan.snapshot_dir, cell.cell_id, spec.kind), snap)
    return plan


@pytest.fixture
def run(recorded_run, tmp_path):
    """A private copy of the recorded run, free to be damaged."""
    shutil.copytree(recorded_run.out_dir, tmp_path / "out")
    return dataclasses.replace(recorded_run, out_dir=tmp_path / "out")


def _edit(plan, cell_id: str, edit, optimizer: str = "sgd") -> None:
    path = snapshot_path(plan.snapshot_dir, cell_id, optimizer)
    snap = load_snapshot(path)
    edit(snap)
    save_snapshot(path, snap)


def _judge(plan, errors: dict | None = None) -> tuple[dict[str, CellResult], str]:
    outcome = RunOutcome(plan, errors=dict(errors or {}))
    cells, references, matrices = evaluate(plan, outcome)
    report = build_report(cells, references, matrices, outcome, "test")
    return {r.cell.cell_id: r for r in cells + references}, report.verdict


CELL = "mlp.single.w1.identical"


def test_the_honest_evidence_passes(run):
    results, verdict = _judge(run)
    assert set(results) == {CELL, "ref.mlp"}, sorted(results)
    assert verdict == "pass" and all(r.verdict == "pass" for r in results.values()), results
    # Judged, not merely present: both optimizers, every step, every check that applies to impl=single
    # (no raw shards: no padding) compared elements.
    cell = results[CELL]
    assert sorted(cell.optimizers) == ["adamw", "sgd"]
    for kind, opt in cell.optimizers.items():
        assert sorted({row["step"] for row in opt.per_step}) == list(range(1, STEPS + 1)), kind
        compared = {c for c, st in opt.checks.items() if st["elements"] > 0}
        # mlp: no buffers, no clipping; impl=single at W = 1 is held to no contract
        assert compared == set(diff.CHECK_ORDER) - {"padding", "buffers", "clip", "contract"}, (kind, compared)
    assert not list(get_case("mlp").build_model().buffers())


def test_judging_reports_its_progress_once_per_cell(run):
    seen = []
    evaluate(run, RunOutcome(run), judged=lambda done, total: seen.append((done, total)))
    total = len(run.references) + len(run.cells)
    assert seen == [(k, total) for k in range(total + 1)], seen


def _drop_last_step(snap):
    snap["steps"].pop()


def _repeat_step(snap):
    snap["steps"][1] = snap["steps"][0]


def _drop_parameter(snap):
    del snap["steps"][0]["params"]["layers.0.weight"]


def _drop_gradient(snap):
    del snap["steps"][1]["grads"]["layers.0.bias"]


def _foreign_gradient(snap):
    snap["steps"][1]["grads"]["layers.0.bogus"] = snap["steps"][1]["grads"]["layers.0.bias"]


def _one_loss_too_many(snap):
    snap["steps"][0]["loss"] = snap["steps"][0]["loss"].repeat(2)


def _other_run(snap):
    snap["run_id"] = "0" * 32


def _other_cell(snap):
    snap["cell"] = {**snap["cell"], "world_size": 2}


def _other_optimizer(snap):
    snap["optimizer"] = "adamw"


def _reshaped_parameter(snap):
    snap["steps"][0]["params"]["layers.0.weight"] = snap["steps"][0]["params"]["layers.0.weight"].reshape(-1)


@pytest.mark.parametrize("edit, message", [
    (_drop_last_step, "steps 1..1 recorded, the plan has steps 1..2"),
    (_repeat_step, "steps [1, 1] recorded, the plan has steps 1..2"),
    (_drop_parameter, "step 1: parameters names differ from the model's parameters: missing ['layers.0.weight']"),
    (_foreign_gradient, "step 2: gradients name ['layers.0.bogus'], which are not trainable parameters of the model"),
    (_one_loss_too_many, "step 1: loss is (2,), expected one entry per rank (1,)"),
    (_other_run, "(evidence of another run)"),
    (_other_cell, "not of mlp.single.w1.identical"),
    (_other_optimizer, "optimizer='adamw', expected 'sgd'"),
    (_reshaped_parameter, "step 1: parameter 'layers.0.weight' is ("),
])
def test_a_snapshot_short_of_the_plan_is_an_error_naming_what_is_missing(run, edit, message):
    _edit(run, CELL, edit)
    results, verdict = _judge(run)
    assert verdict == "fail"
    assert results[CELL].verdict == "error", results[CELL]
    assert "incomplete evidence" in results[CELL].error and message in results[CELL].error, results[CELL].error
    assert results["ref.mlp"].verdict == "pass"


def test_a_gradient_missing_where_the_plain_model_has_one_fails_naming_it(run):
    # [Note: Parameters without a gradient]: an implementation that lost a gradient fails the grad
    # check at that step, naming the parameter; the evidence is complete, so no error.
    _edit(run, CELL, _drop_gradient)
    results, verdict = _judge(run)
    assert verdict == "fail" and results[CELL].verdict == "fail", results[CELL]
    first = results[CELL].optimizers["sgd"].first_divergence
    assert (first.step, first.check, first.name, first.lost_gradient) == (2, "grad", "layers.0.bias", True), first
    assert "no gradient, where the plain model has one" in first.describe(CELL), first.describe(CELL)
    assert results["ref.mlp"].verdict == "pass"


def test_a_reference_with_a_missing_step_fails_the_run(run):
    _edit(run, "ref.mlp", _drop_last_step)
    results, verdict = _judge(run)
    assert verdict == "fail"
    assert results["ref.mlp"].verdict == "error" and "steps 1..1 recorded" in results["ref.mlp"].error
    # Judged without its reference the cell would lose its trajectory check: no verdict, not a pass.
    assert results[CELL].verdict == "error" and "left no usable evidence" in results[CELL].error, results[CELL]


def test_unreadable_or_missing_evidence_is_an_error_row_not_a_traceback(run):
    snapshot_path(run.snapshot_dir, CELL, "sgd").write_bytes(b"not a snapshot")
    snapshot_path(run.snapshot_dir, CELL, "adamw").unlink()
    results, verdict = _judge(run)
    assert verdict == "fail"
    assert results[CELL].verdict == "error" and "unreadable" in results[CELL].error

    (run.init_dir / "mlp.pt").write_bytes(b"\0" * 10)
    results, verdict = _judge(run)
    assert set(results) == {CELL, "ref.mlp"}, sorted(results)
    assert all(r.verdict == "error" and "initial state" in r.error for r in results.values()), results


def test_an_initial_state_of_another_run_is_refused(run):
    other = dataclasses.replace(run, run_id="f" * 32)
    results, verdict = _judge(other)
    assert verdict == "fail"
    assert set(results) == {CELL, "ref.mlp"}, sorted(results)
    assert all("written by run" in r.error for r in results.values()), results


def test_a_launch_error_wins_over_snapshots_that_exist(run):
    results, verdict = _judge(run, errors={CELL: "launch W=1 exited 1 after every cell completed"})
    assert verdict == "fail" and results[CELL].verdict == "error"


# -- reports of a non-finite cell ---------------------------------------------------------------

def _nonfinite_report(monkeypatch, tmp_path):
    if "nonfinite" not in diff.CHECK_ORDER:  # the judge names the check; reports treat it as opaque
        monkeypatch.setattr(diff, "CHECK_ORDER", diff.CHECK_ORDER + ("nonfinite",))
    plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(2,), data_modes=("identical", "split"), steps=2,
                      out_dir=tmp_path)
    bad_cell, good_cell = plan.cells
    nan, inf = math.nan, math.inf
    violation = Violation("sgd", 2, "nonfinite", "layers.0.weight", inf, nan, 1e-6, nan, 0.25, index=3, coords=(0, 3),
                          rank=1)
    bad = CellResult(bad_cell, "fail", {"sgd": OptimizerResult(
        "sgd", violations=[violation], margins={"loss": 0.1, "grad": nan, "param": inf},
        trajectory={"loss": DiffStats(nan, nan, 0, 1, 1), "grad": DiffStats(inf, inf, 7, 3, 10)},
        per_step=[{"optimizer": "sgd", "step": 2, "quantity": "grad", "max_abs": nan, "bitwise_equal": False}])})
    good = CellResult(good_cell, "pass", {"sgd": OptimizerResult("sgd", margins={"loss": 0.1}, trajectory={"loss": DiffStats(0, 0, 0, 0, 1)})})
    ref = CellResult(plan.references[0], "pass")
    matrix = Matrix("mlp", "ours", "identical", "sgd", ("ref", "2"), ((0.0, nan), (inf, 0.0)))
    outcome = RunOutcome(plan, wall_s=1.0)
    return plan, build_report([bad, good], [ref], [matrix], outcome, "python -m harness run (test)"), bad_cell


def test_every_report_file_renders_a_nonfinite_cell_and_they_agree(monkeypatch, tmp_path):
    plan, report, bad_cell = _nonfinite_report(monkeypatch, tmp_path / "plan")
    from harness.ci.gate import add_gate_files

    files = add_gate_files(report_files(report), report, [])
    with OutputDir(tmp_path / "out", plan.run_id, ()) as output:
        written = output.write_report_set(files)
    assert set(written) == {"report.md", "report.html", "summary.json", "junit.xml", "cells.csv", "steps.csv",
                            "matrices.csv", "summary.md"}
    text = {name: path.read_text() for name, path in written.items()}
    assert all(plan.run_id in t for t in text.values()), [n for n, t in text.items() if plan.run_id not in t]

    def no_constants(name):
        raise AssertionError(f"summary.json holds the non-JSON constant {name}")

    summary = json.loads(text["summary.json"], parse_constant=no_constants)
    assert summary["verdict"] == "fail" and summary["run_id"] == plan.run_id
    cell = next(c for c in summary["cells"] if c["cell_id"] == bad_cell.cell_id)
    assert cell["verdict"] == "fail" and cell["first_check"] == "nonfinite"
    assert cell["first_divergence"]["check"] == "nonfinite" and cell["first_divergence"]["actual"] == "nan"
    assert cell["max_abs_diff"] in ("nan", "inf") and cell["margin_grad"] == "nan"

    first = violation_text = cell["first_divergence_text"]
    assert "nonfinite" in first and "actual=nan" in first
    root = ET.fromstring(text["junit.xml"])
    failures = {c.get("name"): c.find("failure") for c in root.findall("testcase")}
    assert failures[bad_cell.cell_id].get("message") == violation_text
    assert sum(f is not None for f in failures.values()) == 1
    assert root.find("properties/property").get("value") == plan.run_id
    assert violation_text in text["report.md"] and "| nonfinite" in text["report.md"]
    assert "**Verdict: FAIL**" in text["report.md"]
    assert "FAIL" in text["report.html"] and "#7b1fa2" in text["report.html"] and ">nan<" in text["report.html"]
    assert text["summary.md"].startswith("## FSDP equivalence gate: FAIL") and violation_text.replace("|", "/") in text["summary.md"]
    cells_csv = pd.read_csv(tmp_path / "out" / "cells.csv")
    row = cells_csv[cells_csv.cell_id == bad_cell.cell_id].iloc[0]
    assert row.verdict == "fail" and row.first_check == "nonfinite" and not math.isfinite(row.max_abs_diff)
    matrices = pd.read_csv(tmp_path / "out" / "matrices.csv")
    assert matrices.max_abs_diff.isna().sum() == 1 and (matrices.max_abs_diff == math.inf).sum() == 1


# -- baselines ----------------------------------------------------------------------------------

def _baseline(steps: int = 2) -> dict:
    from harness.ci.baseline import FORMAT

    record = lambda t: {"step": t, "loss": 1.0, "grads": {"w": [0.5, 1.0]}, "params": {"w": [0.5, 1.0]},  # noqa: E731
                        "buffers": {}}
    optimizers = {kind: {"init": {"w": [0.0, 1.0]}, "init_buffers": {},
                         "steps": [record(t) for t in range(1, steps + 1)]}
                  for kind in ("sgd", "adamw")}
    return {"format": FORMAT, "key": baseline_key("gloo", "cpu", 1), "recorded": {},
            "cases": {"mlp": {"steps": steps, "optimizers": optimizers}}}


def _emptied(b):
    for opt in b["cases"]["mlp"]["optimizers"].values():
        opt["steps"] = []


def _string_loss(b):
    b["cases"]["mlp"]["optimizers"]["sgd"]["steps"][1]["loss"] = "0.5"


def _missing_key(b):
    del b["cases"]["mlp"]["optimizers"]["adamw"]["steps"][0]["grads"]


def _bad_digest(b):
    b["cases"]["mlp"]["optimizers"]["sgd"]["init"]["w"] = [1.0]


def _cases_list(b):
    b["cases"] = ["mlp"]


def _missing_optimizer(b):
    del b["cases"]["mlp"]["optimizers"]["adamw"]


def _renumbered(b):
    b["cases"]["mlp"]["optimizers"]["sgd"]["steps"][1]["step"] = 3


@pytest.mark.parametrize("damage, message", [
    (_emptied, "cases.mlp.optimizers.sgd.steps has 0 records"),
    (_string_loss, "cases.mlp.optimizers.sgd.steps[1].loss='0.5' is not a number"),
    (_missing_key, "cases.mlp.optimizers.adamw.steps[0].grads is NoneType"),
    (_bad_digest, "cases.mlp.optimizers.sgd.init.w is [1.0], not [sum, norm]"),
    (_cases_list, "cases is list"),
    (_missing_optimizer, "has no optimizer(s) ['adamw'] for case=mlp"),
    (_renumbered, "cases.mlp.optimizers.sgd.steps[1] is not the record of step 2"),
])
def test_a_malformed_baseline_is_refused_with_one_line(tmp_path, damage, message, monkeypatch, capsys):
    baseline = _baseline()
    damage(baseline)
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(baseline))
    plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(1,), steps=2, out_dir=tmp_path / "gate")
    with pytest.raises(BaselineRefused) as refused:
        load_baseline(path, plan)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    _no_launch(monkeypatch)
    rc = cli.main(["gate", "--cases", "mlp", "--world-sizes", "1", "--steps", "2", "--baseline", str(path),
                   "--out", str(tmp_path / "gate")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err, err


def test_the_intact_synthetic_baseline_is_accepted(tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(_baseline()))
    plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(1,), steps=2, out_dir=tmp_path / "gate")
    assert load_baseline(path, plan)["cases"]["mlp"]["steps"] == 2


@pytest.mark.parametrize("recorded, measured", [
    (math.nan, 1.0), (1.0, math.nan), (math.inf, math.inf), (-math.inf, math.inf)])
def test_a_non_finite_digest_fails_recorded_or_measured(recorded, measured):
    result = BaselineResult("b.json", "mlp")
    tensor = torch.tensor([measured, 0.0])
    _check_digests(result, "sgd", 1, "grad", {"w": tensor}, {"w": [recorded, 1.0]}, {"w": torch.full((2,), 1e-3)})
    assert [v.stat for v in result.violations][:1] == ["sum"], result.violations
    assert result.violations[0].describe("b.json")  # renders without raising


# -- identity -----------------------------------------------------------------------------------

def _no_launch(monkeypatch):
    import harness.run.orchestrate

    def no_launch(*args, **kwargs):
        raise AssertionError("a rank was launched for bad input")

    monkeypatch.setattr(harness.run.orchestrate, "launch", no_launch)


def test_two_adapters_with_one_class_name_are_refused_before_any_rank(tmp_path, monkeypatch, capsys):
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text("from harness.adapters import Ours\n\n\nclass X(Ours):\n    name = 'x'\n")
    _no_launch(monkeypatch)
    rc = cli.main(["run", "--cases", "mlp", "--impls", f"{tmp_path / 'b.py'}:X,{tmp_path / 'a.py'}:X",
                   "--world-sizes", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "share the name 'x'" in err and "give one of them another `name`" in err
    assert not (tmp_path / "out").exists()  # refused before anything was written
