"""The real `python -m harness fuzz` CLI with a persistent torchrun pool (slow tier, W = 2)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


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
    # (Replaying the printed spec is covered in one process by tests/harness/fuzz/test_fuzz.py.)
    proc = _fuzz("--world-size", "2", "--max-examples", "10", "--faults", "grad_padding_garbage", out=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL: minimal failing model (W=2" in proc.stdout, proc.stdout
    assert re.search(r"first divergence: .* padding: .*\(padding\)", proc.stdout), proc.stdout
    spec = re.search(r"replay: python -m harness fuzz --world-size 2 --replay '(.*)' --faults grad_padding_garbage",
                     proc.stdout).group(1)
    from harness.fuzz.spec import ModelSpec

    assert ModelSpec.from_json(spec).world_size == 2


# The padding edges of a flat parameter at world size W: its aligned numel (parameters plus
# alignment gaps, what the shards divide) below W, one short of a multiple of W, one past it.
def _edges(w: int) -> dict[str, callable]:
    return {"numel < W": lambda n: 0 < n < w,
            "W*k - 1": lambda n: n > w and n % w == w - 1,
            "W*k + 1": lambda n: n > w and n % w == 1}


NUM_EXAMPLES = 16


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_honest_examples_through_the_rank_pool_pass_and_reach_every_padding_edge(tmp_path, world_size):
    from harness.fuzz.search import format_failure, fuzz
    from harness.fuzz.pool import PoolConfig, RankPool

    results = []
    with RankPool(PoolConfig(world_size, tmp_path / "logs", example_timeout_s=600.0)) as pool:
        stats = fuzz(pool, world_size, max_examples=NUM_EXAMPLES, seed=1,
                     on_example=lambda _, result: results.append(result))
    assert not stats.failures, format_failure(stats.failures[-1])
    assert len(results) == NUM_EXAMPLES and all(r.ok for r in results)
    for r in results:
        assert r.spec.world_size == world_size
        empty = [c for c in ("nonfinite", "init", "loss", "grad", "param") if not r.checks[c]["elements"] > 0]
        assert empty == [], (empty, r.spec.to_json())
    # What the drawn models covered, measured on the flat parameters the ranks built.
    numels = sorted({n for r in results for n in r.aligned_numels.values()})
    missed = [edge for edge, hit in _edges(world_size).items() if not any(hit(n) for n in numels)]
    assert missed == [], f"W={world_size}: no drawn flat parameter at {missed}; aligned numels seen: {numels}"
    assert any(r.checks["padding"]["elements"] > 0 for r in results)


PLUGINS = "tests/harness/adapters/test_harness_plugins.py"


@pytest.mark.slow
def test_a_rank_failing_at_exit_leaves_no_verdict_though_every_example_passed(tmp_path):
    # Rank 1 exits 3 after main() returned: every example's evidence came back and passed, yet the
    # launch did not end cleanly, so (as for the matrix) nothing of it is a PASS.
    proc = _fuzz("--world-size", "2", "--max-examples", "2", "--impls", f"{PLUGINS}:ExitNonZeroAtExitOnRank1",
                 out=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "[fuzz] ERROR: no verdict: the pool's ranks did not end cleanly after the last example" in out, out[-3000:]
    assert "torchrun exited 1 after the stop request" in out and "exitcode  : 3" in out, out[-3000:]
    assert "PASS" not in out and "2 examples (shrinking included)" in out, out[-3000:]


@pytest.mark.slow
def test_a_rank_hanging_at_exit_is_named_with_its_stack_and_killed(tmp_path):
    from harness.fuzz.check import run_example
    from harness.fuzz.strategies import warm_up_spec
    from harness.fuzz.pool import PoolConfig, PoolExitError, RankPool

    pool = RankPool(PoolConfig(2, tmp_path / "logs", exit_grace_s=3.0))
    pool.start()
    launch = pool._launch
    assert run_example(pool, warm_up_spec(2), (), f"{PLUGINS}:HangAtExitOnRank1").ok
    with pytest.raises(PoolExitError) as caught:
        pool.close()
    text = str(caught.value)
    assert "did not exit within 3 s of the stop request" in text and "[rank 1]" in text, text[-3000:]
    assert "_hang_at_exit" in text, text[-3000:]  # the stack faulthandler dumped
    assert launch.poll() is not None
    pool.close()  # a second close is a no-op


@pytest.mark.slow
def test_pools_side_by_side_train_an_example_to_the_same_bits_and_a_failure_restarts_its_own_pool(tmp_path):
    """Two pools of a group: the same example in each gives the same evidence bit for bit (so it
    does not matter which pool judges it); a rank raising in one pool errors that example alone,
    the other pool's example passes beside it, and the failed pool starts again for the next."""
    from harness.fuzz.check import finish_example, start_example
    from harness.fuzz.strategies import warm_up_spec
    from harness.fuzz.pool import PoolConfig, PoolGroup
    from harness.fuzz.spec import init_state
    from harness.judge.layouts import same_bits

    spec = warm_up_spec(2)
    request = {"spec": spec.to_json(), "faults": [], "init": init_state(spec), "impl": "ours"}
    with PoolGroup(PoolConfig(2, tmp_path / "logs", example_timeout_s=120.0), 2) as group:
        tickets = [group.submit(request), group.submit(request)]
        assert sorted(k for k, _ in tickets) == [0, 1]  # one in each pool
        a, b = (group.collect(t) for t in tickets)
        for rank in range(2):
            for key in ("init", "loss", "grads", "data"):
                flat_a, flat_b = torch_leaves(a[rank][key]), torch_leaves(b[rank][key])
                assert len(flat_a) == len(flat_b) > 0
                assert all(x.dtype == y.dtype and x.shape == y.shape and same_bits(x, y)
                           for x, y in zip(flat_a, flat_b)), (rank, key)
        raising = start_example(group, spec, (), f"{PLUGINS}:RaiseOnRank1")
        honest = start_example(group, spec, (), "ours")
        failed, passed = finish_example(raising), finish_example(honest)
        assert failed.error is not None and "planted failure: rank 1 raises" in failed.error, failed.error
        assert passed.ok, passed.summary()
        starts = group.num_starts
        again = [start_example(group, spec) for _ in range(2)]
        assert all(finish_example(s).ok for s in again)
        assert group.num_starts == starts + 1  # the failed pool alone started again


def torch_leaves(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in torch_leaves(value[k])]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in torch_leaves(v)]
    return []


@pytest.mark.slow
def test_the_cli_runs_pools_side_by_side_and_says_so(tmp_path):
    proc = _fuzz("--world-size", "2", "--max-examples", "6", "--pools", "2", "--seed", "2", out=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[fuzz] 2 pools of 2 ranks started" in proc.stdout, proc.stdout
    assert "6 examples (shrinking included)" in proc.stdout and "2 pool(s) side by side" in proc.stdout
    assert "PASS: 6 examples, none failing" in proc.stdout
    assert (tmp_path / "logs" / "pool-0").is_dir() and (tmp_path / "logs" / "pool1-0").is_dir()
    # the figures the lines print, unrounded, for the bench (harness/bench/main.py fuzz_rate)
    stats = json.loads((tmp_path / "fuzz_stats.json").read_text())
    assert (stats["examples"], stats["pools"], stats["world_size"], stats["failures"]) == (6, 2, 2, 0)
    assert f"in {stats['wall_s']:.1f}s = {stats['examples_per_s']:.1f} examples/s" in proc.stdout
