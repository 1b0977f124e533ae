"""The fuzzer's ranks as simulated ranks (`fuzz --backend simulated`), seen from the orchestrator.

[Note: Fuzzing on simulated ranks]
A pool of real ranks has one world size for its life: W processes started once. Simulated ranks
are threads ([Note: Simulated ranks], harness/run/simulated.py), started for each example at the
world size it drew (`world_sizes_up_to` in harness/fuzz/strategies.py: W up to the run's
--world-size, up to 1024), so hypothesis shrinks a failure's W with the rest of its model. They
run in the one rank of an ordinary pool (harness/fuzz/pool.py; the fuzz worker, told it is
simulated: harness/fuzz/worker.py `run_simulated`): started once whatever the W, its requests,
timeouts, crash handling and restarts are a pool's, and nothing of the rank side runs in the
fuzzer's own process. Its reply to an example holds every simulated rank's reply, each exactly
what a rank of a real pool sends.
"""

from __future__ import annotations

from dataclasses import replace

from harness.fuzz.pool import PoolConfig, RankPool

class SimulatedPool(RankPool):
    """A `RankPool` of one rank that simulates each example's ranks; `collect` hands back their
    replies."""

    def __init__(self, config: PoolConfig) -> None:
        super().__init__(replace(config, world_size=1, simulated=True), name="simulated")

    def collect(self, i: int) -> list[dict]:
        (reply,) = super().collect(i)
        return reply["replies"]
