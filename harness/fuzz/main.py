"""`python -m harness fuzz`: hypothesis draws models in this process, a persistent pool of W ranks
trains each through impl=ours, and the harness's checks judge it against the single-process
shadow reference. A failure is shrunk to a minimal model and printed as a ready-to-run case.

Strategies aim at the numels where sharding breaks (see tests/strategies.py for the pure
layout-level counterparts): each block's auxiliary parameter is sized so that its unit's flat
numel lands below W, at W*k - 1, W*k, W*k + 1 or on a prime.
"""

from __future__ import annotations

import json
import collections
import functools
import shlex
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st

from cases.catalog import OptimizerSpec
from harness.judge.checks import JUDGED
from harness.errors import UserError
from harness.fuzz.check import ExampleResult, finish_example, run_example, start_example
from harness.fuzz.pool import PoolConfig, PoolExitError, PoolGroup, RankPool
from harness.fuzz.spec import MAX_NESTING, BlockSpec, ModelSpec, describe
from harness.run.output import OutputDir
from harness.run.plan import MAX_CPU_WORLD_SIZE, usable_cores

OPTIMIZERS = (
    OptimizerSpec("sgd", lr=0.05),
    OptimizerSpec("sgd", lr=0.05, momentum=0.9),
    OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01),
)
NUMEL_FAMILIES = ("none", "below_w", "w_k_minus_1", "w_k", "w_k_plus_1", "prime")
PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47)


def _own_numel(in_features: int, width: int, bias: bool, tied: bool, gain: bool, fan_out: bool = False,
               unused: bool = False) -> int:
    return (in_features * width + (width if bias else 0) + (width * width if tied else 0) + int(gain)
            + (3 * width * width if fan_out else 0) + (width if unused else 0))


@st.composite
def target_numels(draw, world_size: int, base: int) -> int:
    """An aux numel that puts `base + aux` (the unit's flat numel) on a padding edge, or 0."""
    family = draw(_FAMILIES)
    if family == "none":
        return 0
    if family == "below_w":
        return draw(st.integers(1, max(1, world_size - 1)))  # alone in a small unit, or size 1
    if family == "prime":
        target = draw(_PRIMES)
    else:
        k = draw(st.integers(1, 4))
        target = world_size * k + {"w_k_minus_1": -1, "w_k": 0, "w_k_plus_1": 1}[family]
    return target - base if target > base else max(1, target)


@st.composite
def block_specs(draw, world_size: int, in_features: int, depth: int = 1, scalar_params: bool = True,
                unused_params: bool = False) -> BlockSpec:
    width = draw(st.integers(1, 5))
    bias, tied, gain, frozen, fan_out, unused = (draw(st.booleans()) for _ in range(6))
    # Drawn either way: the same choices give the same other fields.
    gain = gain and scalar_params
    unused = unused and unused_params
    aux = draw(_target_numels(world_size, _own_numel(in_features, width, bias, tied, gain, fan_out, unused)))
    wrap = draw(st.booleans())
    inner = (draw(_inner_block_specs(world_size, width, depth + 1, scalar_params, unused_params))
             if depth < MAX_NESTING else None)
    return BlockSpec(width=width, bias=bias, tied=tied, aux_numel=aux, gain=gain, frozen=frozen, fan_out=fan_out,
                     unused=unused, wrap=not wrap, inner=inner)  # wrap=True shrinks to False: prefer wrapped units


# One strategy object per argument tuple, built once: hypothesis validates and labels every new
# strategy object it draws from, which costs more than the draw itself when a composite builds
# its strategies afresh at every draw. The same strategies, so the same examples per seed.
_FAMILIES = st.sampled_from(NUMEL_FAMILIES)
_PRIMES = st.sampled_from(PRIMES)
_target_numels = functools.cache(target_numels)
_block_specs = functools.cache(block_specs)


@functools.cache
def _inner_block_specs(world_size: int, in_features: int, depth: int, scalar_params: bool,
                       unused_params: bool) -> st.SearchStrategy[BlockSpec | None]:
    return st.none() | _block_specs(world_size, in_features, depth, scalar_params, unused_params)


def model_specs(world_size: int, accumulations: tuple[int, ...] = (1, 2), scalar_params: bool = True,
                unused_params: bool = False) -> st.SearchStrategy[ModelSpec]:
    """Models for a pool of `world_size` ranks (checked here, not at the first draw); with
    `scalar_params` False, none with a 0-d parameter. `unused_params` (off by default) also draws
    blocks with a parameter the forward never reads, which has no gradient: off until the harness
    and impl judge parameters without gradients (issue 30; until then every such model errors with
    'full_grads lack parameters')."""
    if world_size < 1:
        raise ValueError(f"model_specs world_size={world_size} must be >= 1")
    if not accumulations or any(a not in (1, 2) for a in accumulations):
        raise ValueError(f"model_specs accumulations={accumulations} must be a non-empty subset of (1, 2)")
    return _model_specs(world_size, accumulations, scalar_params, unused_params)


@st.composite
def _model_specs(draw, world_size: int, accumulations: tuple[int, ...], scalar_params: bool,
                 unused_params: bool) -> ModelSpec:
    in_features = draw(st.integers(1, 5))
    blocks, width = [], in_features
    for _ in range(draw(st.integers(1, 3))):
        block = draw(_block_specs(world_size, width, 1, scalar_params, unused_params))
        blocks.append(block)
        while block.inner is not None:
            block = block.inner
        width = block.width
    accumulation = draw(st.sampled_from(accumulations))
    data_mode = draw(st.sampled_from(("split", "identical")))
    return ModelSpec(
        world_size=world_size,
        in_features=in_features,
        out_features=draw(st.integers(1, 3)),
        blocks=tuple(blocks),
        optimizer=draw(st.sampled_from(OPTIMIZERS)),
        steps=draw(st.integers(2, 3)),
        batch_per_rank=accumulation * draw(st.integers(1, 2)),
        accumulation=accumulation,
        sync_every_micro=draw(st.booleans()),
        data_mode=data_mode,
        seed=draw(st.integers(0, 2**16)),
    )


@dataclass
class FuzzStats:
    num_examples: int = 0
    example_s: float = 0.0
    rank_s: float = 0.0  # of example_s, the time the ranks spent training
    cpu_s: float = 0.0  # CPU time of this process on the examples (drawing, the reference, the checks)
    ranks_cpu_s: float = 0.0  # CPU time of the ranks on the examples, summed over ranks
    honest_margins: dict[str, float] = field(default_factory=dict)  # check -> max over passing examples
    failures: list[ExampleResult] = field(default_factory=list)
    refusals: dict[str, int] = field(default_factory=dict)  # the implementation's refusal -> models drawn

    def record(self, result: ExampleResult, seconds: float, cpu_s: float = 0.0) -> None:
        self.num_examples += 1
        self.example_s += seconds
        self.rank_s += result.rank_s
        self.cpu_s += cpu_s
        self.ranks_cpu_s += result.ranks_cpu_s
        if result.ok:
            for check, value in result.margins.items():
                self.honest_margins[check] = max(self.honest_margins.get(check, 0.0), value)
        else:
            self.failures.append(result)


def cpu_line(stats: FuzzStats, world_size: int, cores: int) -> str:
    """CPU per example, here and in the ranks, and what it allows: no schedule on `cores` cores runs
    more than cores / (CPU per example) examples per second."""
    per = 1e3 / max(stats.num_examples, 1)
    cpu_ms = (stats.cpu_s + stats.ranks_cpu_s) * per
    return (f"[fuzz] CPU per example: {cpu_ms:.0f} ms ({stats.cpu_s * per:.0f} ms here, {stats.ranks_cpu_s * per:.0f} ms "
            f"in the {world_size} ranks); on {cores} cores at most {cores * 1e3 / max(cpu_ms, 1e-9):.1f} examples/s")


STATS_FILE = "fuzz_stats.json"


def write_stats(out_dir: Path, impl: str, world_size: int, stats: FuzzStats, wall_s: float, start_up_s: float,
                pools: int) -> None:
    """The run's figures, as the lines it prints give them (unrounded), in `out_dir`/STATS_FILE:
    what the bench reads (harness/bench/main.py fuzz_rate)."""
    n = stats.num_examples
    per = 1e3 / n if n else float("nan")
    figures = {"impl": impl, "world_size": world_size, "examples": n, "wall_s": wall_s,
               "examples_per_s": n / max(wall_s, 1e-9), "start_up_s": start_up_s, "pools": pools,
               "example_ms": stats.example_s * per, "ranks_ms": stats.rank_s * per,
               "cpu_ms": (stats.cpu_s + stats.ranks_cpu_s) * per, "parent_cpu_ms": stats.cpu_s * per,
               "ranks_cpu_ms": stats.ranks_cpu_s * per, "failures": len(stats.failures)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / STATS_FILE).write_text(json.dumps(figures, indent=1) + "\n")


class _Falsified(AssertionError):
    pass


def warm_up_spec(world_size: int) -> ModelSpec:
    return ModelSpec(world_size, 2, 1, (BlockSpec(width=2, inner=BlockSpec(width=1)),), OPTIMIZERS[0])


def specs_for(world_size: int, impl: str, unused_params: bool = False) -> st.SearchStrategy[ModelSpec]:
    """The models `impl` can take: micro-batches per step as the adapter maps them (an adapter
    that owns the step may map only one), 0-d parameters only where it shards them; parameters
    without gradients only with `unused_params` (see model_specs)."""
    from cases.features import Features
    from harness.adapters.registry import resolve_impl

    adapter = resolve_impl(impl)
    accumulations = (1, 2) if adapter.unsupported(Features(grad_accum=2)) is None else (1,)
    return model_specs(world_size, accumulations, adapter.shards_scalar_params, unused_params)


def replay_command(spec: ModelSpec, faults: tuple[str, ...], impl: str = "ours") -> str:
    cmd = f"python -m harness fuzz --world-size {spec.world_size} --replay {shlex.quote(spec.to_json())}"
    cmd += f" --impls {impl}" if impl != "ours" else ""
    return cmd + (f" --faults {','.join(faults)}" if faults else "")


def _warm_up_hypothesis(world_size: int, impl: str) -> None:
    """Hypothesis's one-off costs in this process, paid before the rate is measured: a full garbage
    collection when it first seeds the random generators it manages, and its scan of the loaded
    modules for constants to draw."""
    draw_specs(world_size, 2, 0, impl)


def _fuzz_settings(max_examples: int, phases: tuple[Phase, ...]) -> settings:
    return settings(max_examples=max_examples, deadline=None, database=None, report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck), print_blob=False, phases=phases)


def draw_specs(world_size: int, max_examples: int, seed: int, impl: str = "ours",
               unused_params: bool = False) -> list[ModelSpec]:
    """The models hypothesis's generate phase hands the property for this seed, in order, drawn
    without running any: its choices depend on the examples' outcomes only once one fails or is
    rejected, so until then these are the examples `fuzz` judges, whatever the pools' timing."""
    specs: list[ModelSpec] = []

    @hypothesis_seed(seed)
    @_fuzz_settings(max_examples, (Phase.generate,))
    @given(specs_for(world_size, impl, unused_params))
    def draw(spec: ModelSpec) -> None:
        specs.append(spec)

    draw()
    return specs


def fuzz(pool: RankPool, world_size: int, max_examples: int, seed: int, faults: tuple[str, ...] = (),
         on_example=None, impl: str = "ours", unused_params: bool = False) -> FuzzStats:
    """Run hypothesis against the pool; stats.failures[-1] is the shrunk example when it failed.
    `unused_params`: also draw parameters without gradients (off: see model_specs).

    [Note: Examples side by side]
    Hypothesis hands its property one example at a time, yet a pool group (harness/fuzz/pool.py)
    trains several at once. So the generate phase's examples are drawn first (`draw_specs`) and
    judged in their order, as many in flight as the group has pools, each recorded as hypothesis
    would record it. When every one passes, that is the whole run. When one fails (or the
    implementation refuses one), hypothesis runs as before, with the same seed: it hands the
    property the same examples again, answered from the judgements already made (not recorded
    twice), reaches the failure and shrinks it, each new example judged by the pool. A drawn
    example that hypothesis does not hand back is simply judged anew: the verdicts never rest on
    the prediction, only the speed does."""
    stats = FuzzStats()
    judged: dict[str, ExampleResult] = {}  # spec JSON -> judgement, from the examples judged ahead
    recorded: list[str] = []  # the judged-ahead examples recorded, in hypothesis's order

    def record(result: ExampleResult, seconds: float, cpu_s: float) -> None:
        if result.refused is not None:
            stats.refusals[result.refused.splitlines()[0]] = stats.refusals.get(result.refused.splitlines()[0], 0) + 1
            return
        stats.record(result, seconds, cpu_s)
        if on_example is not None:
            on_example(stats, result)

    # Judged ahead: the generate phase, every pool busy.
    specs = iter(draw_specs(world_size, max_examples, seed, impl, unused_params))
    pending: collections.deque = collections.deque()
    last, last_cpu = time.perf_counter(), time.process_time()
    stop = False
    while True:
        while not stop and len(pending) < pool.size and (spec := next(specs, None)) is not None:
            pending.append(start_example(pool, spec, faults, impl))
        if not pending:
            break
        result = finish_example(pending.popleft())
        judged[result.spec.to_json()] = result
        if stop:  # in flight when an earlier example stopped the run: hypothesis decides whether it counts
            continue
        # Each example is charged the time since the previous one finished: with examples side by
        # side, the sum is the wall time of the run, as with one at a time.
        now, now_cpu = time.perf_counter(), time.process_time()
        record(result, now - last, now_cpu - last_cpu)
        last, last_cpu = now, now_cpu
        recorded.append(result.spec.to_json())
        stop = not result.ok
    if not stop:
        return stats

    # Hypothesis as it always runs: the same examples, answered from `judged`, then shrinking.
    position = 0  # in `recorded`, while hypothesis hands back the same examples in the same order

    @hypothesis_seed(seed)
    @_fuzz_settings(max_examples, (Phase.generate, Phase.shrink))
    @given(specs_for(world_size, impl, unused_params))
    def prop(spec: ModelSpec) -> None:
        nonlocal position
        key = spec.to_json()
        if position < len(recorded) and key == recorded[position]:  # judged and counted above
            position += 1
            result = judged[key]
        else:
            position = len(recorded)  # off the drawn path (or past it): every example counts from here
            start, start_cpu = time.perf_counter(), time.process_time()
            result = judged.get(key) or run_example(pool, spec, faults, impl)
            judged[key] = result
            record(result, time.perf_counter() - start, time.process_time() - start_cpu)
        if result.refused is not None:  # a model this implementation refuses clearly: not an example
            reject()
        if not result.ok:
            raise _Falsified(result.summary())

    try:
        prop()
    except _Falsified:
        pass
    except Unsatisfiable:  # every drawn model refused: stats.num_examples says so (main: NOT RUN)
        pass
    return stats


def format_failure(result: ExampleResult, impl: str = "ours") -> str:
    spec = result.spec
    lines = [f"minimal failing model (W={spec.world_size}, optimizer={spec.optimizer.kind}, steps={spec.steps}, "
             f"data={spec.data_mode}, accumulation={spec.accumulation}, faults={list(result.faults)}):",
             describe(spec), f"  spec: {spec.to_json()}", f"  first divergence: {result.summary()}"]
    if result.error is not None:
        lines.append("  " + "\n  ".join(result.error.strip().splitlines()[-15:]))
    lines.append(f"  replay: {replay_command(spec, result.faults, impl)}")
    return "\n".join(lines)


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


def main(world_size: int, max_examples: int, seed: int, faults: tuple[str, ...], replay: str | None,
         out_dir: Path, threads: int, example_timeout_s: float, progress: bool = True, impl: str = "ours",
         pools: int | None = 1) -> bool:
    """True when every example passed (`pools` None: `auto_pools`). Library-level: raises
    UserError for bad arguments (before any rank starts), PoolLost when the infrastructure took a
    rank away; never exits."""
    if max_examples < 1:
        raise UserError(f"--max-examples={max_examples} must be >= 1")
    if threads < 1:
        raise UserError(f"--threads={threads} must be >= 1 (intra-op threads per rank)")
    if not example_timeout_s > 0:
        raise UserError(f"--example-timeout={example_timeout_s} must be > 0 seconds")
    pools = auto_pools(max_examples, threads) if pools is None else pools
    if pools < 1:
        raise UserError(f"--pools={pools} must be >= 1 (pools of W ranks training examples side by side)")
    if not 1 <= world_size <= MAX_CPU_WORLD_SIZE:
        raise UserError(f"--world-size={world_size} must be between 1 and {MAX_CPU_WORLD_SIZE} (every rank of the "
                        f"pool is a process importing torch on this host)")
    from harness.adapters.registry import resolve_sharded_impl

    resolve_sharded_impl(impl, "fuzz", "the fuzzer needs a sharded implementation")
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
    config = PoolConfig(world_size, out_dir / "logs", threads=threads, example_timeout_s=example_timeout_s)
    # This process builds the reference and judges tensors of a few dozen elements while the ranks
    # train beside it: one intra-op thread is several times faster per op than a pool of them.
    parent_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with OutputDir(out_dir, uuid.uuid4().hex, ("logs", STATS_FILE)):  # owned and locked: one run's logs and figures
            return _main(config, spec, max_examples, seed, faults, progress, impl, pools, out_dir)
    finally:
        torch.set_num_threads(parent_threads)


def _main(config: PoolConfig, spec: ModelSpec | None, max_examples: int, seed: int, faults: tuple[str, ...],
          progress: bool, impl: str, pools: int, out_dir: Path) -> bool:
    world_size = config.world_size
    with PoolGroup(config, 1 if spec is not None else pools) as pool:
        # The first example pays for lazy imports and kernel set-up in every rank: start-up, not rate.
        warm = time.perf_counter()
        for submitted in [start_example(pool, warm_up_spec(world_size), (), impl) for _ in range(pool.size)]:
            finish_example(submitted)  # one per pool: `submit` hands each to the pool with none in flight
        if spec is None:
            _warm_up_hypothesis(world_size, impl)
        start_s = pool.start_s + time.perf_counter() - warm
        what = f"pool of {world_size} ranks" if pool.size == 1 else f"{pool.size} pools of {world_size} ranks"
        print(f"[fuzz] {what} started in {start_s:.1f}s", flush=True)
        if spec is not None:
            result = run_example(pool, spec, faults, impl)
            exit_error = _close(pool)
            print(describe(spec))
            if result.refused is not None:  # not run, so not judged: never a pass
                print(f"[fuzz] replay: NOT RUN: impl={impl} refused the model at wrap: {result.refused}")
                return False
            print("[fuzz] replay: " + (f"pass (margins {_fmt_margins(result.margins)})" if result.ok
                                       else "FAIL\n" + format_failure(result, impl)))
            if result.ok and exit_error is not None:
                print(f"[fuzz] replay: ERROR: {exit_error}")
                return False
            return result.ok

        def show(stats: FuzzStats, result: ExampleResult) -> None:
            if progress and (stats.num_examples % 10 == 0 or not result.ok):
                print(f"[fuzz] {stats.num_examples} examples, {len(stats.failures)} failing, "
                      f"{stats.num_examples / max(stats.example_s, 1e-9):.1f} examples/s", flush=True)

        wall = time.perf_counter()
        stats = fuzz(pool, world_size, max_examples, seed, faults, show, impl)
        wall = time.perf_counter() - wall
        restarts = pool.num_starts - pool.size
        exit_error = _close(pool)
    rate = stats.num_examples / max(wall, 1e-9)
    write_stats(out_dir, impl, world_size, stats, wall, start_s, pool.size)
    print(f"[fuzz] impl={impl} W={world_size} seed={seed} faults={list(faults)}: {stats.num_examples} examples "
          f"(shrinking included) in {wall:.1f}s = {rate:.1f} examples/s; pool start-up {start_s:.1f}s "
          f"paid once, {restarts} restart(s) after failing examples, {pool.size} pool(s) side by side")
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
        print("[fuzz] FAIL: " + format_failure(stats.failures[-1], impl))
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
