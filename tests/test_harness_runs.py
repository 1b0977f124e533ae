"""Slow tier: the real CLI launching torchrun. Launches are shared through session fixtures (and
across pytest-xdist workers through a file lock), so each configuration runs once per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parent.parent
PLUGINS = "tests/test_harness_plugins.py"
MATRIX_CASES = ("mlp", "transformer")
MATRIX_DATA = ("identical", "split")


def _harness(args: list[str], timeout: float) -> tuple[int, str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness", *args, "--quiet"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def _shared_run(tmp_path_factory, name: str, args: list[str], timeout: float = 900) -> dict:
    """Run the harness once per session, whichever xdist worker asks first; others read its result."""
    root = tmp_path_factory.getbasetemp().parent
    out = root / f"harness-{name}"
    done = root / f"harness-{name}.json"
    with FileLock(str(root / f"harness-{name}.lock")):
        if not done.exists():
            rc, output, wall_s = _harness([*args, "--out", str(out)], timeout)
            summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
            done.write_text(json.dumps({"rc": rc, "output": output, "wall_s": wall_s, "summary": summary,
                                        "out": str(out)}))
    return json.loads(done.read_text())


def _cells(run: dict) -> dict[str, dict]:
    assert run["summary"] is not None, run["output"][-3000:]
    return {c["cell_id"]: c for c in run["summary"]["cells"]}


def _option_list(config, name: str) -> list[str]:
    return [v.strip() for v in config.getoption(name).split(",") if v.strip()]


def pytest_generate_tests(metafunc):
    if "matrix_cell_id" in metafunc.fixturenames:
        ids = [f"{case}.{impl}.w{w}.{data}" for case in MATRIX_CASES
               for impl in _option_list(metafunc.config, "--impls")
               for w in _option_list(metafunc.config, "--world-sizes") for data in MATRIX_DATA]
        metafunc.parametrize("matrix_cell_id", ids)


@pytest.fixture(scope="session")
def standard_matrix(request, tmp_path_factory):
    impls = request.config.getoption("--impls")
    world_sizes = request.config.getoption("--world-sizes")
    return _shared_run(tmp_path_factory, "matrix", ["run", "--impls", impls, "--world-sizes", world_sizes])


@pytest.mark.slow
def test_matrix_cell_is_equivalent(standard_matrix, matrix_cell_id):
    cell = _cells(standard_matrix)[matrix_cell_id]
    assert cell["verdict"] == "pass", cell["first_divergence_text"] or cell["error"]
    margins = [cell[k] for k in ("margin_loss", "margin_grad", "margin_param")]
    assert max(margins) < 0.5, f"{matrix_cell_id}: honest margins {margins} not below half the tolerance"


@pytest.mark.slow
def test_matrix_run_exits_0_with_bitwise_fsdp2_identical_cells_and_matrices(standard_matrix, request):
    assert standard_matrix["rc"] == 0, standard_matrix["output"][-3000:]
    cells = _cells(standard_matrix)
    world_sizes = _option_list(request.config, "--world-sizes")
    if "fsdp2" in _option_list(request.config, "--impls"):
        for case in MATRIX_CASES:
            for w in ("2", "4"):
                if w in world_sizes:
                    cell = cells[f"{case}.fsdp2.w{w}.identical"]
                    assert cell["max_abs_diff"] == 0.0 and cell["bitwise_equal"], cell
    report = (Path(standard_matrix["out"]) / "report.md").read_text()
    assert "## W x W matrices" in report and "| ref " in report
    for name in ("report.html", "cells.csv", "steps.csv", "matrices.csv", "junit.xml"):
        assert (Path(standard_matrix["out"]) / name).stat().st_size > 0


@pytest.fixture(scope="session")
def no_grad_average_run(tmp_path_factory):
    return _shared_run(tmp_path_factory, "no-grad-average", [
        "run", "--cases", "mlp,transformer", "--impls", "ours", "--world-sizes", "2",
        "--data", "identical,split", "--faults", "no_grad_average"])


@pytest.mark.slow
def test_sum_without_average_fails_every_cell_with_sgd_and_adamw(no_grad_average_run):
    assert no_grad_average_run["rc"] == 1, no_grad_average_run["output"][-3000:]
    for cell_id, cell in _cells(no_grad_average_run).items():
        assert cell["verdict"] == "fail", cell_id
        first = cell["first_divergence"]
        assert first["step"] == 1 and first["check"] == "grad", first
        assert first["rank"] in (0, 1) and first["name"], first
        text = cell["first_divergence_text"]
        assert f"step=1 grad: '{first['name']}'" in text and f"rank {first['rank']}'s shard" in text
    # Both optimizers caught it (the gradient check does not rely on the parameters moving).
    junit = (Path(no_grad_average_run["out"]) / "junit.xml").read_text()
    assert "optimizer=sgd" in junit and "optimizer=adamw" in junit


def _failing_checks(run: dict) -> dict[str, str]:
    """cell id -> the check of its first divergence (every cell must have failed)."""
    cells = _cells(run)
    assert cells and run["rc"] == 1, run["output"][-3000:]
    out = {}
    for cell_id, cell in cells.items():
        assert cell["verdict"] == "fail", (cell_id, cell["error"])
        out[cell_id] = cell["first_divergence"]["check"]
    return out


# Planted errors the error model must catch (docs/error_model.md): each run's cells all fail, on
# the check that names the error; the ids also prove every requested cell ran.
PLANTED = {
    "scale-1e-6-identical": (["--cases", "mlp", "--world-sizes", "2,8", "--data", "identical", "--steps", "1",
                              "--faults", "grad_scale_1e-6"], "grad",
                             {"mlp.ours.w2.identical.grad_scale_1e-6", "mlp.ours.w8.identical.grad_scale_1e-6"}),
    "scale-1e-5-split": (["--cases", "mlp,transformer", "--world-sizes", "2,4", "--data", "split", "--steps", "1",
                          "--faults", "grad_scale_1e-5"], "grad",
                         {f"{c}.ours.w{w}.split.grad_scale_1e-5" for c in ("mlp", "transformer") for w in (2, 4)}),
    "replica-drift": (["--cases", "no_shard", "--world-sizes", "2", "--data", "split", "--steps", "1",
                       "--faults", "replica_grad_drift"], "replicas", {"no_shard.ours.w2.split.replica_grad_drift"}),
    # Two steps: a padding violation at step 1 must not disturb the trajectory check of step 2.
    "grad-padding-garbage": (["--cases", "mlp", "--world-sizes", "2", "--data", "split", "--steps", "2",
                              "--faults", "grad_padding_garbage"], "padding",
                             {"mlp.ours.w2.split.grad_padding_garbage"}),
    "lost-master": (["--cases", "mixed_precision", "--world-sizes", "2", "--data", "split", "--steps", "1",
                     "--faults", "master_lost_to_param_dtype"], "param",
                    {"mixed_precision.ours.w2.split.master_lost_to_param_dtype"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_error_is_caught_by_its_check(tmp_path_factory, name):
    args, check, expected_ids = PLANTED[name]
    run = _shared_run(tmp_path_factory, f"planted-{name}", ["run", "--impls", "ours", *args])
    checks = _failing_checks(run)
    assert set(checks) == expected_ids, sorted(checks)
    assert set(checks.values()) == {check}, checks


@pytest.mark.slow
def test_a_drift_every_step_hides_fails_on_the_trajectory_and_the_honest_twin_passes(tmp_path_factory):
    run = _shared_run(tmp_path_factory, "drift", [
        "run", "--cases", "mlp", "--impls", f"ours,{PLUGINS}:DriftOneUlpPerStep", "--world-sizes", "2",
        "--data", "split", "--steps", "12"])
    cells = _cells(run)
    assert set(cells) == {"mlp.ours.w2.split", "mlp.drift_one_ulp_per_step.w2.split"} or \
        set(cells) == {"mlp.ours.w2.split", "mlp.DriftOneUlpPerStep.w2.split"}, sorted(cells)
    honest = cells["mlp.ours.w2.split"]
    assert honest["verdict"] == "pass", honest["first_divergence_text"] or honest["error"]
    drift = next(c for i, c in cells.items() if i != "mlp.ours.w2.split")
    assert drift["verdict"] == "fail", drift["error"]
    assert set(drift["failed_checks"]) == {"trajectory"}, drift["failed_checks"]
    # Every check compared something at every optimizer, and the drift passed each step's checks.
    for opt, checks in drift["checks"].items():
        for check in ("init", "loss", "grad", "param", "replicas", "padding", "trajectory"):
            assert checks[check]["elements"] > 0, (opt, check)
        assert checks["param"]["margin"] <= 1.0, (opt, checks["param"])


@pytest.fixture(scope="session")
def corrupt_run(tmp_path_factory):
    return _shared_run(tmp_path_factory, "corrupt", [
        "run", "--cases", "mlp,transformer", "--impls", f"{PLUGINS}:CorruptGatheredElement",
        "--world-sizes", "2", "--data", "identical,split"])


@pytest.mark.slow
def test_one_corrupted_gathered_element_on_one_rank_is_caught(corrupt_run):
    assert corrupt_run["rc"] == 1, corrupt_run["output"][-3000:]
    report = (Path(corrupt_run["out"]) / "report.md").read_text()
    for cell_id, cell in _cells(corrupt_run).items():
        assert cell["verdict"] == "fail", cell_id
        first = cell["first_divergence"]
        assert first["step"] == 1 and first["check"] in ("loss", "grad"), first
        if cell["data"] == "identical":  # only rank 1 computed with the corrupted element
            assert first["check"] == "loss" and first["rank"] == 1, first
            assert "on rank 1" in cell["first_divergence_text"]
        grad_names = {v["name"] for v in cell["violations"] if v["check"] == "grad"}
        assert grad_names, cell  # and the gradients it produced are named, parameter by parameter
        assert cell["first_divergence_text"] in report
    summary = json.loads((Path(corrupt_run["out"]) / "summary.json").read_text())
    assert summary["verdict"] == "fail"


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_run_names_the_rank_and_leaves_no_process(tmp_path):
    out = tmp_path / "raise"
    rc, output, wall_s = _harness(["run", "--cases", "mlp", "--impls", f"{PLUGINS}:RaiseOnRank1",
                                   "--world-sizes", "2", "--data", "identical", "--timeout", "120",
                                   "--out", str(out)], timeout=300)
    assert rc == 1, output[-3000:]
    assert wall_s < 120 + 10
    summary = json.loads((out / "summary.json").read_text())
    (cell,) = summary["cells"]
    assert cell["verdict"] == "error"
    assert "first failure: rank 1" in cell["error"]
    assert "[rank 1] RuntimeError: planted failure: rank 1 raises while wrapping" in cell["error"]
    assert "[rank 1] Traceback" in cell["error"]
    assert _processes_mentioning(str(out)) == []


@pytest.mark.slow
def test_a_rank_blocked_in_a_collective_times_out_with_its_stack_and_no_survivors(tmp_path):
    out = tmp_path / "hang"
    timeout = 60  # the launch's own start-up (import torch in 2 ranks) must fit, also under CI load
    rc, output, wall_s = _harness(["run", "--cases", "mlp", "--impls", f"{PLUGINS}:HangOnRank1",
                                   "--world-sizes", "2", "--data", "identical", "--timeout", str(timeout),
                                   "--out", str(out)], timeout=300)
    assert rc == 1, output[-3000:]
    assert wall_s < timeout + 15, wall_s
    (cell,) = json.loads((out / "summary.json").read_text())["cells"]
    assert cell["verdict"] == "error" and "timed out" in cell["error"]
    assert "[rank 1]" in cell["error"] and "in wrap" in cell["error"], cell["error"][-2000:]
    assert _processes_mentioning(str(out)) == []


def _processes_mentioning(text: str) -> list[int]:
    """Processes whose command line mentions `text` (every rank's does: the plan path)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("plugin, timeout_s, evidence", [
    ("RaiseInDestroyOnRank1", 300, "[rank 1] RuntimeError: planted failure: rank 1 raises in destroy_process_group"),
    ("ExitNonZeroAtExitOnRank1", 300, "exitcode  : 3"),
    ("HangAtExitOnRank1", 180, "_hang_at_exit"),  # the stack faulthandler dumped at the timeout
])
def test_a_rank_failing_after_its_last_snapshot_errors_every_cell_of_its_launch(tmp_path, plugin, timeout_s, evidence):
    out = tmp_path / "out"
    rc, output, _ = _harness(["run", "--cases", "mlp", "--impls", f"{PLUGINS}:{plugin}", "--world-sizes", "2",
                              "--data", "identical", "--steps", "1", "--timeout", str(timeout_s), "--out", str(out)],
                             timeout=timeout_s + 300)
    assert rc == 1, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    (cell,) = summary["cells"]
    # the evidence was complete: the failure came after it, yet nothing of that launch passes
    assert all((out / "snapshots" / c / f"{o}.pt").exists() for c in (cell["cell_id"], "ref.mlp") for o in ("sgd", "adamw"))
    assert cell["verdict"] == "error" and summary["references"][0]["verdict"] == "error"
    assert "every cell of this launch had completed when it failed" in cell["error"], cell["error"][-2000:]
    assert evidence in cell["error"], cell["error"][-3000:]
    junit = (out / "junit.xml").read_text()
    assert 'errors="1"' in junit and "every cell of this launch had completed" in junit
    assert _processes_mentioning(str(out)) == []


@pytest.mark.slow
def test_runs_sharing_an_out_never_share_evidence(tmp_path):
    """An honest run and a buggy one into one --out: started while the first runs, the second is
    refused (exit 2); started after it, it is judged on its own evidence and fails."""
    out = tmp_path / "shared"
    cheap = ["--cases", "mlp", "--world-sizes", "2", "--data", "identical", "--steps", "1", "--timeout", "300",
             "--out", str(out), "--quiet"]
    first = subprocess.Popen([sys.executable, "-m", "harness", "run", "--impls", "ours", *cheap], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while '"status": "running"' not in _read(out / ".harness-state.json"):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.2)
    rc, output, _ = _harness(["run", "--impls", "ours", "--faults", "no_grad_average", *cheap], timeout=120)
    assert rc == 2, output[-3000:]
    assert len(output.strip().splitlines()) == 1 and f"--out={out} is in use by another harness run" in output, output
    assert first.wait(timeout=600) == 0, first.communicate()[0][-3000:]
    honest = json.loads((out / "summary.json").read_text())

    rc, output, _ = _harness(["run", "--impls", "ours", "--faults", "no_grad_average", *cheap], timeout=600)
    assert rc == 1, output[-3000:]
    buggy = json.loads((out / "summary.json").read_text())
    assert buggy["run_id"] != honest["run_id"]
    (cell,) = buggy["cells"]
    assert cell["verdict"] == "fail" and cell["first_divergence"]["check"] == "grad", cell
    assert f"Run id: `{buggy['run_id']}`" in (out / "report.md").read_text()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
