"""The real `python -m harness fuzz` CLI with a persistent torchrun pool (slow tier, W = 2)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _fuzz(*args: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "fuzz", *args, "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_honest_fuzz_passes_and_prints_the_rate(tmp_path):
    proc = _fuzz("--world-size", "2", "--max-examples", "5", "--seed", "1", out=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"5 examples .* = [0-9.]+ examples/s; pool start-up", proc.stdout), proc.stdout
    assert "PASS: 5 examples, none failing" in proc.stdout


@pytest.mark.slow
def test_planted_fault_fails_shrinks_and_replays(tmp_path):
    proc = _fuzz("--world-size", "2", "--max-examples", "10", "--faults", "grad_padding_garbage", out=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL: minimal failing model (W=2" in proc.stdout, proc.stdout
    replay = re.search(r"replay: (python -m harness fuzz .*)", proc.stdout).group(1)
    args = shlex.split(replay)[3:]  # after 'python -m harness'
    again = subprocess.run([sys.executable, "-m", "harness", *args, "--out", str(tmp_path / "replay")], cwd=REPO,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 1 and "replay: FAIL" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert "padding" in again.stdout  # the exact padding check names the broken shard
