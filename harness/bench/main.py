"""`python -m harness bench`: step time, communication, memory and harness throughput.

Every figure is a ratio measured side by side in one run (these machines are shared and noisy):
ours vs torch FSDP2 interleaved in the same ranks, bytes counted at the c10d calls for both,
memory against total / W and against an ideal peak, and the batched harness against a bare
torchrun per world size and against one torchrun per cell.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from harness.bench import live_memory
from harness.run.launch import Launch, TorchrunSpec
from harness.run.plan import usable_cores
from harness.run.snapshot import write_atomic_text

REPO_ROOT = Path(__file__).resolve().parents[2]
# The seeds' figures for GPT-2 medium (they count 505M parameters): fp32 parameters per GPU
# (shared/seeds/000) and, with meta-device init, the peak per device (shared/seeds/004).
SEED_PARAM_MB = {1: 2020, 8: 253}
SEED_PEAK_MB = {1: 737.84, 8: 187.65}
# What one bench run measures, in this order (`--only` picks a subset; each part is its own launches).
PARTS = ("speed", "memory", "medium", "throughput")
# Parts run only when named in --only (minutes per model).
OPTIONAL_PARTS = ("verify-cost",)
# The verify-cost part's model series (GPT-2 shapes, tests/data/gpt2_sizes.py) and its cells.
VERIFY_COST_MODULE = "tests/data/gpt2_sizes.py"
VERIFY_COST_SIZES = ("d128", "d256", "d384", "small")
VERIFY_COST_CASES = tuple(f"{VERIFY_COST_MODULE}:{size}" for size in ("d128", "d256", "d384"))
VERIFY_COST_WORLD_SIZES = (2,)


@dataclass(frozen=True)
class BenchConfig:
    out_dir: Path
    speed_world_sizes: tuple[int, ...] = (2, 4)
    memory_world_sizes: tuple[int, ...] = (1, 2, 4, 8)
    iters: int = 10
    threads: int = 1
    parts: tuple[str, ...] = PARTS
    timeout_s: float = 1200.0
    smoke: bool = False  # a tiny model and one iteration: checks that bench runs, measures nothing
    medium_world_sizes: tuple[int, ...] = (1, 2, 4, 8)  # GPT-2 medium, ours only (not in a smoke run)
    verify_cases: tuple[str, ...] = VERIFY_COST_CASES
    verify_world_sizes: tuple[int, ...] = VERIFY_COST_WORLD_SIZES

    def __post_init__(self) -> None:
        unknown = sorted(set(self.parts) - set(PARTS) - set(OPTIONAL_PARTS))
        if unknown or not self.parts:
            raise ValueError(f"bench parts {unknown or '(none)'}: choose from {', '.join(PARTS + OPTIONAL_PARTS)}")
        sizes = [c.rsplit(":", 1)[-1] for c in self.verify_cases]
        if not sizes or any(s not in VERIFY_COST_SIZES for s in sizes):
            raise ValueError(f"--verify-sizes {','.join(sizes) or '(none)'}: choose from {', '.join(VERIFY_COST_SIZES)}")
        if self.iters < 1:
            raise ValueError(f"iters={self.iters} must be >= 1")
        bad = [w for w in (*self.speed_world_sizes, *self.memory_world_sizes, *self.medium_world_sizes,
                           *self.verify_world_sizes) if w < 1]
        if bad:
            raise ValueError(f"world sizes {bad} must be >= 1")


class BenchError(RuntimeError):
    pass


def torchrun(world_size: int, args: list[str], threads: int, timeout_s: float, log_dir: Path,
             extra_env: dict[str, str] | None = None) -> float:
    """Run `python -m <args>` in `world_size` ranks (harness/run/launch.py); return wall seconds;
    raise BenchError with the ranks' tracebacks (their stacks on timeout) on failure."""
    spec = TorchrunSpec(world_size, args[0], tuple(args[1:]), log_dir, timeout_s, threads,
                        extra_env=tuple(sorted((extra_env or {}).items())))
    result = Launch(spec).run()
    if not result.ok:
        raise BenchError(f"bench launch {' '.join(args[:2])}: {result.failure_text()}")
    return result.wall_s


def run_bench(cfg: BenchConfig, progress=print) -> dict:
    """Every measurement, then bench.json and bench.md in cfg.out_dir. The launches' own files
    live in a temporary directory, removed after a run that succeeds and named by the error of
    one that does not."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="harness-bench-"))
    try:
        result = _measure(cfg, work, progress)
    except BenchError as e:
        raise BenchError(f"{e}\n(launch logs kept in {work})") from e
    shutil.rmtree(work, ignore_errors=True)
    write_outputs(result, cfg.out_dir)
    return result


def _measure(cfg: BenchConfig, work: Path, progress) -> dict:
    result: dict = {"environment": environment(cfg), "speed": [], "memory": [], "medium": []}
    smoke = ["--iters", "1", "--warmup", "0", "--smoke"] if cfg.smoke else ["--iters", str(cfg.iters)]
    for w in cfg.speed_world_sizes if "speed" in cfg.parts else ():
        progress(f"bench: step time and communication, ours vs fsdp2, W={w}")
        out = work / f"speed_w{w}.json"
        torchrun(w, ["harness.bench.worker", "speed", "--out", str(out), "--threads", str(cfg.threads), *smoke],
                 cfg.threads, cfg.timeout_s, work / f"speed_w{w}")
        result["speed"].extend(json.loads(out.read_text())["ranks"][0]["sizes"])
    config = "smoke" if cfg.smoke else "gpt2-small"
    for w in cfg.memory_world_sizes if "memory" in cfg.parts else ():
        progress(f"bench: live-tensor memory of the {config}-shaped model, plain / ours / fsdp2, W={w}")
        result["memory"].append(memory_row(cfg, work, config, w, ("ours", "fsdp2"), rss_returning_impls=("ours",)))
    for w in () if cfg.smoke or "medium" not in cfg.parts else cfg.medium_world_sizes:
        progress(f"bench: live-tensor memory of the gpt2-medium-shaped model, plain / ours, W={w}")
        result["medium"].append(memory_row(cfg, work, "gpt2-medium", w, ("ours",)))
    if "throughput" in cfg.parts and not cfg.smoke:
        progress("bench: harness throughput (batched matrix vs bare launches vs one launch per cell)")
        result["throughput"] = harness_throughput(cfg, work)
    if "verify-cost" in cfg.parts:
        result["verify_cost"] = [verify_cost(cfg, work, case, w, progress)
                                 for case in cfg.verify_cases for w in cfg.verify_world_sizes]
    return result


# `harness run` in this process (the parent), then its own peak RSS, the largest of its descendants'
# (RUSAGE_CHILDREN: torchrun and the ranks, each waited for), and its exit code. Its own is its
# own (harness/bench/rss.py: not the bench's memory at the fork); a descendant's maxrss carries the
# harness's at its fork, below any rank's own.
_PEAK_RSS_OF_RUN = ("import resource, runpy, sys\n"
                    "from harness.bench.rss import own_peak_rss_bytes\n"
                    "sys.argv = ['harness', *sys.argv[1:]]\n"
                    "try:\n"
                    "    runpy.run_module('harness', run_name='__main__')\n"
                    "    rc = 0\n"
                    "except SystemExit as e:\n"
                    "    rc = e.code if isinstance(e.code, int) else 1\n"
                    "print(own_peak_rss_bytes(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, rc)\n")


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def verify_cost(cfg: BenchConfig, work: Path, case: str, w: int, progress) -> dict:
    """One model of the series at W ranks: the implementation alone training the cells `harness run`
    verifies (the plain model in one rank, then ours at W ranks, launches and imports included),
    then `harness run` verifying them; wall times side by side, the run's output directory, the
    peak RSS of the largest process of each (RUSAGE_CHILDREN: the largest of every process waited
    for) and of the harness's own process (the parent, which holds summaries only)."""
    tag = f"{case.rsplit(':', 1)[-1]}_w{w}"
    progress(f"bench: verify cost of {case}: training alone (plain W=1, ours W={w}), then harness run")
    train = {}
    for impl, ranks in (("plain", 1), ("ours", w)):
        out = work / f"train_{tag}_{impl}.json"
        wall = torchrun(ranks, ["harness.bench.worker", "train", "--case", case, "--impl", impl, "--data", "split",
                                "--out", str(out)], cfg.threads, cfg.timeout_s, work / f"train_{tag}_{impl}")
        ranks_out = json.loads(out.read_text())["ranks"]
        train[impl] = {"wall_s": wall, "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks_out)}
    out_dir = work / f"verify_{tag}"
    cmd = [sys.executable, "-c", _PEAK_RSS_OF_RUN, "run", "--cases", case, "--impls", "ours", "--world-sizes", str(w),
           "--data", "split", "--quiet", "--out", str(out_dir)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=cfg.timeout_s * 4)
    wall = time.monotonic() - start
    parent_rss, rss, rc = (int(x) for x in proc.stdout.strip().splitlines()[-1].split())
    if rc != 0:
        raise BenchError(f"harness run --cases {case} exited {rc}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    from harness.run.plan import num_parameters

    params = num_parameters(case)  # on the meta device: this process's memory is the next run's at its fork
    training_wall = train["plain"]["wall_s"] + train["ours"]["wall_s"]
    return {"case": case, "parameters": params, "world_size": w, "training_wall_s": training_wall,
            "harness_wall_s": wall, "ratio": wall / training_wall, "output_bytes": _dir_bytes(out_dir),
            "training_peak_rss_bytes": max(t["peak_rss_bytes"] for t in train.values()),
            "harness_peak_rss_bytes": max(rss, parent_rss), "parent_peak_rss_bytes": parent_rss}


# glibc serves allocations below a threshold it raises up to 32 MiB as blocks are freed from its
# heap, where freed memory stays resident; at a fixed 128 KiB every larger block is mapped on its
# own and unmapped when freed, so RSS follows live tensors (the RSS columns of bench.md).
RETURNING_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _memory_launch(cfg: BenchConfig, work: Path, config: str, impl: str, world_size: int,
                   as_world_size: int = 1, extra_env: dict[str, str] | None = None) -> list[dict]:
    tag = "_mmap" if extra_env else ""
    out = work / f"memory_{config}_{impl}_w{world_size}_as{as_world_size}{tag}.json"
    torchrun(world_size, ["harness.bench.worker", "memory", "--out", str(out), "--threads", str(cfg.threads),
                          "--impl", impl, "--config", config, "--as-world-size", str(as_world_size)],
             cfg.threads, cfg.timeout_s, out.with_suffix(""), extra_env)
    return json.loads(out.read_text())["ranks"]


def memory_row(cfg: BenchConfig, work: Path, config: str, world_size: int, impls: tuple[str, ...],
               rss_returning_impls: tuple[str, ...] = ()) -> dict:
    """One world size: the ideal from the plain model, then each implementation's peak per rank.

    ideal = max over the plain model's step (on this W's per-rank batch) of live bytes with
    parameters, gradients and optimizer state divided by W, plus (W > 1) one unit unsharded: its
    parameters and its gradient, for the largest unit. Each launch runs alone: two implementations
    never share the machine's memory. The implementations in `rss_returning_impls` run once more
    with an allocator that returns freed blocks (RETURNING_ALLOCATOR_ENV), for their RSS only.
    """
    (plain,) = _memory_launch(cfg, work, config, "plain", 1, as_world_size=world_size)
    row = {"world_size": world_size, "config": config, "model": plain["model"], "num_params": plain["num_params"],
           "full_param_bytes": 4 * plain["num_params"],
           "plain_weighted_peak_bytes": plain["ideal_before_unsharded_unit"]["weighted_bytes"]}
    for name in impls:
        ranks = _memory_launch(cfg, work, config, name, world_size)
        worst = max(ranks, key=lambda r: r["peak"]["total_bytes"])
        row[name] = {
            "peak_bytes": worst["peak"]["total_bytes"],
            "peak_phase": worst["peak"]["phase"],
            "peak_by_category": worst["peak"]["by_category"],
            "largest_at_peak": worst["largest_at_peak"],
            "init_peak_bytes": max(r["init_peak"]["total_bytes"] for r in ranks),
            "sharded_param_bytes": max(r["sharded_param_bytes"] for r in ranks),
            "peak_rss_growth_bytes": max(r["peak_rss_growth_bytes"] for r in ranks),
        }
        if name in rss_returning_impls:
            returning = _memory_launch(cfg, work, config, name, world_size, extra_env=RETURNING_ALLOCATOR_ENV)
            row[name]["peak_rss_growth_returning_bytes"] = max(r["peak_rss_growth_bytes"] for r in returning)
        if name == "ours":
            row["largest_unit_bytes"] = ranks[0]["largest_unit_bytes"]
            row["ours"]["padded_numel"] = ranks[0]["padded_numel"]
            row["ours"]["num_flat_params"] = ranks[0]["num_flat_params"]
            row["ours"]["piece_numel"], row["ours"]["num_pieces"] = worst["piece_numel"], worst["num_pieces"]
    unsharded_unit = 2 * row["largest_unit_bytes"] if world_size > 1 else 0
    row["ideal_bytes"] = row["plain_weighted_peak_bytes"] + unsharded_unit
    for name in impls:
        row[name]["peak_ratio_vs_ideal"] = row[name]["peak_bytes"] / row["ideal_bytes"]
    return row


def _children_cpu_s() -> float:
    """CPU seconds of every child process this one has waited for (and of theirs: torchrun waits
    for its ranks), user and system."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def harness_throughput(cfg: BenchConfig, work: Path) -> dict:
    """Wall time of the standard matrix, batched (one torchrun for every world size) and one torchrun
    per cell, against the floor: one bare torchrun launch per world size; and the CPU time each
    took, every process of it (the batched run's CPU over the cores is a wall time no schedule beats)."""
    world_sizes = (1, 2, 4, 8)
    cpu = _children_cpu_s()
    floor = sum(torchrun(w, ["harness.bench.worker", "bare", "--out", str(work / f"bare{w}.json")],
                         cfg.threads, cfg.timeout_s, work / f"bare{w}") for w in world_sizes)
    cpus = {"floor": _children_cpu_s() - cpu}
    walls = {}
    for label, extra in (("batched", []), ("per_cell", ["--launch-per-cell"])):
        cmd = [sys.executable, "-m", "harness", "run", "--cases", "mlp,transformer", "--impls", "ours,fsdp2",
               "--world-sizes", ",".join(map(str, world_sizes)), "--data", "identical,split",
               "--out", str(work / f"matrix_{label}"), "--quiet", *extra]
        start, cpu = time.monotonic(), _children_cpu_s()
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=cfg.timeout_s * 4)
        walls[label] = time.monotonic() - start
        cpus[label] = _children_cpu_s() - cpu
        if proc.returncode != 0:
            raise BenchError(f"harness run ({label}) exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return {
        **fuzz_rate(cfg, work),
        "matrix": "mlp,transformer x ours,fsdp2 x W=1,2,4,8 x identical,split (32 cells)",
        "bare_launch_floor_s": floor,
        "batched_s": walls["batched"],
        "per_cell_s": walls["per_cell"],
        "batched_ratio_vs_floor": walls["batched"] / floor,
        "per_cell_ratio_vs_batched": walls["per_cell"] / walls["batched"],
        "cores": usable_cores(),
        "floor_cpu_s": cpus["floor"],
        "batched_cpu_s": cpus["batched"],
        "per_cell_cpu_s": cpus["per_cell"],
    }


FUZZ_WORLD_SIZE = 4
FUZZ_EXAMPLES = 200  # enough for `--pools auto` to run pools side by side (harness/fuzz/main.py)
def fuzz_rate(cfg: BenchConfig, work: Path) -> dict:
    """`python -m harness fuzz` at W = FUZZ_WORLD_SIZE, as a user runs it: examples per second
    after the pool's start-up (the line the fuzzer prints), the start-up itself, the ranks' share
    of an example, and what one gloo all-gather and reduce-scatter of a fuzz-sized flat parameter
    costs at that world size (a launch of its own): the floor an example's collectives put under it."""
    cmd = [sys.executable, "-m", "harness", "fuzz", "--world-size", str(FUZZ_WORLD_SIZE), "--max-examples",
           str(FUZZ_EXAMPLES), "--threads", str(cfg.threads), "--out", str(work / "fuzz")]
    from harness.fuzz.search import STATS_FILE

    stats_file = work / "fuzz" / STATS_FILE
    stats_file.unlink(missing_ok=True)
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=cfg.timeout_s)
    if proc.returncode != 0 or not stats_file.is_file():
        raise BenchError(f"harness fuzz exited {proc.returncode} without its statistics ({stats_file}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    fuzz = json.loads(stats_file.read_text())
    torchrun(FUZZ_WORLD_SIZE, ["harness.bench.worker", "collectives", "--iters", "200",
                               "--out", str(work / "collectives.json")], cfg.threads, cfg.timeout_s, work / "collectives")
    ranks = json.loads((work / "collectives.json").read_text())["ranks"]
    return {"fuzz_world_size": fuzz["world_size"], "fuzz_examples": fuzz["examples"], "fuzz_s": fuzz["wall_s"],
            "fuzz_examples_per_s": fuzz["examples_per_s"], "fuzz_start_up_s": fuzz["start_up_s"],
            "fuzz_pools": fuzz["pools"], "fuzz_example_ms": fuzz["example_ms"], "fuzz_ranks_ms": fuzz["ranks_ms"],
            "fuzz_cpu_ms": fuzz["cpu_ms"], "fuzz_parent_cpu_ms": fuzz["parent_cpu_ms"],
            "fuzz_ranks_cpu_ms": fuzz["ranks_cpu_ms"],
            "all_gather_ms": 1e3 * max(r["all_gather_s"] for r in ranks),
            "reduce_scatter_ms": 1e3 * max(r["reduce_scatter_s"] for r in ranks)}


def environment(cfg: BenchConfig) -> dict:
    import torch

    from harness.report.environment import environment as report_environment

    return {
        "torch": torch.__version__,
        "backend": "gloo",
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "threads_per_rank": cfg.threads,
        "parts": list(cfg.parts),
        # A shared machine's other load skews wall times (ratios taken side by side much less): say it.
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "smoke": cfg.smoke,
        **{k: v for k, v in report_environment("gloo", "cpu", cfg.threads).items() if k in ("git_commit", "git_dirty")},
    }


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def _speed_markdown(speed: list[dict]) -> list[str]:
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.1f}"

    times, comm = [], []
    for s in speed:
        model, w, wall, cpu = f"{s['num_params'] / 1e6:.2f}M", s["world_size"], s["step_time_s"], s["cpu_time_s"]
        times.append([model, w, ms(wall["ours"]), ms(wall["fsdp2"]), ms(wall["plain"]),
                      f"{s['step_time_ratio_vs_fsdp2']:.3f}", ms(cpu["ours"]), ms(cpu["fsdp2"]), ms(cpu["plain"]),
                      f"{s['cpu_time_ratio_vs_fsdp2']:.3f}", f"{cpu['plain'] / cpu['fsdp2']:.3f}"])
        comm.append([model, w, _mb(sum(s["comm"]["ours"]["bytes"].values())),
                     _mb(sum(s["comm"]["fsdp2"]["bytes"].values())), _mb(sum(s["theory_bytes"].values())),
                     f"{s['comm_bytes_ratio_vs_theory']:.3f}", f"{s['comm_bytes_ratio_vs_fsdp2']:.3f}"])
    lines = [tabulate(times, headers=["model", "W", "ours ms/step", "fsdp2 ms/step", "plain ms/step",
                                      "step_time_ratio_vs_fsdp2", "ours CPU ms/step", "fsdp2 CPU ms/step",
                                      "plain CPU ms/step", "cpu_time_ratio_vs_fsdp2", "plain CPU / fsdp2 CPU"],
                      tablefmt="github"),
             "", tabulate(comm, headers=["model", "W", "ours comm MiB", "fsdp2 comm MiB", "theory MiB",
                                         "comm_bytes_ratio_vs_theory", "comm_bytes_ratio_vs_fsdp2"],
                          tablefmt="github")]
    if speed:
        models = sorted({s["model"] for s in speed})
        lines += ["", "Models: " + "; ".join(models) + ". Every size and implementation steps in the same ranks, "
                  "interleaved; medians, the slowest rank's. Plain = the unsharded model on the same per-rank batch "
                  "with no communication (the compute floor). CPU = the process's CPU time per step (every thread, "
                  "gloo's included): the work done, which other processes on a shared machine do not inflate as "
                  "they do wall time. Comm = bytes all-gathered (unsharded output) + reduce-scattered (unsharded "
                  "input) per step, counted at the c10d ops. Theory (FULL_SHARD): non-root units all-gather twice, "
                  "the root once, every unit reduce-scatters once."]
    return lines


def _categories_markdown(rows: list[dict], impls: tuple[str, ...]) -> list[str]:
    categories = [c for c in live_memory.CATEGORIES
                  if any(r[i]["peak_by_category"].get(c) for r in rows for i in impls if i in r)]
    table = []
    for r in rows:
        for name in impls:
            if name in r:
                m = r[name]
                table.append([r["world_size"], name, m["peak_phase"]]
                             + [_mb(m["peak_by_category"].get(c, 0)) for c in categories] + [_mb(m["peak_bytes"])])
    return [tabulate(table, headers=["W", "impl", "peak in"] + [f"{c} MiB" for c in categories] + ["total MiB"],
                     tablefmt="github")]


def render_markdown(result: dict) -> str:
    env = result["environment"]
    parts = env.get("parts", list(PARTS))
    command = "python -m harness bench" + ("" if list(parts) == list(PARTS) else f" --only {','.join(parts)}")
    load = env.get("load_average_at_start")
    lines = [
        "# Benchmarks",
        "",
        f"Measured by `{command}` on {env['cpu_count']} CPU cores ({env['machine']}), "
        f"torch {env['torch']}, {env['backend']}, {env['threads_per_rank']} intra-op thread per rank"
        + ("" if load is None else f", load average {load} at the start")
        + (" (smoke run: tiny model, figures meaningless)" if env["smoke"] else "") + ".",
    ]
    if result["speed"]:
        lines += ["", "## Step time and communication (ours vs torch FSDP2, interleaved, median)", "",
                  *_speed_markdown(result["speed"])]
    memory = result["memory"]
    if memory:
        lines += ["", f"## Live-tensor memory per rank ({memory[0]['model']}, {memory[0]['num_params'] / 1e6:.1f}M "
                  "parameters, AdamW, fp32, built on meta)", ""]
        rows = []
        for r in memory:
            rows.append([r["world_size"], _mb(r["ideal_bytes"]), _mb(r["ours"]["peak_bytes"]),
                         f"{r['ours']['peak_ratio_vs_ideal']:.3f}", _mb(r["fsdp2"]["peak_bytes"]),
                         f"{r['fsdp2']['peak_ratio_vs_ideal']:.3f}", _mb(r["ours"]["init_peak_bytes"]),
                         _mb(r["ours"]["peak_rss_growth_bytes"]), _mb(r["ours"]["peak_rss_growth_returning_bytes"]),
                         _mb(r["fsdp2"]["peak_rss_growth_bytes"])])
        lines.append(tabulate(rows, headers=["W", "ideal MiB", "ours peak MiB", "ours peak / ideal", "fsdp2 peak MiB",
                                             "fsdp2 peak / ideal", "ours init peak MiB", "ours RSS growth MiB",
                                             "ours RSS growth, frees returned MiB", "fsdp2 RSS growth MiB"],
                              tablefmt="github"))
        lines += ["", "Where each peak is (the rank with the highest peak; bytes live at that instant by category):",
                  "", *_categories_markdown(memory, ("ours", "fsdp2"))]
    medium = result.get("medium", [])
    if medium:
        lines += ["", f"## GPT-2-medium-shaped model ({medium[0]['model']}, {medium[0]['num_params'] / 1e6:.1f}M "
                  "parameters, AdamW, fp32, built on meta), ours, next to the seeds' figures", ""]
        by_w = {r["world_size"]: r["ours"] for r in medium}
        rows = []
        for r in medium:
            w = r["world_size"]
            shrink = f"{by_w[1]['peak_bytes'] / r['ours']['peak_bytes']:.2f}x" if 1 in by_w else ""
            rows.append([w, _mb(r["ours"]["sharded_param_bytes"]), _mb(r["ideal_bytes"]), _mb(r["ours"]["peak_bytes"]),
                         f"{r['ours']['peak_ratio_vs_ideal']:.3f}", shrink, _mb(r["ours"]["init_peak_bytes"]),
                         _mb(r["ours"]["peak_rss_growth_bytes"]), SEED_PARAM_MB.get(w, ""), SEED_PEAK_MB.get(w, "")])
        lines.append(tabulate(rows, headers=["W", "params MiB", "ideal MiB", "peak MiB", "peak / ideal",
                                             "W=1 peak / peak", "init peak MiB", "RSS growth MiB",
                                             "seeds: params MB", "seeds: peak MB"], tablefmt="github"))
        if 1 in by_w and 8 in by_w:
            lines += ["", f"Per-rank peak W = 1 / W = 8: {by_w[1]['peak_bytes'] / by_w[8]['peak_bytes']:.2f}x "
                      f"(parameters {by_w[1]['sharded_param_bytes'] / by_w[8]['sharded_param_bytes']:.2f}x; the seeds: "
                      f"{SEED_PARAM_MB[1] / SEED_PARAM_MB[8]:.1f}x parameters, {SEED_PEAK_MB[1] / SEED_PEAK_MB[8]:.1f}x "
                      f"peak). Init peak at W = 8: {_mb(by_w[8]['init_peak_bytes'])} MiB against "
                      f"{_mb(medium[0]['full_param_bytes'])} MiB of full parameters."]
        lines += ["", "Where each peak is:", "", *_categories_markdown(medium, ("ours",))]
    if memory or medium:
        lines += ["", "Live-tensor bytes are counted per storage from allocation to free (harness/bench/live_memory.py: "
                  "a dispatch mode, weak references, storage resizes), for every implementation alike. Ideal = "
                  "the plain model's step on the same per-rank batch, measured the same way, with parameters, "
                  "gradients and optimizer state divided by W, plus (W > 1) the largest unit's parameters and "
                  "gradient unsharded. Init peak = live bytes while the meta-built model is materialised. RSS "
                  "growth = the process's resident-set high-water mark minus its size before the model was "
                  "built, the warm-up step included: live tensors, non-tensor memory (gloo, Python objects) and what "
                  "glibc keeps resident after frees (it serves blocks of up to 32 MiB from its heap once such "
                  "blocks have been freed, and freed heap memory stays resident). 'Frees returned' is the same "
                  "launch again with MALLOC_MMAP_THRESHOLD_=131072 (every block above 128 KiB mapped on its own "
                  "and unmapped at free): what remains above the live-tensor peak is the non-tensor memory."]
    t = result.get("throughput")
    if t:
        has_cpu = "batched_cpu_s" in t

        def row(label: str, wall: float, cpu_key: str) -> list[str]:
            cells = [label, f"{wall:.1f}", f"{wall / t['bare_launch_floor_s']:.2f}"]
            return cells + ([f"{t[cpu_key]:.1f}"] if has_cpu else [])

        lines += ["", "## Harness throughput", "",
                  tabulate([row("bare torchrun per world size (floor)", t["bare_launch_floor_s"], "floor_cpu_s"),
                            row("batched: one torchrun for every world size", t["batched_s"], "batched_cpu_s"),
                            row("one torchrun per cell", t["per_cell_s"], "per_cell_cpu_s")],
                           headers=["matrix: " + t["matrix"], "wall s", "x floor"] + (["CPU s"] if has_cpu else []),
                           tablefmt="github", disable_numparse=True),  # as formatted: 43.0, not 43
                  "", f"One launch per cell is {t['per_cell_ratio_vs_batched']:.2f}x the batched wall time."]
        if has_cpu:
            best = t["batched_cpu_s"] / t["cores"]
            lines += ["", f"CPU s: every process of the command (the harness, torchrun, the ranks), user and system. "
                      f"The batched run needs {t['batched_cpu_s']:.1f} s of CPU: on {t['cores']} cores no schedule "
                      f"finishes it in less than {best:.1f} s, {best / t['bare_launch_floor_s']:.2f}x the floor; its "
                      f"wall time is {t['batched_s'] / best:.2f}x that bound."]
        if "fuzz_examples_per_s" in t:
            pools = t.get("fuzz_pools", 1)
            lines += ["", f"Fuzz (`python -m harness fuzz --world-size {t['fuzz_world_size']} --max-examples "
                      f"{t['fuzz_examples']}`, same run, {pools} pool(s) of ranks side by side): "
                      f"{t['fuzz_examples_per_s']:.1f} examples/s ({t['fuzz_examples']} examples in {t['fuzz_s']:.1f} s, "
                      f"shrinking included), after a start-up of {t['fuzz_start_up_s']:.1f} s paid once."]
            if t.get("fuzz_ranks_ms") is not None and t.get("all_gather_ms"):
                lines += ["", f"Per example {t['fuzz_example_ms']:.0f} ms of the run's wall time; its ranks train it "
                          f"for {t['fuzz_ranks_ms']:.0f} ms. One gloo all-gather of 16 elements per rank costs "
                          f"{t['all_gather_ms']:.2f} ms at W = {t['fuzz_world_size']} on this machine, one "
                          f"reduce-scatter {t['reduce_scatter_ms']:.2f} ms (`bench.worker collectives`, the slowest "
                          f"rank): an example's units gather twice and reduce once per micro-batch and step, so its "
                          f"training is the time of about "
                          f"{t['fuzz_ranks_ms'] / (2 * t['all_gather_ms'] + t['reduce_scatter_ms']) * 3:.0f} "
                          f"such collectives."]
            if t.get("fuzz_cpu_ms"):
                lines += ["", f"CPU per example {t['fuzz_cpu_ms']:.0f} ms: {t['fuzz_ranks_cpu_ms']:.0f} ms in the "
                          f"{t['fuzz_world_size']} ranks (all their threads, gloo's included), "
                          f"{t['fuzz_parent_cpu_ms']:.0f} ms in the fuzzer (drawing, the reference, the checks). "
                          f"On {t['cores']} cores no schedule runs more than "
                          f"{t['cores'] * 1e3 / t['fuzz_cpu_ms']:.1f} examples/s of these."]
    if result.get("verify_cost"):
        lines += ["", "## Verifying vs training (GPT-2 shapes, split data, 2 AdamW steps)", "",
                  *_verify_cost_markdown(result["verify_cost"])]
    return "\n".join(lines) + "\n"


def _verify_cost_markdown(rows: list[dict]) -> list[str]:
    table = [[r["case"].rsplit(":", 1)[-1], f"{r['parameters'] / 1e6:.1f}M", r["world_size"],
              f"{r['training_wall_s']:.0f} s", f"{r['harness_wall_s']:.0f} s", f"{r['ratio']:.1f}x",
              _mb(r["output_bytes"]), _mb(r["training_peak_rss_bytes"]), _mb(r["harness_peak_rss_bytes"]),
              _mb(r["parent_peak_rss_bytes"]) if "parent_peak_rss_bytes" in r else "-"] for r in rows]
    return [tabulate(table, headers=["model", "parameters", "W", "training alone", "harness run", "ratio",
                                     "output dir (MiB)", "training peak RSS (MiB)", "harness peak RSS (MiB)",
                                     "parent peak RSS (MiB)"], tablefmt="github"),
            "", "Training alone: the plain model in one rank, then ours at W ranks, each a torchrun launch (imports "
            "included); harness run: `--impls ours --world-sizes W --data split` of the same case: its wall time, "
            "its output directory after the run (a passing cell keeps no snapshots), the largest RSS of any of its "
            "processes, and the RSS of the harness's own process (the parent, which judges nothing on the ranks' "
            "cells and holds their summaries)."]


def write_outputs(result: dict, out_dir: Path) -> None:

    for name, text in (("bench.json", json.dumps(result, indent=1)), ("bench.md", render_markdown(result))):
        write_atomic_text(out_dir / name, text)
