"""Runs inside torchrun ranks for tests/harness/run/test_launch.py: `-m launch_probe MODE`.

crash: rank 1 raises after the prologue; hang: rank 0 waits in a barrier rank 1 never joins
(each prints "rank N hanging" first, so a test need not wait out a long timeout to know it);
exit3: rank 1 calls sys.exit(3) after the barrier; atexit: rank 1 registers an exit hook that ends
the process with status 7 after everything else succeeded; ok: each prints (unflushed) that it is
done, with the name its process has.
"""

from __future__ import annotations

import atexit
import os
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
    if mode == "atexit" and ctx.rank == 1:
        atexit.register(os._exit, 7)
    dist.barrier()
    with open(f"/proc/{os.getpid()}/comm") as f:
        name = f.read().strip()
    print(f"rank {ctx.rank} of {ctx.world_size} done, named {name}")
    dist.destroy_process_group()
    return 3 if mode == "exit3" and ctx.rank == 1 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
