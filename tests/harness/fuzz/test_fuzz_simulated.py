"""`python -m harness fuzz --backend simulated`: every example on simulated ranks at a W of its own,
drawn up to --world-size, on a simulated pool of that W ([Note: Fuzzing on simulated ranks],
harness/fuzz/simulated.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from harness.fuzz.strategies import world_sizes_up_to

REPO = Path(__file__).resolve().parents[3]


def _fuzz(*args: str, out: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "fuzz", "--backend", "simulated", *args, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@settings(max_examples=200, database=None)
@given(st.data())
def test_drawn_world_sizes_stay_in_range(data):
    top = data.draw(st.integers(1, 1024))
    assert 1 <= data.draw(world_sizes_up_to(top)) <= top


def test_world_sizes_are_drawn_per_octave_and_shrink_to_the_smallest_failing_one():
    from hypothesis import seed

    drawn = []

    @seed(0)
    @settings(max_examples=300, database=None)
    @given(world_sizes_up_to(1024))
    def draw(w):
        drawn.append(w)

    draw()
    octaves = {w.bit_length() for w in drawn}
    assert octaves == set(range(1, 12)), sorted(octaves)  # 1, 2-3, ..., 512-1023, 1024
    assert sum(w >= 512 for w in drawn) < len(drawn) / 4  # not a W of 400 on average: what costs, rarely
    assert find(world_sizes_up_to(1024), lambda w: w > 64, settings=settings(database=None)) == 65


def test_simulated_fuzzing_refuses_what_it_cannot_run_before_any_rank(tmp_path):
    for args, message in [(("--world-size", "2000"), r"between 1 and 1024 with --backend simulated"),
                          (("--pools", "2"), r"--pools=2 and --threads=1 must be 1"),
                          (("--impls", "fsdp2"), r"impl=fsdp2 cannot run on simulated ranks")]:
        proc = _fuzz(*args, out=tmp_path / "out", timeout=120)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert re.search(message, proc.stderr), (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.slow
def test_honest_examples_pass_at_world_sizes_drawn_up_to_32(tmp_path):
    proc = _fuzz("--world-size", "32", "--max-examples", "12", "--seed", "3", out=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[fuzz] simulated ranks, W drawn up to 32" in proc.stdout
    assert "PASS: 12 examples, none failing" in proc.stdout


@pytest.mark.slow
def test_a_fault_of_scale_passes_below_65_ranks_and_is_shrunk_to_w_65(tmp_path):
    """rank_index_in_6_bits (an all-gather placing rank r's block at r mod 64) acts only when
    W > 64: fuzzing up to W = 128 finds it and shrinks the model and its W to the smallest that
    shows it; the printed replay reproduces the failure, and at W = 64 the same model passes."""
    proc = _fuzz("--world-size", "128", "--max-examples", "30", "--faults", "rank_index_in_6_bits", out=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL: minimal failing model (W=65," in proc.stdout, proc.stdout[-3000:]
    spec = re.search(r"replay: python -m harness fuzz --world-size 65 --replay '(.*)' --backend simulated "
                     r"--faults rank_index_in_6_bits", proc.stdout).group(1)
    replay = _fuzz("--world-size", "65", "--replay", spec, "--faults", "rank_index_in_6_bits", out=tmp_path / "r65")
    assert replay.returncode == 1 and "[fuzz] replay: FAIL" in replay.stdout, replay.stdout[-2000:]
    at_64 = spec.replace('"world_size":65', '"world_size":64')
    below = _fuzz("--world-size", "64", "--replay", at_64, "--faults", "rank_index_in_6_bits", out=tmp_path / "r64")
    assert below.returncode == 0 and "[fuzz] replay: pass" in below.stdout, below.stdout[-2000:]


def test_the_default_example_timeout_grows_with_the_simulated_world_size():
    from harness.fuzz.main import default_example_timeout

    assert default_example_timeout(4, "gloo") == default_example_timeout(16, "gloo") == 60.0
    assert default_example_timeout(128, "simulated") == 60.0
    assert default_example_timeout(1024, "simulated") > 5 * 55  # a W = 1024 example measured about 55 s here


@pytest.mark.parametrize("stopped_says", ["SimulationAborted: another simulated rank failed", "collective failed"])
def test_a_simulated_example_fails_with_the_error_of_the_rank_that_failed_first(monkeypatch, stopped_says):
    """Rank 3 fails on its own while the others wait for it in a collective; they are stopped and
    fail too. The example's error is rank 3's alone, whatever the stopped ranks' errors say (an
    implementation may wrap SimulationAborted in its own message: the second case, which reading
    the class name out of the messages attributed to rank 0)."""
    import time

    import torch
    import torch.distributed as dist

    from harness.fuzz import worker
    from harness.fuzz.strategies import warm_up_spec

    spec = warm_up_spec(6)  # only its world size is read

    def serve(request, ctx, clock):
        if ctx.rank == 3:
            time.sleep(0.3)  # the others wait in the collective by now
            return {"error": "rank 3: ValueError: its own failure"}
        try:
            dist.all_reduce(torch.ones(1))
        except Exception:
            return {"error": f"rank {ctx.rank}: {stopped_says}"}
        return {"ok": True}

    monkeypatch.setattr(worker, "serve", serve)
    assert worker.run_simulated({"spec": spec.to_json()}) == {"error": "rank 3: ValueError: its own failure"}
