"""A user's own case, loaded from a file the package has never seen (cases/user.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "tests" / "data" / "user_case_gated_seq.py"
# Every extension of the Case API at once: keyword inputs and a dict output, a pytree batch with a
# non-tensor leaf, wrap by module class, a parameter group, an LR schedule.
API_SOURCE = REPO / "tests" / "data" / "user_case_api.py"


def _harness(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args, "--quiet"], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_a_users_model_passes_at_every_w_and_a_planted_bug_in_its_adapter_fails(tmp_path):
    case_file, api_file = tmp_path / "my_case.py", tmp_path / "my_tagger.py"
    shutil.copy(SOURCE, case_file)
    shutil.copy(API_SOURCE, api_file)
    proc = _harness(["run", "--cases", f"{case_file}:make_case,{api_file}:make_case",
                     "--impls", f"ours,fsdp2,{case_file}:ScaledGradients", "--world-sizes", "1,2,4",
                     "--data", "identical,split", "--out", str(tmp_path / "out")], timeout=2400)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    cells = {c["cell_id"]: c for c in json.loads((tmp_path / "out" / "summary.json").read_text())["cells"]}
    expected = {f"{case}.{impl}.w{w}.{data}" for case in ("gated_seq", "tagger")
                for impl in ("ours", "fsdp2", "scaled_gradients") for w in (1, 2, 4) for data in ("identical", "split")}
    assert set(cells) == expected, sorted(cells)
    for cell_id, cell in cells.items():
        if ".scaled_gradients." in cell_id and ".w1." not in cell_id:  # at W = 1 nothing is reduced
            assert cell["verdict"] == "fail", cell_id
            first = cell["first_divergence"]
            assert (first["step"], first["check"]) == (1, "grad") and first["name"], first
        else:
            assert cell["verdict"] == "pass", (cell_id, cell["first_divergence_text"], cell["error"])
            for opt, checks in cell["checks"].items():
                assert all(checks[c]["elements"] > 0 for c in ("init", "loss", "grad", "param", "trajectory")), opt


_MISTAKES = {
    "no parameters": ("build_model=lambda: nn.Identity()", "no trainable parameters"),
    "batch does not split": ("make_batch=lambda s, t, b: (torch.randn(7), torch.randn(7))", "dim 0 must be the batch"),
    "a pytree batch tensor does not split": (
        "make_batch=lambda s, t, b: ({'input': torch.randn(b, 3), 'extra': torch.randn(2, b)}, torch.randn(b, 2)), "
        "build_model=lambda: Kw()", "dim 0 must be the batch"),
    "loss not a scalar": ("loss_fn=lambda out, y: (out - y) ** 2", "must return a floating scalar"),
    "loss of a dict output not a scalar": ("build_model=lambda: DictOut(), loss_fn=lambda out, y: out['y'] - y",
                                           "must return a floating scalar"),
    "unsupported optimizer class": ("optimizers=(torch.optim.Adam,)", "has no error model; use OptimizerSpec('sgd'"),
    "unsupported optimizer kind": ("optimizers=(OptimizerSpec('adam', lr=0.1),)", "has no error model; use"),
    "param group matches nothing": (
        "optimizers=(OptimizerSpec('sgd', lr=0.1, param_groups=(ParamGroup(('encoder.*',), lr=0.01),)),)",
        "matches no parameter"),
    "scheduler is not one": ("optimizers=(OptimizerSpec('sgd', lr=0.1, lr_scheduler=lambda opt: 3),)",
                             "not a torch.optim.lr_scheduler.LRScheduler"),
    "dropout in the forward": ("build_model=lambda: nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))",
                               "the forward draws random numbers (dropout?)"),
    "wrap path missing": ("wrap=('encoder',)", "is not a sub-module"),
    "wrap class missing": ("wrap=(nn.Conv2d,)", "match no sub-module"),
}


def _write_case(tmp_path, override: str) -> str:
    (tmp_path / "bad_case.py").write_text(f"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from cases.catalog import Case, OptimizerSpec, ParamGroup
from cases.data import regression_batch

class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return {{"y": self.fc(x)}}

class Kw(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, input, extra):
        return self.fc(input)

def make_case():
    kw = dict(name="bad", description="", build_model=lambda: nn.Linear(3, 2), wrap=(),
              make_batch=regression_batch(3, 2), loss_fn=F.mse_loss, optimizers=(OptimizerSpec("sgd", lr=0.1),))
    kw.update(dict({override}))
    return Case(**kw)
""")
    return f"{tmp_path / 'bad_case.py'}:make_case"


@pytest.mark.parametrize("mistake", sorted(_MISTAKES))
def test_a_mistake_in_a_users_case_is_exit_2_with_one_line_before_any_rank(tmp_path, mistake):
    override, message = _MISTAKES[mistake]
    _write_case(tmp_path, override)
    proc = _harness(["run", "--cases", f"{tmp_path / 'bad_case.py'}:make_case", "--impls", "ours",
                     "--world-sizes", "1", "--out", str(tmp_path / "out")], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "out" / "logs").exists()  # refused before any rank started


@pytest.mark.parametrize("mistake", ["dropout in the forward", "loss not a scalar", "wrap path missing", None])
def test_a_big_models_validation_in_a_child_process_says_what_the_parent_would(tmp_path, mistake):
    """From JUDGE_ON_RANKS_FROM parameters a user case is validated in a child process
    (harness/run/isolated.py), so that the parent holds no copy of a big model: the same message
    for each mistake, nothing for an honest case (None: the file's own case, unchanged)."""
    from cases.catalog import get_case
    from cases.user import validate_case
    from harness.run.isolated import validate_case_in_a_child

    spec = _write_case(tmp_path, _MISTAKES[mistake][0] if mistake else "")
    try:
        validate_case(get_case(spec), spec)
        here = None
    except ValueError as e:
        here = str(e)
    try:
        validate_case_in_a_child(spec)
        child = None
    except ValueError as e:
        child = str(e)
    if here is not None and child is not None:  # dropout's two losses are random draws in each process
        here, child = (re.sub(r"-?[0-9]+\.[0-9]+(e[-+]?[0-9]+)?", "<x>", m) for m in (here, child))
    assert child == here and (here is None) == (mistake is None), (here, child)


def test_a_case_file_that_does_not_load_is_exit_2_with_one_line(tmp_path):
    (tmp_path / "broken.py").write_text("def make_case(:\n")
    proc = _harness(["run", "--cases", f"{tmp_path / 'broken.py'}:make_case", "--impls", "ours",
                     "--world-sizes", "1", "--out", str(tmp_path / "out")], timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "SyntaxError" in proc.stderr
