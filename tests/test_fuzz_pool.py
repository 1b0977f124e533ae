"""The real `python -m harness fuzz` CLI with a persistent torchrun pool (slow tier, W = 2)."""

from __future__ import annotations

import re
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
def test_planted_fault_fails_and_prints_a_shrunk_replayable_model(tmp_path):
    # (Replaying the printed spec is covered in one process by tests/test_fuzz.py.)
    proc = _fuzz("--world-size", "2", "--max-examples", "10", "--faults", "grad_padding_garbage", out=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL: minimal failing model (W=2" in proc.stdout, proc.stdout
    assert re.search(r"first divergence: .* padding: .*\(padding\)", proc.stdout), proc.stdout
    spec = re.search(r"replay: python -m harness fuzz --world-size 2 --replay '(.*)' --faults grad_padding_garbage",
                     proc.stdout).group(1)
    from harness.fuzz_spec import ModelSpec

    assert ModelSpec.from_json(spec).world_size == 2
