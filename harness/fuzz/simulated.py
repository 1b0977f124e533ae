"""The fuzzer's ranks as simulated ranks of this process (`fuzz --backend simulated`).

[Note: Fuzzing on simulated ranks]
A pool of real ranks has one world size for its life: W processes started once. Simulated ranks
are threads ([Note: Simulated ranks], harness/run/simulated.py), so a `SimulatedPool` starts them
per example, at the world size the example drew (`world_sizes_up_to` in
harness/fuzz/strategies.py: any W up to the run's --world-size, up to 1024), and hypothesis
shrinks a failure's W with the rest of its model. Each rank answers exactly as a pool rank does
(harness/fuzz/worker.py `serve`), its reply handed over in memory instead of through a store; the
judge is the same. A rank that raises stops the others at their next collective; an example that
overruns its timeout is cancelled the same way, and one whose threads then do not stop (stuck
outside any collective) ends the fuzzing with one line, as a pool lost to the system does.
"""

from __future__ import annotations

import threading
import time
from typing import NoReturn

import torch
import torch.distributed as dist

from harness.errors import PoolLost
from harness.fuzz.pool import ExampleError, PoolConfig
from harness.fuzz.spec import ModelSpec

CANCEL_GRACE_S = 30.0  # for a cancelled example's threads to stop


class SimulatedPool:
    """The interface of a `RankPool` (submit, collect, close); each example runs when submitted,
    on `spec.world_size` simulated ranks."""

    size = 1  # examples at once: the ranks of one already share this process's cores

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.num_starts = 0  # examples run: each starts its own ranks
        self.start_s = 0.0  # nothing is started ahead of the examples
        self._next = 0
        self._replies: dict[int, list[dict] | str] = {}

    def start(self) -> None:
        pass

    def close(self) -> None:
        self._replies.clear()

    def _kill(self) -> None:
        self._replies.clear()

    def __enter__(self) -> SimulatedPool:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    @property
    def in_flight(self) -> int:
        return len(self._replies)

    def submit(self, request: dict) -> int:
        """Run the example now; `collect` hands over its replies (or raises its error)."""
        i = self._next
        self._next += 1
        self._replies[i] = self._run(request)
        return i

    def collect(self, i: int) -> list[dict]:
        replies = self._replies.pop(i)
        if isinstance(replies, str):
            raise ExampleError(replies)
        return replies

    def run(self, request: dict) -> list[dict]:
        return self.collect(self.submit(request))

    def _run(self, request: dict) -> list[dict] | str:
        """Every rank's reply in rank order, or the error text of the example."""
        from harness.adapters.base import RankContext
        from harness.fuzz.worker import serve
        from harness.run.simulated import Simulation

        world_size = ModelSpec.from_json(request["spec"]).world_size
        sim = Simulation(world_size)
        replies: list[dict | None] = [None] * world_size
        self.num_starts += 1

        def rank_main(rank: int) -> None:
            ctx = RankContext(rank, world_size, dist.group.WORLD, torch.device("cpu"))
            replies[rank] = reply = serve(request, ctx, cpu_clock=time.thread_time)
            if "error" in reply:
                sim.cancel()  # the others would wait for this rank at their next collective

        done = threading.Event()

        def run_all() -> None:
            try:
                sim.run(rank_main)
            except RuntimeError:
                pass  # a rank failed outside `serve` (joining its group): sim.errors says which
            finally:
                done.set()

        threading.Thread(target=run_all, name=f"fuzz-simulation-w{world_size}", daemon=True).start()
        timeout_s = self.config.example_timeout_s
        if not done.wait(timeout_s):
            sim.cancel()
            if not done.wait(CANCEL_GRACE_S):
                self._lost(world_size, f"ran past its {timeout_s:g} s and its threads did not stop within "
                                       f"{CANCEL_GRACE_S:g} s of the cancel")
            return f"simulated W={world_size}: no reply after {timeout_s:g} s (cancelled)"
        failed = [e for e in getattr(sim, "errors", ()) if e is not None]
        if any(r is None for r in replies):
            return f"simulated W={world_size}: " + "\n".join(f"{type(e).__name__}: {e}" for e in failed[:3])
        errors = [r["error"] for r in replies if "error" in r]
        # The rank whose own error stopped the example, not those stopped at their next collective.
        own = [e for e in errors if "SimulationAborted" not in e]
        if errors:
            return "\n".join((own or errors)[:3])
        return replies

    def _lost(self, world_size: int, what: str) -> NoReturn:
        raise PoolLost(f"simulated W={world_size}: an example {what}; no further example can run in this process")
