"""The rank prologue: the first thing every rank does, whichever verb launched it (run, fuzz,
mutants and bench all launch through harness/run/launch.py).

Each rank dies with torchrun and with the harness ([Note: No survivors] in
harness/run/lifeline.py), dumps every thread's stack on SIGUSR1 (the launcher's timeout), pins
its intra-op threads and joins the process group. The environment variables read here are
torchrun's own (LOCAL_RANK, and RANK, WORLD_SIZE, MASTER_* inside init_process_group).
"""

from __future__ import annotations

import faulthandler
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

from harness.adapters.base import RankContext
from harness.run import lifeline


def rank_prologue(threads: int, backend: str = "gloo", device: str = "cpu",
                  collective_timeout_s: float | None = None) -> RankContext:
    """This rank's context in the world group, after the steps above."""
    lifeline.die_with_launch()  # dies with torchrun and with the harness, SIGKILL included
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(threads)
    rank_device = torch.device("cpu")
    if device == "cuda":  # one rank per GPU of this node
        rank_device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(rank_device)
        # The shadow replays each rank's local computation bitwise (docs/error_model.md): kernels
        # must not depend on atomics or autotuning.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    if collective_timeout_s is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, timeout=timedelta(seconds=collective_timeout_s))
    return RankContext(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, rank_device)
