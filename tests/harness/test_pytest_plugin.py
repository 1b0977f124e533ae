"""The pytest plugin (harness/pytest_plugin.py) used the way a user's suite uses it.

fast: pyproject declares the `pytest11` entry point; a failing summary renders as its first
divergences, a refused run as the harness's one line.
slow: a user's suite of two tests in a temporary directory, run by pytest under xdist (-n 2) in a
subprocess: ours passes; the planted-bug twin (ours with every reduced gradient 1e-5 too large,
loaded from the suite's own adapter file) fails with its first divergence and no traceback; the two
harness runs go side by side without port or directory collisions.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from harness.pytest_plugin import _failure_text

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_declares_the_pytest11_entry_point():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"fsdp_equivalence": "harness.pytest_plugin"}


def test_a_failing_summary_shows_each_first_divergence_and_a_refusal_its_one_line():
    summary = {"cells": [
        {"cell_id": "mlp.x.w2.split", "verdict": "fail", "first_divergence_text": "mlp.x.w2.split step=1 grad: 'w'"},
        {"cell_id": "mlp.x.w4.split", "verdict": "error", "first_divergence_text": None, "error": "rank 1 died\n..."},
        {"cell_id": "mlp.x.w1.split", "verdict": "pass", "first_divergence_text": None},
    ]}
    text = _failure_text("mlp", "x.py:X", 1, "", summary)
    assert text.splitlines() == ["fsdp_equivalence(case='mlp', impl='x.py:X'): 2 of 3 cells not equivalent",
                                 "  FAIL mlp.x.w2.split step=1 grad: 'w'", "  ERROR mlp.x.w4.split: rank 1 died"]
    refused = _failure_text("mlp", "nope", 2, "error: unknown impl 'nope'; built-in: [...]\n", None)
    assert refused == "fsdp_equivalence(case='mlp', impl='nope'): harness exit 2: error: unknown impl 'nope'; built-in: [...]"


SUITE = '''
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_ours_is_equivalent(fsdp_equivalence):
    summary = fsdp_equivalence(case="mlp", impl="ours", world_sizes=(1, 2), data=("split",), steps=2)
    assert summary["verdict"] == "pass"


def test_planted_bug_twin(fsdp_equivalence):
    fsdp_equivalence(case="mlp", impl=f"{HERE / 'buggy.py'}:ScaledGradients", world_sizes=(1, 2),
                     data=("split",), steps=2)
'''

BUGGY = '''
from dataclasses import replace

from harness.adapters import Ours


class ScaledGradients(Ours):
    """ours, except every reduced gradient is 1e-5 too large."""

    name = "scaled_gradients"

    def wrap(self, model, wrap_paths, ctx):
        return super().wrap(model, wrap_paths, replace(ctx, faults=ctx.faults | {"grad_scale_1e-5"}))
'''


def _plugin_args() -> list[str]:
    """`-p harness.pytest_plugin` unless the installed entry point already loads it."""
    installed = any(ep.value == "harness.pytest_plugin" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "harness.pytest_plugin"]


@pytest.mark.slow
def test_a_users_suite_under_xdist_passes_the_honest_test_and_fails_the_planted_twin(tmp_path):
    suite = tmp_path / "user_suite"
    suite.mkdir()
    (suite / "test_equivalence.py").write_text(textwrap.dedent(SUITE))
    (suite / "buggy.py").write_text(textwrap.dedent(BUGGY))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *_plugin_args(), "-n", "2", "-q", "-p", "no:cacheprovider",
         str(suite)],
        cwd=suite, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=2400)
    out = proc.stdout
    assert proc.returncode == 1, out[-4000:]
    assert "1 failed, 1 passed" in out, out[-4000:]
    assert "test_planted_bug_twin" in out and "test_ours_is_equivalent" not in out.split("short test summary")[-1]
    # The failure is the harness's first divergence of the buggy cell, not a traceback.
    assert "fsdp_equivalence(case='mlp', impl=" in out and "1 of 2 cells not equivalent" in out, out[-4000:]
    assert "FAIL mlp.scaled_gradients.w2.split optimizer=" in out and " grad: " in out, out[-4000:]
    assert "Traceback" not in out and "def check(" not in out, out[-4000:]
