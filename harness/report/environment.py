"""What a run ran on: the plan's backend, device and threads, and the torch (and CUDA) it ran
with. Recorded in every report and, through `baseline_key`, the key a golden baseline is
recorded under and checked against (harness/ci/baseline.py): a baseline from another key is
refused, so none of these values may be assumed; they come from the plan the ranks ran.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

# The values that pin the kernels a reference run executes: a baseline carries them as its key.
BASELINE_KEY_FIELDS = ("torch", "cuda", "backend", "device", "gpu", "threads")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _gpu_name(device: str) -> str | None:
    """The first visible GPU's name for a CUDA run (every rank of a node sees the same kind)."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def _nccl_version(backend: str) -> str | None:
    if backend != "nccl" or not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _cpu_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch: informational only
        return "unknown"


def baseline_key(backend: str, device: str, threads: int) -> dict:
    """The key of a baseline recorded (or checked) by a run with this backend, device and
    intra-op thread count per rank, under the torch running here."""
    return {"torch": torch.__version__, "cuda": torch.version.cuda if device == "cuda" else None,
            "backend": backend, "device": device, "gpu": _gpu_name(device), "threads": threads}


def environment(backend: str, device: str, threads: int) -> dict:
    """Everything a report records about where it ran (the baseline key's values included)."""
    key = baseline_key(backend, device, threads)
    return {
        "torch": key["torch"],
        "torch_cuda_build": torch.version.cuda,  # None: a CPU build
        "cuda": key["cuda"],
        "cudnn": torch.backends.cudnn.version() if device == "cuda" and torch.cuda.is_available() else None,
        "nccl": _nccl_version(backend),
        "gpu": key["gpu"],
        "gpus_visible": torch.cuda.device_count() if device == "cuda" and torch.cuda.is_available() else 0,
        "backend": backend,
        # Simulated ranks are threads of one process ([Note: Simulated ranks]): every report says so.
        "ranks": "simulated (threads of one process)" if backend == "simulated" else "processes",
        "device": device,
        "threads_per_rank": threads,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": _cpu_capability(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }


def plan_environment(plan) -> dict:
    """`environment` of a RunPlan (the backend, device and threads every rank of it ran with)."""
    return environment(plan.backend, plan.device, plan.threads)


def ranks_label(env: dict) -> str:
    """" (simulated ranks)" for a run whose ranks were simulated, for a report's verdict line."""
    return " (simulated ranks)" if env.get("backend") == "simulated" else ""
