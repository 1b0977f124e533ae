"""Golden baselines: `baseline record`, `gate --baseline`, and refusing a foreign baseline."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
import torch

from tests.support.scratch_repo import REPO, copy_project, harness, scale_first_layer_init

sys.path.insert(0, str(REPO))
from harness.ci.baseline import BaselineResult, _check_digests, digest  # noqa: E402

CHEAP = ["--cases", "mlp", "--steps", "2"]


def test_a_digest_outside_the_summed_tolerance_fails_and_inside_passes():
    g = torch.linspace(-1, 1, 50)
    tol = torch.full_like(g, 1e-6)
    recorded = {"w": digest(g)}
    ok = BaselineResult("b.json", "mlp")
    _check_digests(ok, "sgd", 1, "grad", {"w": g + 0.9e-6}, recorded, {"w": tol})
    assert not ok.violations and ok.num_checked == 2
    bad = BaselineResult("b.json", "mlp")
    _check_digests(bad, "sgd", 1, "grad", {"w": g + 1.1e-6}, recorded, {"w": tol})
    assert [v.stat for v in bad.violations] == ["sum"]  # 50 x 1.1e-6 > 50 x 1e-6
    assert bad.violations[0].describe("b.json").startswith("baseline b.json: case=mlp optimizer=sgd step=1 grad 'w' sum")


def _foreign(baseline: dict, **key) -> dict:
    return {**baseline, "key": {**baseline["key"], **key}}


def _synthetic_baseline() -> dict:
    from harness.ci.baseline import FORMAT
    from harness.report.environment import baseline_key

    return {"format": FORMAT, "key": baseline_key("gloo", "cpu", 1), "recorded": {}, "cases": {"mlp": {"steps": 2, "optimizers": {}}}}


@pytest.mark.parametrize("key", [{"torch": "2.0.0"}, {"device": "cuda"}, {"backend": "nccl"}, {"threads": 4}])
def test_a_baseline_from_another_environment_is_refused_before_any_rank_starts(tmp_path, key):
    from harness.ci.baseline import BaselineRefused, load_baseline
    from harness.run.plan import build_plan

    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(_foreign(_synthetic_baseline(), **key)))
    plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(1,), steps=2, out_dir=tmp_path / "gate")
    (field, value), = key.items()
    with pytest.raises(BaselineRefused, match=re.escape(f"recorded under another environment ({field}: baseline={value!r}")):
        load_baseline(path, plan)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("baseline") / "baseline.json"
    rc, out = harness(["baseline", "record", *CHEAP, "--out", str(path), "--work-dir", str(path.parent / "work"),
                       "--quiet"], cwd=REPO, timeout=600)
    assert rc == 0, out[-4000:]
    return path


def _baseline_case(out: Path) -> ET.Element:
    root = ET.parse(out / "junit.xml").getroot()
    return next(c for c in root.findall("testcase") if c.get("name") == "baseline.mlp")


GATE_CELLS = {"mlp.ours.w1.identical", "mlp.ours.w1.split", "ref.mlp", "baseline.mlp"}


def _junit_names(out: Path) -> set[str]:
    return {c.get("name") for c in ET.parse(out / "junit.xml").getroot().findall("testcase")}


def _expected_num_checked(steps: int) -> int:
    """Values the baseline compares for mlp: per optimizer, the init digests (sum and norm of every
    parameter), then per step the loss and the digests of every gradient and parameter."""
    from cases.catalog import get_case

    case = get_case("mlp")
    params = list(case.build_model().named_parameters())
    trainable = sum(p.requires_grad for _, p in params)
    return len(case.optimizers) * (2 * len(params) + steps * (1 + 2 * trainable + 2 * len(params)))


@pytest.mark.slow
def test_recorded_baseline_passes_and_a_foreign_copy_is_refused(recorded, tmp_path):
    rc, out = harness(["gate", *CHEAP, "--world-sizes", "1", "--baseline", str(recorded), "--out", str(tmp_path / "gate"),
                       "--quiet"], cwd=REPO, timeout=600)
    assert rc == 0, out[-4000:]
    assert _junit_names(tmp_path / "gate") == GATE_CELLS
    assert len(_baseline_case(tmp_path / "gate")) == 0
    summary = (tmp_path / "gate" / "summary.md").read_text()
    checked = re.search(r"\| baseline\.mlp \| pass \| \| (\d+) values within tolerance", summary)
    assert checked and int(checked.group(1)) == _expected_num_checked(steps=2), summary

    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps(_foreign(json.loads(recorded.read_text()), torch="2.5.1")))
    rc, out = harness(["gate", *CHEAP, "--world-sizes", "1", "--baseline", str(foreign), "--out", str(tmp_path / "g2")],
                      cwd=REPO, timeout=120)
    assert rc == 2 and f"--baseline={foreign} was recorded under another environment (torch: baseline='2.5.1'" in out, out


@pytest.mark.slow
def test_a_scaled_layer_init_fails_the_baseline_while_the_sharding_checks_pass(recorded, tmp_path):
    project = copy_project(tmp_path / "project")
    scale_first_layer_init(project)
    rc, out = harness(["gate", *CHEAP, "--world-sizes", "1", "--baseline", str(recorded), "--out", str(tmp_path / "gate"),
                       "--quiet"], cwd=project, timeout=600)
    assert rc == 1, out[-4000:]
    failure = _baseline_case(tmp_path / "gate").find("failure")
    assert failure is not None
    assert failure.get("message").startswith(f"baseline {recorded}: case=mlp optimizer=")
    assert "step=0 init 'layers.0.weight'" in failure.get("message")
    root = ET.parse(tmp_path / "gate" / "junit.xml").getroot()
    assert _junit_names(tmp_path / "gate") == GATE_CELLS
    others = [c for c in root.findall("testcase") if c.get("name") != "baseline.mlp"]
    assert all(len(c) == 0 for c in others)  # the sharded runs still match their own reference
    assert f"BASELINE FAIL baseline {recorded}" in out


@pytest.mark.slow
def test_a_changed_batchnorm_momentum_fails_the_baseline_on_buffers_while_the_sharding_checks_pass(tmp_path):
    """BatchNorm's running statistics are buffers: no loss, gradient or parameter moves when their
    momentum changes, the sharded run follows its own reference, and only the baseline's buffer
    digests see the model changed."""
    case_file = tmp_path / "bn_case.py"
    source = (REPO / "tests" / "data" / "user_case_buffers.py").read_text()
    case_file.write_text(source)
    cheap = ["--cases", f"{case_file}:make_case", "--steps", "2"]
    path = tmp_path / "baseline.json"
    rc, out = harness(["baseline", "record", *cheap, "--out", str(path), "--work-dir", str(tmp_path / "work"), "--quiet"],
                      cwd=REPO, timeout=600)
    assert rc == 0, out[-4000:]
    recorded = json.loads(path.read_text())["cases"][f"{case_file}:make_case"]["optimizers"]["sgd"]
    assert "blocks.0.norm.running_var" in recorded["init_buffers"] and "scale" in recorded["steps"][0]["buffers"]

    assert source.count("nn.BatchNorm1d(D)") == 1
    case_file.write_text(source.replace("nn.BatchNorm1d(D)", "nn.BatchNorm1d(D, momentum=0.2)"))
    rc, out = harness(["gate", *cheap, "--world-sizes", "1", "--data", "identical", "--impls", "ours", "--baseline", str(path), "--out", str(tmp_path / "gate"),
                       "--quiet"], cwd=REPO, timeout=600)
    assert rc == 1, out[-4000:]
    root = ET.parse(tmp_path / "gate" / "junit.xml").getroot()
    by_name = {c.get("name"): c for c in root.findall("testcase")}
    baseline = next(c for name, c in by_name.items() if name.startswith("baseline."))
    message = baseline.find("failure").get("message")
    assert "step=1 buffers 'blocks.0.norm.running_mean'" in message, message
    assert all(len(c) == 0 for name, c in by_name.items() if not name.startswith("baseline."))  # sharded runs pass
