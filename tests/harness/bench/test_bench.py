"""`python -m harness bench` runs end to end on a tiny model (slow tier). Benchmarks are never
timed assertions: this only checks that every figure is produced and well-formed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
        # padded flat parameter, and AdamW's two moments of each parameter's piece of it (padding
        # excluded) plus one fp32 step count per piece, are live at the peak.
        params = ours["peak_by_category"]["parameters"]
        assert params * w == 4 * ours["padded_numel"], m
        assert ours["peak_by_category"]["optimizer state"] == 2 * 4 * ours["piece_numel"] + 4 * ours["num_pieces"], m
        assert ours["sharded_param_bytes"] == ours["peak_by_category"]["parameters"], m
        assert ours["init_peak_bytes"] >= ours["sharded_param_bytes"], m
        # The RSS of ours measured again with an allocator that returns frees (a second launch).
        assert ours["peak_rss_growth_returning_bytes"] > 0, m
    assert "step_time_ratio_vs_fsdp2" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("flag", ["--speed-world-sizes", "--memory-world-sizes", "--verify-world-sizes"])
def test_bench_rejects_bad_world_sizes_naming_the_flag(tmp_path, flag):
    proc = subprocess.run([sys.executable, "-m", "harness", "bench", flag, "0", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"harness bench: error: {flag}: world_size=0 must be >= 1"], proc.stderr


def test_bench_only_refuses_an_unknown_part_before_any_launch(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness", "bench", "--only", "speed,memroy", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["harness bench: error: bench parts ['memroy']: choose from speed, "
                                                "memory, medium, throughput, verify-cost"]
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


def test_the_bench_reads_the_fuzzers_figures_and_bounds_the_rates_by_them(tmp_path):
    """The figures the fuzzer prints are the ones it writes for the bench (harness/fuzz/search.py
    write_stats; the bench reads the file, not the lines), and the bounds are cores / CPU: the
    matrix's CPU over the cores against its wall time and the floor, examples/s at most cores / CPU
    per example."""
    from harness.bench.main import render_markdown
    from harness.fuzz.search import STATS_FILE, FuzzStats, cpu_line, write_stats

    stats = FuzzStats(num_examples=40, cpu_s=1.2, ranks_cpu_s=8.4)  # 30 + 210 ms per example
    line = cpu_line(stats, 4, 2)
    assert line.startswith("[fuzz] CPU per example: 240 ms (30 ms here, 210 ms in the 4 ranks)"), line
    assert line.endswith("on 2 cores at most 8.3 examples/s")
    write_stats(tmp_path, "ours", 4, stats, 7.0, 7.0, 1)
    figures = json.loads((tmp_path / STATS_FILE).read_text())
    assert [figures[k] for k in ("cpu_ms", "parent_cpu_ms", "ranks_cpu_ms")] == pytest.approx([240.0, 30.0, 210.0])
    assert (figures["examples"], figures["world_size"], figures["pools"]) == (40, 4, 1)

    throughput = {"bare_launch_floor_s": 30.0, "batched_s": 45.0, "per_cell_s": 270.0, "batched_ratio_vs_floor": 1.5,
                  "per_cell_ratio_vs_batched": 6.0, "matrix": "m", "cores": 2, "floor_cpu_s": 40.0,
                  "batched_cpu_s": 84.0, "per_cell_cpu_s": 500.0, "fuzz_world_size": 4, "fuzz_examples": 40,
                  "fuzz_s": 7.0, "fuzz_examples_per_s": 5.7, "fuzz_start_up_s": 7.0, "fuzz_example_ms": 175.0,
                  "fuzz_ranks_ms": 150.0, "all_gather_ms": 3.3, "reduce_scatter_ms": 5.9, "fuzz_cpu_ms": 240.0,
                  "fuzz_parent_cpu_ms": 30.0, "fuzz_ranks_cpu_ms": 210.0}
    text = render_markdown({"environment": {"cpu_count": 2, "machine": "x86_64", "torch": "2.13.0", "backend": "gloo",
                                            "threads_per_rank": 1, "smoke": False, "parts": ["throughput"],
                                            "load_average_at_start": 1.0},
                            "speed": [], "memory": [], "medium": [], "throughput": throughput})
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ")}
    assert rows["matrix: m"] == ["wall s", "x floor", "CPU s"]
    assert rows["batched: one torchrun for every world size"] == ["45.0", "1.50", "84.0"]
    assert rows["bare torchrun per world size (floor)"] == ["30.0", "1.00", "40.0"]
    # 84 s of CPU on 2 cores: at least 42 s, 1.40x the 30 s floor; 45 s is 1.07x that bound
    assert "less than 42.0 s, 1.40x the floor; its wall time is 1.07x that bound" in text
    assert "no schedule runs more than 8.3 examples/s" in text


def test_verify_cost_is_a_part_only_when_named_and_renders_its_ratio_disk_and_rss():
    from harness.bench.main import PARTS, BenchConfig, render_markdown

    assert "verify-cost" not in PARTS and BenchConfig(Path("."), parts=("verify-cost",)).parts == ("verify-cost",)
    row = {"case": "tests/data/gpt2_sizes.py:d256", "parameters": 5_273_088, "world_size": 2, "training_wall_s": 22.0,
           "harness_wall_s": 64.0, "ratio": 64 / 22, "output_bytes": 3 * 2**20, "training_peak_rss_bytes": 2**29,
           "harness_peak_rss_bytes": 2**30, "parent_peak_rss_bytes": 2**28}
    env = {"cpu_count": 2, "machine": "x86_64", "torch": "2.13.0", "backend": "gloo", "threads_per_rank": 1,
           "smoke": False, "parts": ["verify-cost"]}
    text = render_markdown({"environment": env, "speed": [], "memory": [], "medium": [], "verify_cost": [row]})
    assert "--only verify-cost" in text
    row = next(line for line in text.splitlines() if line.startswith("| d256"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["d256", "5.3M", "2", "22 s", "64 s", "2.9x", "3", "512", "1024", "256"], text


def test_the_run_s_own_peak_rss_is_its_own_not_the_launching_process_s():
    """Linux carries a process's maxrss across execve: a `harness run` started from a process that
    held 700 MB reported them as its own peak (RUSAGE_SELF). The figure is the run's address
    space's high-water mark."""
    import subprocess
    import sys

    from harness.bench.main import _PEAK_RSS_OF_RUN

    held = bytearray(700 << 20)
    for i in range(0, len(held), 4096):
        held[i] = 1
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS_OF_RUN, "--help"], capture_output=True, text=True,
                         timeout=120).stdout.strip().splitlines()[-1]
    own, _, rc = (int(x) for x in out.split())
    del held
    assert rc == 0 and 0 < own < 300 << 20


def test_a_rank_s_peak_rss_is_its_own_not_the_agent_s():
    """The bench's ranks report their own peak (harness/bench/rss.py `own_peak_rss_bytes`), not the
    memory of the process they were forked from before their execve (torchrun's agent)."""
    import subprocess
    import sys

    held = bytearray(900 << 20)
    for i in range(0, len(held), 4096):
        held[i] = 1
    code = ("from harness.bench.rss import own_peak_rss_bytes\n"
            "before = own_peak_rss_bytes()\n"
            "grown = bytearray(200 << 20)\n"
            "for i in range(0, len(grown), 4096):\n"
            "    grown[i] = 1\n"
            "print(before, own_peak_rss_bytes())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    del held
    before, after = (int(x) for x in out.stdout.split())
    assert before < 800 << 20  # the interpreter, not the 900 MB held by the launching process
    assert after - before >= 190 << 20  # and it follows the rank's own growth
