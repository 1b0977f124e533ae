"""Runs inside torchrun ranks for tests/test_launch.py: `-m launch_probe crash|hang|ok`.

crash: rank 1 raises after the prologue; hang: rank 0 waits in a barrier rank 1 never joins
(each prints "rank N hanging" first, so a test need not wait out a long timeout to know it).
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

from harness.run.rank import rank_prologue


def main(mode: str) -> int:
    ctx = rank_prologue(threads=1)
    if mode == "crash" and ctx.rank == 1:
        raise RuntimeError("planted crash on rank 1")
    if mode == "hang":
        print(f"rank {ctx.rank} hanging", flush=True)
        if ctx.rank == 1:
            time.sleep(3600)
    dist.barrier()
    print(f"rank {ctx.rank} of {ctx.world_size} done", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
