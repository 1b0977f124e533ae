"""The fuzzer as the `fuzz` verb runs it (harness/verbs/fuzz.py): its pools of W ranks started and
warmed up, a replayed spec or a search (harness/fuzz/search.py) over the strategies
(harness/fuzz/strategies.py), its summary and verdict. Library-level: raises, never exits."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import torch

from harness.judge.checks import JUDGED
from harness.errors import UserError
from harness.fuzz.check import ExampleResult, finish_example, run_example, start_example
from harness.fuzz.pool import PoolConfig, PoolExitError, PoolGroup, RankPool
from harness.fuzz.simulated import SimulatedPool
from harness.fuzz.search import (STATS_FILE, FuzzStats, cpu_line, format_failure, fuzz, warm_up_hypothesis,
                                 write_stats)
from harness.fuzz.spec import ModelSpec, describe
from harness.fuzz.strategies import warm_up_spec
from harness.run.output import OutputDir
from harness.run.plan import MAX_CPU_WORLD_SIZE, MAX_SIMULATED_WORLD_SIZE, usable_cores

MAX_POOLS = 4  # each pool holds W rank processes: memory, not speed, bounds them
SIDE_BY_SIDE_MIN_EXAMPLES = 8


def auto_pools(max_examples: int, threads: int, cores: int | None = None) -> int:
    """The pools `--pools auto` starts: one per `threads` cores (a pool's ranks, waiting on one
    another, keep fewer cores busy than they have: measured on 2 cores at W = 4, 1.3), up to
    MAX_POOLS; one alone for runs shorter than SIDE_BY_SIDE_MIN_EXAMPLES, where the start-up of
    the others costs more than they save (measured on 2 cores at W = 4, ranks forked
    ([Note: Forked ranks], harness/run/prefork.py): a second pool adds about 0.2 s of start-up
    and saves about 60 ms per example, so it pays for itself from about 4; 8 leaves room for a
    slower start)."""
    cores = usable_cores() if cores is None else cores
    if max_examples < SIDE_BY_SIDE_MIN_EXAMPLES:
        return 1
    return max(1, min(MAX_POOLS, cores // threads))


EXAMPLE_TIMEOUT_S = 60.0
SIMULATED_SECONDS_PER_RANK = 0.3  # measured: a W = 1024 example of 3 steps took about 55 s on 2 cores


def default_example_timeout(world_size: int, backend: str) -> float:
    """--example-timeout's default: 60 s, or with simulated ranks, which take turns on this host's
    cores, 0.3 s per rank of the largest W drawn if that is longer (about 5x what a W = 1024
    example measured)."""
    return max(EXAMPLE_TIMEOUT_S, SIMULATED_SECONDS_PER_RANK * world_size) if backend == "simulated" else EXAMPLE_TIMEOUT_S


def main(world_size: int, max_examples: int, seed: int, faults: tuple[str, ...], replay: str | None,
         out_dir: Path, threads: int, example_timeout_s: float | None, progress: bool = True, impl: str = "ours",
         pools: int | None = 1, backend: str = "gloo") -> bool:
    """True when every example passed (`pools` None: `auto_pools`). Library-level: raises
    UserError for bad arguments (before any rank starts), PoolLost when the infrastructure took a
    rank away; never exits. `backend` simulated: each example at a W of its own up to
    `world_size`, on simulated ranks ([Note: Fuzzing on simulated ranks])."""
    if max_examples < 1:
        raise UserError(f"--max-examples={max_examples} must be >= 1")
    if threads < 1:
        raise UserError(f"--threads={threads} must be >= 1 (intra-op threads per rank)")
    if example_timeout_s is None:  # the default: a simulated example's W threads take turns on these cores
        example_timeout_s = default_example_timeout(world_size, backend)
    if not example_timeout_s > 0:
        raise UserError(f"--example-timeout={example_timeout_s} must be > 0 seconds")
    simulated = backend == "simulated"
    if backend not in ("gloo", "simulated"):
        raise UserError(f"--backend={backend} must be gloo or simulated (the fuzzer's ranks run on this host's CPUs)")
    pools = (1 if simulated else auto_pools(max_examples, threads)) if pools is None else pools
    if pools < 1:
        raise UserError(f"--pools={pools} must be >= 1 (pools of W ranks training examples side by side)")
    if simulated and (pools != 1 or threads != 1):
        raise UserError(f"--backend simulated runs one example at a time on threads of this process: --pools={pools} "
                        f"and --threads={threads} must be 1")
    if simulated and not 1 <= world_size <= MAX_SIMULATED_WORLD_SIZE:
        raise UserError(f"--world-size={world_size} must be between 1 and {MAX_SIMULATED_WORLD_SIZE} with --backend "
                        f"simulated (the largest W an example draws)")
    if not simulated and not 1 <= world_size <= MAX_CPU_WORLD_SIZE:
        raise UserError(f"--world-size={world_size} must be between 1 and {MAX_CPU_WORLD_SIZE} (every rank of the "
                        f"pool is a process importing torch on this host; --backend simulated reaches "
                        f"{MAX_SIMULATED_WORLD_SIZE})")
    from harness.adapters.registry import resolve_impl, resolve_sharded_impl

    resolve_sharded_impl(impl, "fuzz", "the fuzzer needs a sharded implementation")
    if simulated and not resolve_impl(impl).simulated_ranks:
        raise UserError(f"impl={impl} cannot run on simulated ranks (it reaches its process group from C++); "
                        f"fuzz it with --backend gloo")
    if faults:
        from harness.faults import check_faults

        check_faults(faults, (impl,), loop=False)
    try:
        spec = ModelSpec.from_json(replay) if replay else None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"--replay is not a model spec ({type(e).__name__}: {e}); pass the JSON a failing fuzz run "
                        f"printed after 'replay: ... --replay'") from None
    if spec is not None and spec.world_size != world_size:
        raise UserError(f"--replay spec world_size={spec.world_size} != --world-size={world_size}")
    if spec is not None and simulated and not 1 <= spec.world_size <= MAX_SIMULATED_WORLD_SIZE:
        raise UserError(f"--replay spec world_size={spec.world_size} is beyond {MAX_SIMULATED_WORLD_SIZE}")
    config = PoolConfig(world_size, out_dir / "logs", threads=threads, example_timeout_s=example_timeout_s)
    # This process builds the reference and judges tensors of a few dozen elements while the ranks
    # train beside it: one intra-op thread is several times faster per op than a pool of them.
    parent_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with OutputDir(out_dir, uuid.uuid4().hex, ("logs", STATS_FILE)):  # owned and locked: one run's logs and figures
            return _main(config, spec, max_examples, seed, faults, progress, impl, pools, out_dir, backend)
    finally:
        torch.set_num_threads(parent_threads)


def _main(config: PoolConfig, spec: ModelSpec | None, max_examples: int, seed: int, faults: tuple[str, ...],
          progress: bool, impl: str, pools: int, out_dir: Path, backend: str = "gloo") -> bool:
    world_size = config.world_size
    simulated = backend == "simulated"
    with SimulatedPool(config) if simulated else PoolGroup(config, 1 if spec is not None else pools) as pool:
        # The first example pays for lazy imports and kernel set-up in every rank: start-up, not rate.
        warm = time.perf_counter()
        warm_up = warm_up_spec(min(world_size, 4) if simulated else world_size)
        for submitted in [start_example(pool, warm_up, (), impl) for _ in range(pool.size)]:
            finish_example(submitted)  # one per pool: `submit` hands each to the pool with none in flight
        if spec is None:
            warm_up_hypothesis(world_size, impl, simulated)
        start_s = pool.start_s + time.perf_counter() - warm
        what = (f"simulated ranks, W drawn up to {world_size}" if simulated else
                f"pool of {world_size} ranks" if pool.size == 1 else f"{pool.size} pools of {world_size} ranks")
        print(f"[fuzz] {what} started in {start_s:.1f}s", flush=True)
        if spec is not None:
            result = run_example(pool, spec, faults, impl)
            exit_error = _close(pool)
            print(describe(spec))
            if result.refused is not None:  # not run, so not judged: never a pass
                print(f"[fuzz] replay: NOT RUN: impl={impl} refused the model at wrap: {result.refused}")
                return False
            print("[fuzz] replay: " + (f"pass (margins {_fmt_margins(result.margins)})" if result.ok
                                       else "FAIL\n" + format_failure(result, impl, backend)))
            if result.ok and exit_error is not None:
                print(f"[fuzz] replay: ERROR: {exit_error}")
                return False
            return result.ok

        def show(stats: FuzzStats, result: ExampleResult) -> None:
            if progress and (stats.num_examples % 10 == 0 or not result.ok):
                print(f"[fuzz] {stats.num_examples} examples, {len(stats.failures)} failing, "
                      f"{stats.num_examples / max(stats.example_s, 1e-9):.1f} examples/s", flush=True)

        wall = time.perf_counter()
        stats = fuzz(pool, world_size, max_examples, seed, faults, show, impl, drawn_world_size=simulated)
        wall = time.perf_counter() - wall
        restarts = pool.num_starts - pool.size
        exit_error = _close(pool)
    rate = stats.num_examples / max(wall, 1e-9)
    write_stats(out_dir, impl, world_size, stats, wall, start_s, pool.size)
    how = (f"pool start-up {start_s:.1f}s paid once, {restarts} restart(s) after failing examples, "
           + ("its one rank simulating each example's W ranks" if simulated else f"{pool.size} pool(s) side by side"))
    print(f"[fuzz] impl={impl} W={'<=' if simulated else ''}{world_size} seed={seed} faults={list(faults)}: "
          f"{stats.num_examples} examples (shrinking included) in {wall:.1f}s = {rate:.1f} examples/s; {how}")
    if stats.num_examples:
        per = 1e3 / stats.num_examples
        print(f"[fuzz] per example: {stats.example_s * per:.0f} ms of the run's wall time; its ranks train it for "
              f"{stats.rank_s * per:.0f} ms (collectives included), {pool.size} pool(s) side by side")
        print(cpu_line(stats, world_size, usable_cores()))
    for refusal, count in stats.refusals.items():
        print(f"[fuzz] {count} drawn model(s) refused at wrap, not counted: {refusal}")
    if stats.honest_margins:
        print(f"[fuzz] largest honest |diff|/tol over passing examples: {_fmt_margins(stats.honest_margins)}")
    if stats.failures:
        print("[fuzz] FAIL: " + format_failure(stats.failures[-1], impl, backend))
        return False
    if exit_error is not None:
        print(f"[fuzz] ERROR: no verdict: {exit_error}")
        return False
    if not stats.num_examples:  # nothing judged is no evidence: never a pass
        print(f"[fuzz] NOT RUN: impl={impl} refused every drawn model, so no example was judged")
        return False
    print(f"[fuzz] PASS: {stats.num_examples} examples, none failing")
    return True


def _close(pool: RankPool) -> str | None:
    """Stop the pool; what went wrong when its ranks did not end cleanly (their evidence, though
    complete, then supports no verdict: harness/fuzz/pool.py `PoolExitError`), else None."""
    try:
        pool.close()
    except PoolExitError as e:
        return f"the pool's ranks did not end cleanly after the last example, so no example's evidence stands:\n{e}"
    return None


def _fmt_margins(margins: dict[str, float]) -> str:
    return ", ".join(f"{k}={margins[k]:.3g}" for k in JUDGED if k in margins)
