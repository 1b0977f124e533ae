"""Parameters without a gradient ([Note: Parameters without a gradient] in harness/judge/diff.py;
[Note: Per-parameter shards] and [Note: Gradients with their used flags] in impl/_handle.py),
fast tier, one process.

The evidence is a real run of tests/data/tagger_head.py (a head the loss never reads, in the root
unit beside used layers) through impl=ours at W = 1 and its reference. The plain model's `tagger`
has no gradient, so torch's optimizers leave it alone; every check of the judge that concerns it
fails on its own planted value, the impl/ fault that restores the old behaviour (a zero gradient,
stepped) fails naming the parameter that moved, and the honest evidence passes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cases.catalog import get_case
from harness.adapters import RankContext
from harness.judge.diff import check_snapshot
from harness.run.orchestrate import write_init_states
from harness.run.plan import build_plan
from harness.run.rank import NO_GRADIENT_DIGEST, pick_grads, replica_digests
from harness.run.snapshot import load_init
from harness.run.worker import run_cell
from tests.support.judged import assert_judged, judge_violations

CASE = "tests/data/tagger_head.py:make_case"
UNUSED = ("tagger.weight", "tagger.bias")
STEPS = 2


def _run(tmp_path, kind: str, faults: tuple[str, ...] = ()):
    out = tmp_path / "out"
    plan = build_plan(cases=(CASE,), impls=("ours",), world_sizes=(1,), data_modes=("identical",), steps=STEPS,
                      out_dir=out, faults=faults)
    write_init_states(plan)
    init, _ = load_init(plan.init_dir / "tagger_head.pt", plan.run_id)
    spec = get_case(CASE).optimizer(kind)
    (ref_cell,), (cell,) = plan.references, plan.cells
    ctx = RankContext(0, 1, None)
    return run_cell(cell, spec, init, ctx, out / "scratch"), run_cell(ref_cell, spec, init, ctx, out / "scratch"), init


@pytest.fixture(scope="module", params=["adamw", "sgd"])
def evidence(request, tmp_path_factory):
    return _run(tmp_path_factory.mktemp(f"no-gradient-{request.param}"), request.param)


def test_the_honest_run_leaves_the_head_without_a_gradient_where_the_plain_model_does(evidence):
    snap, ref, init = evidence
    for rec in snap["steps"]:
        assert not set(UNUSED) & set(rec["grads"]) and not set(UNUSED) & set(rec["shadow"]["grads"])
        for name in UNUSED:
            assert torch.equal(rec["params"][name], init[name]), name  # never moved
    assert judge_violations(evidence) == []


def test_a_zero_gradient_where_the_plain_model_has_none_is_no_gradient(evidence):
    def damage(snap):  # as a flat-parameter implementation (torch FSDP1) reports it
        for rec in snap["steps"]:
            rec["grads"].update({n: torch.zeros_like(rec["params"][n]) for n in UNUSED})

    assert judge_violations(evidence, damage) == []


@pytest.mark.parametrize("value", [1e-30, float("nan")])
def test_a_nonzero_gradient_where_the_plain_model_has_none_fails_the_grad_check(evidence, value):
    def damage(snap):
        grad = torch.zeros_like(snap["steps"][1]["params"]["tagger.weight"])
        grad[1, 2] = value
        snap["steps"][1]["grads"]["tagger.weight"] = grad

    violations = [v for v in judge_violations(evidence, damage) if v.check == "grad"]
    assert [(v.step, v.name, v.index, v.expected, v.tol) for v in violations] == [(2, "tagger.weight", 18, 0.0, 0.0)]


def test_a_gradient_missing_where_the_plain_model_has_one_fails_naming_it(evidence):
    def damage(snap):
        del snap["steps"][0]["grads"]["head.bias"]

    first = judge_violations(evidence, damage)[0]
    assert (first.step, first.check, first.name, first.lost_gradient) == (1, "grad", "head.bias", True), first


def test_a_parameter_without_a_gradient_that_moved_fails_the_param_check(evidence):
    def damage(snap):
        p = snap["steps"][0]["params"]["tagger.bias"]
        p[3] = torch.nextafter(p[3], torch.tensor(float("inf")))

    first = judge_violations(evidence, damage)[0]
    assert (first.step, first.check, first.name, first.index, first.tol) == (1, "param", "tagger.bias", 3, 0.0), first


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_the_planted_fault_steps_the_head_and_fails_naming_it(tmp_path, kind):
    """unused_params_stepped (impl/_faults.py) gives a parameter without a gradient a zero one, as
    a unit's flat parameter stepped whole did: weight decay moves the tagger at step 1."""
    snap, ref, init = _run(tmp_path, kind, faults=("unused_params_stepped",))
    first = check_snapshot(snap, init, ref).first_divergence
    assert first is not None and (first.step, first.check, first.name in UNUSED) == (1, "param", True), first
    assert set(UNUSED) <= set(snap["steps"][0]["grads"])  # reported as zeros: the grad check has nothing to say
    assert all(not bool(snap["steps"][0]["grads"][n].any()) for n in UNUSED)


def test_picking_gradients_keeps_the_absent_ones_absent_and_refuses_foreign_names():
    grads = {"a": torch.ones(2), "b.alias": torch.ones(1)}
    picked = pick_grads(grads, ["a", "c"], {"a", "b", "b.alias", "c"}, "rank 0: impl=x full_grads")
    assert list(picked) == ["a"] and picked["a"] is not grads["a"]
    with pytest.raises(RuntimeError, match=r"rank 0: impl=x full_grads name \['_flat_param'\].*plain model's names"):
        pick_grads({**grads, "_flat_param": torch.ones(3)}, ["a"], {"a", "b.alias"}, "rank 0: impl=x full_grads")


def test_replica_digests_line_up_whatever_gradients_a_rank_has():
    params = {"a": torch.ones(2), "c": torch.zeros(1)}
    with_c = replica_digests(params, {"a": torch.ones(2), "c": torch.zeros(1)}, ["a", "c"])
    without_c = replica_digests(params, {"a": torch.ones(2)}, ["a", "c"])
    assert with_c["names"] == without_c["names"] == ["a", "c", "a (grad)", "c (grad)"]
    assert without_c["digests"][3] == NO_GRADIENT_DIGEST != with_c["digests"][3]
    assert without_c["digests"][:3] == with_c["digests"][:3]


# -- through the CLI (slow, extended tier) ------------------------------------------------------

CASE_FILES = {"tagger_head": "tests/data/tagger_head.py", "even_step_branch": "tests/data/even_step_branch.py",
              "sparse_moe": "tests/data/sparse_moe.py"}
# What has no gradient in each: the parameter the planted fault moves must be one of these.
WITHOUT_A_GRADIENT = {"tagger_head": ("tagger.",), "even_step_branch": (".branch.",), "sparse_moe": (".experts.",)}
WORLD_SIZES, DATA = (1, 2, 4), ("identical", "split")
REPO = Path(__file__).resolve().parents[3]


def _harness(args: list[str], out: Path) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    cases = ",".join(f"{path}:make_case" for path in CASE_FILES.values())
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--cases", cases, "--world-sizes",
                           ",".join(map(str, WORLD_SIZES)), "--data", ",".join(DATA), "--timeout", "900",
                           "--out", str(out), "--quiet", *args], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert (out / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, {c["cell_id"]: c for c in json.loads((out / "summary.json").read_text())["cells"]}


@pytest.mark.slow
def test_ours_passes_every_case_and_fsdp2_passes_or_names_its_own_collective_error(tmp_path):
    """ours: every cell passes, every check judged. torch FSDP2 reduce-scatters only the parameters
    with a gradient, so where an expert has tokens on one rank's batch and none on another's
    (sparse_moe, split data) its ranks' collectives differ in size: gloo's own "collective
    mismatch" must be the cell's error, never the adapter's names."""
    out = tmp_path / "honest"
    proc, cells = _harness(["--impls", "ours,fsdp2"], out)
    expected = {f"{case}.{impl}.w{w}.{data}" for case in CASE_FILES for impl in ("ours", "fsdp2")
                for w in WORLD_SIZES for data in DATA}
    assert set(cells) == expected, sorted(cells)
    for cell_id, cell in cells.items():
        if cell_id.startswith("sparse_moe.fsdp2.") and cell_id.endswith(".split") and ".w1." not in cell_id:
            assert cell["verdict"] == "error", (cell_id, cell["first_divergence_text"])
            assert "collective mismatch" in cell["error"], cell["error"][-2000:]
            assert "plain model's names" not in cell["error"], cell["error"][-2000:]
            continue
        assert cell["verdict"] == "pass", (cell_id, cell["first_divergence_text"] or cell["error"])
        assert_judged(out, cell, get_case(cell["case"]).steps, padding=cell["impl"] == "ours")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_the_planted_fault_fails_every_ours_cell_naming_a_parameter_that_had_no_gradient(tmp_path):
    """unused_params_stepped restores the behaviour before [Note: Per-parameter shards]: a zero
    gradient where the plain model has none, stepped. Every cell fails on the param check, naming
    a parameter without a gradient: at step 1 where weight decay moves it, at step 2 for
    even_step_branch's AdamW (no weight decay: its branch stays put at step 1, and its step count,
    one ahead of the plain model's, changes its bias correction when the branch first runs)."""
    proc, cells = _harness(["--impls", "ours", "--faults", "unused_params_stepped"], tmp_path / "planted")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    expected = {f"{case}.ours.w{w}.{data}.unused_params_stepped" for case in CASE_FILES for w in WORLD_SIZES
                for data in DATA}
    assert set(cells) == expected, sorted(cells)
    for cell_id, cell in cells.items():
        case = cell_id.split(".")[0]
        assert cell["verdict"] == "fail", (cell_id, cell["error"])
        for kind in ("adamw", "sgd"):
            first = min((v for v in cell["violations"] if v["optimizer"] == kind),
                        key=lambda v: (v["step"], v["check"] != "param"))
            step = 2 if (case, kind) == ("even_step_branch", "adamw") else 1
            assert (first["step"], first["check"]) == (step, "param"), (cell_id, kind, first)
            assert any(part in first["name"] for part in WITHOUT_A_GRADIENT[case]), (cell_id, kind, first["name"])


@pytest.mark.slow
def test_reducing_at_a_moment_only_this_rank_knows_breaks_split_moe(tmp_path):
    """reduce_at_last_gradient restores the moment a unit reduced before [Note: Rank-consistent
    reductions]: when its last view got a gradient on this rank, else at the end of backward. On a
    step where one rank's batch reaches every expert of a layer and another's does not, their
    reduce-scatters fall out of step (sparse_moe, split, W = 2; the honest cells pass in the test
    above): no verdict can come of it but a failure."""
    out = tmp_path / "planted"
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--cases", f"{CASE_FILES['sparse_moe']}:make_case",
                           "--impls", "ours", "--world-sizes", "2", "--data", "split", "--timeout", "300",
                           "--faults", "reduce_at_last_gradient", "--out", str(out), "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    (cell,) = json.loads((out / "summary.json").read_text())["cells"]
    assert cell["cell_id"] == "sparse_moe.ours.w2.split.reduce_at_last_gradient", cell["cell_id"]
    assert cell["verdict"] in ("error", "fail") and proc.returncode == 1, (cell["verdict"], proc.stdout[-2000:])
