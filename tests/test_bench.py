"""`python -m harness bench` runs end to end on a tiny model (slow tier). Benchmarks are never
timed assertions: this only checks that every figure is produced and well-formed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_smoke_writes_every_figure(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "bench", "--smoke", "--no-throughput", "--out", str(tmp_path),
         "--speed-world-sizes", "2", "--memory-world-sizes", "1,2"],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    (speed,) = result["speed"]
    for key in ("step_time_ratio_vs_fsdp2", "cpu_time_ratio_vs_fsdp2", "comm_bytes_ratio_vs_theory",
                "comm_bytes_ratio_vs_fsdp2"):
        assert speed[key] > 0, key
    # The unsharded reference steps in the same ranks and communicates nothing.
    assert speed["step_time_s"]["plain"] > 0 and speed["cpu_time_s"]["plain"] > 0
    assert speed["comm"]["plain"]["bytes"] == {}
    # FULL_SHARD on this model: the counted collective bytes equal the theoretical volume.
    assert speed["comm"]["ours"]["bytes"] == speed["theory_bytes"]
    assert [m["world_size"] for m in result["memory"]] == [1, 2] and result["medium"] == []
    for m in result["memory"]:
        w, ours = m["world_size"], m["ours"]
        for name in ("ours", "fsdp2"):
            assert sum(m[name]["peak_by_category"].values()) == m[name]["peak_bytes"] > 0, (name, m)
            assert m[name]["peak_ratio_vs_ideal"] == m[name]["peak_bytes"] / m["ideal_bytes"], (name, m)
        # The tracker's own accounting, against what is known exactly: this rank's 1/W of every
        # padded flat parameter, and AdamW's two moments of the same size plus one fp32 step count
        # per flat parameter, are live at the peak.
        params = ours["peak_by_category"]["parameters"]
        assert params * w == 4 * ours["padded_numel"], m
        assert ours["peak_by_category"]["optimizer state"] == 2 * params + 4 * ours["num_flat_params"], m
        assert ours["sharded_param_bytes"] == ours["peak_by_category"]["parameters"], m
        assert ours["init_peak_bytes"] >= ours["sharded_param_bytes"], m
        # The RSS of ours measured again with an allocator that returns frees (a second launch).
        assert ours["peak_rss_growth_returning_bytes"] > 0, m
    assert "step_time_ratio_vs_fsdp2" in (tmp_path / "bench.md").read_text()


def test_bench_rejects_bad_world_sizes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness", "bench", "--speed-world-sizes", "0", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "world_size=0" in proc.stderr


def test_bench_only_refuses_an_unknown_part_before_any_launch(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness", "bench", "--only", "speed,memroy", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["harness bench: error: bench parts ['memroy']: choose from speed, "
                                                "memory, medium, throughput"]
    assert not (tmp_path / "bench.json").exists()


def test_a_partial_bench_names_its_parts_in_the_command_it_prints():
    from harness.bench.main import render_markdown

    result = {"environment": {"cpu_count": 2, "machine": "x86_64", "torch": "2.13.0", "backend": "gloo",
                              "threads_per_rank": 1, "smoke": False, "parts": ["throughput"],
                              "load_average_at_start": 1.5},
              "speed": [], "memory": [], "medium": [],
              "throughput": {"bare_launch_floor_s": 40.0, "batched_s": 60.0, "per_cell_s": 200.0,
                             "batched_ratio_vs_floor": 1.5, "per_cell_ratio_vs_batched": 200 / 60, "matrix": "m"}}
    text = render_markdown(result)
    assert "`python -m harness bench --only throughput`" in text and "load average 1.5" in text
    assert "Step time" not in text and "| batched: one torchrun for every world size |" in text
