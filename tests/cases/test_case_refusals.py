"""What a case asks that the run cannot honour is refused before any rank starts: exit 2, one line
on stderr, no rank log (fast: the CLI in a subprocess, refused at its plan). The checks behind
the refusals leave honest cases alone: [Note: Batch makeup] (harness/run/batch_makeup.py), the
parameter groups an implementation's flat parameters cannot hold (harness/run/param_groups.py),
buffers the forward grows (cases/user.py). Also the defaults a user's case meets first: the data
modes of the case's own declaration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.run.batch_makeup import THRESHOLD, check_batch_makeup, relative_difference
from harness.run.plan import build_plan

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
MAKEUP = f"{DATA / 'user_case_batch_makeup.py'}"

REFUSALS = {
    "a per-token mean over a padded batch, split": (
        f"{MAKEUP}:make_padded_case", "ours", "1,2",
        ["at world_size=2 with split data the mean of the 2 local losses differs from the whole batch's loss by "
         "2.99e-03 relative", "make each sample's loss term independent"]),
    "BatchNorm with split data": (
        f"{MAKEUP}:make_batchnorm_split_case", "ours", "2,4",
        ["at world_size=2 with split data", "by 1.93e-02 relative", "BatchNorm normalises each rank's batch"]),
    "a RoPE table grown in the forward": (
        f"{DATA / 'user_case_lazy_rope.py'}:make_case", "ours", "1,2",
        ["the forward changed buffer 'rot.cos' from (0, 8) float32 as built to (6, 8) float32",
         "build it at its full size in __init__"]),
}


@pytest.mark.parametrize("mistake", sorted(REFUSALS))
def test_a_case_the_run_cannot_honour_is_exit_2_with_one_line_before_any_rank(tmp_path, mistake):
    case, impls, world_sizes, messages = REFUSALS[mistake]
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--cases", case, "--impls", impls,
                           "--world-sizes", world_sizes, "--out", str(out), "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert all(m in lines[0] for m in messages), lines[0]
    assert not (out / "logs").exists()  # refused before any rank started


HONEST = ["mlp", "transformer", "grad_accumulation", "uneven_tiny", f"{MAKEUP}:make_per_sample_case"]


@pytest.mark.parametrize("case", HONEST + ["gpt2", "llama"])
def test_honest_cases_split_into_the_whole_batchs_loss_to_rounding(case):
    from cases.catalog import get_case

    if get_case(case).missing_requirements():
        pytest.skip(f"needs {get_case(case).missing_requirements()} (pip install -e '.[models]')")
    accum = get_case(case).features.grad_accum
    for w in (2, 4, 8):
        if get_case(case).global_batch % (w * accum) == 0:
            measured = relative_difference(case, w, accum)
            assert isinstance(measured, float) and measured < 1e-15, (case, w, measured)
    assert check_batch_makeup(case, (1, 2, 4), ("identical", "split")) == []


def test_the_couplings_are_far_above_the_threshold_and_identical_data_is_not_measured():
    for w in (2, 4, 8):
        assert relative_difference(f"{MAKEUP}:make_padded_case", w, 1) > 1e5 * THRESHOLD
    assert relative_difference(f"{MAKEUP}:make_batchnorm_split_case", 2, 1) > 1e5 * THRESHOLD
    assert check_batch_makeup(f"{MAKEUP}:make_padded_case", (1, 2, 4), ("identical",)) == []  # nothing split
    assert check_batch_makeup("batchnorm", (1, 2, 4, 8), ("identical",)) == []


def test_a_big_models_check_runs_in_a_child_process_with_the_same_refusals_and_notes(monkeypatch):
    """The float64 probe of a model judged on the ranks runs in a child (the parent holds no copy
    of a big model): the same refusal text, the same notes, the same figures as in the process."""
    case = f"{MAKEUP}:make_batchnorm_split_case"
    with pytest.raises(Exception) as here:
        check_batch_makeup(case, (2,), ("split",))
    with pytest.raises(Exception) as child:
        check_batch_makeup(case, (2,), ("split",), isolated=True)
    assert type(child.value) is type(here.value) and str(child.value) == str(here.value)
    float32_only = f"{MAKEUP}:make_float32_only_case"
    assert (check_batch_makeup(float32_only, (1, 2), ("identical", "split"), isolated=True)
            == check_batch_makeup(float32_only, (1, 2), ("identical", "split")))
    # A child that cannot run is a note, never a pass or a crash of the plan.
    monkeypatch.setattr(sys, "executable", str(REPO / "no-such-python"))
    notes = check_batch_makeup(f"{MAKEUP}:make_padded_case", (2,), ("split",), isolated=True)
    assert len(notes) == 1 and "the batch-makeup check did not run" in notes[0], notes


def test_a_model_that_cannot_run_in_float64_is_not_measured_and_says_why():
    notes = check_batch_makeup(f"{MAKEUP}:make_float32_only_case", (1, 2), ("identical", "split"))
    assert len(notes) == 1 and "the batch-makeup check did not run (the float64 forward raised RuntimeError" in notes[0]


def test_a_cast_to_float32_inside_the_model_stays_in_float64_for_the_check(tmp_path):
    """RMSNorm's `.to(torch.float32)` (Llama's) is a cast the check keeps in float64: measured, not skipped."""
    (tmp_path / "upcast.py").write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "from cases.catalog import Case, OptimizerSpec\n"
        "from cases.data import regression_batch\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(3, 2)\n"
        "    def forward(self, x):\n"
        "        h = self.fc(x)\n"
        "        return (h.to(torch.float32) * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True))).to(h.dtype)\n"
        "def make_case():\n"
        "    return Case(name='upcast', description='', build_model=Net, wrap=(), make_batch=regression_batch(3, 2),\n"
        "                loss_fn=F.mse_loss, optimizers=(OptimizerSpec('sgd', lr=0.1),))\n")
    measured = relative_difference(f"{tmp_path / 'upcast.py'}:make_case", 4, 1)
    assert isinstance(measured, float) and measured < 1e-15, measured


def test_the_data_modes_default_to_the_cases_own(tmp_path):
    from harness.cli import build_parser

    assert build_parser().parse_args(["run"]).data is None and build_parser().parse_args(["gate"]).data is None
    identical_only = f"{DATA / 'user_case_buffers.py'}:make_case"
    plan = build_plan(cases=(identical_only,), impls=("ours",), world_sizes=(1, 2), out_dir=tmp_path)
    assert {c.data_mode for c in plan.cells} == {"identical"}
    plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(1, 2), out_dir=tmp_path)
    assert {c.data_mode for c in plan.cells} == {"identical", "split"}


def test_the_pytest_plugin_passes_no_data_modes_unless_asked(tmp_path, monkeypatch):
    import harness.pytest_plugin as plugin

    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 2, "refused\n")

    monkeypatch.setattr(plugin.subprocess, "run", fake_run)
    plugin._run(tmp_path / "a", "mlp", "ours", (1, 2), None, None, 60.0)
    plugin._run(tmp_path / "b", "mlp", "ours", (1, 2), ("split",), None, 60.0)
    assert "--data" not in commands[0]
    assert commands[1][commands[1].index("--data") + 1] == "split"


@pytest.mark.slow
def test_meta_init_with_a_nonpersistent_buffer_is_the_unsharded_run(tmp_path):
    """to_empty() leaves the non-persistent buffer uninitialised: the rank copies it from the
    reference, as the eager path does (the reference diverged before: its buffer was garbage)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--cases",
                           f"{DATA / 'user_case_buffers.py'}:make_meta_constant_case", "--impls", "ours,fsdp2",
                           "--world-sizes", "1,2", "--out", str(out), "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verdict: pass (8 pass, 0 fail, 0 error, 8 cells" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_no_weight_decay_on_biases_and_norms_runs_under_ours_and_fsdp2(tmp_path):
    """Parameter groups that split every unit (a weight and its bias in different groups): ours steps
    each parameter's own piece of the shard, so it runs them as fsdp2 does, and both pass; the
    replay steps each name with its group's weight decay, so a group not applied would fail."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--cases", f"{DATA / 'user_case_grouped_units.py'}:make_case",
                           "--impls", "ours,fsdp2", "--world-sizes", "1,2", "--out", str(out), "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verdict: pass (8 pass, 0 fail, 0 error, 8 cells" in proc.stdout, proc.stdout[-2000:]
