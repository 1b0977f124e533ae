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
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from harness.launch import LAUNCH_ID_VAR, free_port, kill_launch

REPO_ROOT = Path(__file__).resolve().parent.parent
# The seeds' figures (GPT-2 medium, 505M parameters, fp32 parameters per GPU): shared/seeds/000.
SEED_MEMORY_MB = {1: 2020, 8: 253}


@dataclass(frozen=True)
class BenchConfig:
    out_dir: Path
    speed_world_sizes: tuple[int, ...] = (2, 4)
    memory_world_sizes: tuple[int, ...] = (1, 2, 4, 8)
    iters: int = 10
    threads: int = 1
    throughput: bool = True
    timeout_s: float = 1200.0
    smoke: bool = False  # a tiny model and one iteration: checks that bench runs, measures nothing

    def __post_init__(self) -> None:
        if self.iters < 1:
            raise ValueError(f"iters={self.iters} must be >= 1")
        bad = [w for w in (*self.speed_world_sizes, *self.memory_world_sizes) if w < 1]
        if bad:
            raise ValueError(f"world sizes {bad} must be >= 1")


class BenchError(RuntimeError):
    pass


def torchrun(world_size: int, args: list[str], threads: int, timeout_s: float, log: Path) -> float:
    """Run `python -m <args>` in `world_size` ranks; return wall seconds; raise on failure."""
    launch_id = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env[LAUNCH_ID_VAR] = launch_id
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={world_size}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", *args]
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = 124
        finally:
            kill_launch(launch_id)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wall = time.monotonic() - start
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise BenchError(f"bench launch W={world_size} {' '.join(args[:2])} exited {rc}:\n{tail}")
    return wall


def run_bench(cfg: BenchConfig, progress=print) -> dict:
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=cfg.out_dir))
    result: dict = {"environment": environment(cfg), "speed": [], "memory": []}
    smoke = ["--iters", "1", "--warmup", "0", "--smoke"] if cfg.smoke else ["--iters", str(cfg.iters)]
    for w in cfg.speed_world_sizes:
        progress(f"bench: step time and communication, ours vs fsdp2, W={w}")
        out = work / f"speed_w{w}.json"
        torchrun(w, ["harness.bench_worker", "speed", "--out", str(out), "--threads", str(cfg.threads), *smoke],
                 cfg.threads, cfg.timeout_s, work / f"speed_w{w}.log")
        result["speed"].append(json.loads(out.read_text())["ranks"][0])
    for w in cfg.memory_world_sizes:
        progress(f"bench: memory of the GPT-2-small-shaped model, W={w}")
        out = work / f"memory_w{w}.json"
        extra = ["--smoke"] if cfg.smoke else []
        torchrun(w, ["harness.bench_worker", "memory", "--out", str(out), "--threads", str(cfg.threads), *extra],
                 cfg.threads, cfg.timeout_s, work / f"memory_w{w}.log")
        ranks = json.loads(out.read_text())["ranks"]
        entry = dict(ranks[0])
        entry["peak_rss_growth_bytes_max_rank"] = max(r["peak_rss_growth_bytes"] for r in ranks)
        result["memory"].append(entry)
    if cfg.throughput and not cfg.smoke:
        progress("bench: harness throughput (batched matrix vs bare launches vs one launch per cell)")
        result["throughput"] = harness_throughput(cfg, work)
    write_outputs(result, cfg.out_dir)
    return result


def harness_throughput(cfg: BenchConfig, work: Path) -> dict:
    """Wall time of the standard matrix, batched (one torchrun per world size) and one torchrun
    per cell, against the floor: one bare torchrun launch per world size."""
    world_sizes = (1, 2, 4, 8)
    floor = sum(torchrun(w, ["harness.bench_worker", "bare", "--out", str(work / f"bare{w}.json")],
                         cfg.threads, cfg.timeout_s, work / f"bare{w}.log") for w in world_sizes)
    walls = {}
    for label, extra in (("batched", []), ("per_cell", ["--launch-per-cell"])):
        cmd = [sys.executable, "-m", "harness", "run", "--cases", "mlp,transformer", "--impls", "ours,fsdp2",
               "--world-sizes", ",".join(map(str, world_sizes)), "--data", "identical,split",
               "--out", str(work / f"matrix_{label}"), "--quiet", *extra]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=cfg.timeout_s * 4)
        walls[label] = time.monotonic() - start
        if proc.returncode != 0:
            raise BenchError(f"harness run ({label}) exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return {
        "matrix": "mlp,transformer x ours,fsdp2 x W=1,2,4,8 x identical,split (32 cells)",
        "bare_launch_floor_s": floor,
        "batched_s": walls["batched"],
        "per_cell_s": walls["per_cell"],
        "batched_ratio_vs_floor": walls["batched"] / floor,
        "per_cell_ratio_vs_batched": walls["per_cell"] / walls["batched"],
    }


def environment(cfg: BenchConfig) -> dict:
    import torch

    return {
        "torch": torch.__version__,
        "backend": "gloo",
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "threads_per_rank": cfg.threads,
        "smoke": cfg.smoke,
    }


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def render_markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        "# Benchmarks",
        "",
        f"Measured by `python -m harness bench` on {env['cpu_count']} CPU cores ({env['machine']}), "
        f"torch {env['torch']}, {env['backend']}, {env['threads_per_rank']} intra-op thread per rank"
        + (" (smoke run: tiny model, figures meaningless)" if env["smoke"] else "") + ".",
        "",
        "## Step time and communication (ours vs torch FSDP2, interleaved, median)",
        "",
    ]
    rows = []
    for s in result["speed"]:
        rows.append([s["world_size"], f"{s['step_time_s']['ours'] * 1e3:.1f}", f"{s['step_time_s']['fsdp2'] * 1e3:.1f}",
                     f"{s['step_time_ratio_vs_fsdp2']:.3f}", _mb(sum(s["comm"]["ours"]["bytes"].values())),
                     _mb(sum(s["comm"]["fsdp2"]["bytes"].values())), _mb(sum(s["theory_bytes"].values())),
                     f"{s['comm_bytes_ratio_vs_theory']:.3f}", f"{s['comm_bytes_ratio_vs_fsdp2']:.3f}"])
    lines.append(tabulate(rows, headers=["W", "ours ms/step", "fsdp2 ms/step", "step_time_ratio_vs_fsdp2",
                                         "ours comm MiB", "fsdp2 comm MiB", "theory MiB",
                                         "comm_bytes_ratio_vs_theory", "comm_bytes_ratio_vs_fsdp2"], tablefmt="github"))
    if result["speed"]:
        lines += ["", f"Model: {result['speed'][0]['model']}. Comm = bytes all-gathered (unsharded output) + "
                  "reduce-scattered (unsharded input) per step, counted at the c10d ops. Theory (FULL_SHARD): "
                  "non-root units all-gather twice, the root once, every unit reduce-scatters once."]
    lines += ["", "## Memory per rank (GPT-2-small-shaped model, AdamW, fp32)", ""]
    rows = []
    for m in result["memory"]:
        w = m["world_size"]
        rows.append([w, _mb(m["sharded_param_bytes"]), _mb(m["sharded_state_bytes"]), _mb(m["total_state_bytes"] / w),
                     f"{m['sharded_state_ratio_vs_total_over_w']:.4f}", _mb(m["largest_unit_bytes"]),
                     _mb(m["activation_bytes"]), _mb(m["ideal_peak_bytes"]), _mb(m["peak_rss_growth_bytes_max_rank"]),
                     SEED_MEMORY_MB.get(w, "")])
    lines.append(tabulate(rows, headers=["W", "params MiB", "params+grads+Adam MiB", "total/W MiB", "ratio",
                                         "largest unit MiB", "activations MiB", "ideal peak MiB",
                                         "peak RSS growth MiB (max rank)", "seeds: GPT-2 medium params MB"],
                          tablefmt="github"))
    if result["memory"]:
        lines += ["", f"Model: {result['memory'][0]['model']}, {result['memory'][0]['num_params'] / 1e6:.1f}M parameters. "
                  "Ideal peak = sharded state + one unsharded unit and its unsharded gradient + activations "
                  "(tensors saved for backward). Peak RSS growth is the process's resident-set high-water mark "
                  "minus its size before the model was built (CPU tensor memory, plus allocator slack)."]
    t = result.get("throughput")
    if t:
        lines += ["", "## Harness throughput", "",
                  tabulate([["bare torchrun per world size (floor)", f"{t['bare_launch_floor_s']:.1f}", "1.00"],
                            ["batched: one torchrun per world size", f"{t['batched_s']:.1f}", f"{t['batched_ratio_vs_floor']:.2f}"],
                            ["one torchrun per cell", f"{t['per_cell_s']:.1f}", f"{t['per_cell_s'] / t['bare_launch_floor_s']:.2f}"]],
                           headers=["matrix: " + t["matrix"], "wall s", "x floor"], tablefmt="github"),
                  "", f"One launch per cell is {t['per_cell_ratio_vs_batched']:.2f}x the batched wall time."]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out_dir: Path) -> None:
    for name, text in (("bench.json", json.dumps(result, indent=1)), ("bench.md", render_markdown(result))):
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out_dir / name)
