"""The fuzzer's search: hypothesis draws models (harness/fuzz/strategies.py), a pool of W ranks
trains each (harness/fuzz/pool.py), the harness's checks judge it (harness/fuzz/check.py); a
failure is shrunk to a minimal model and printed as a ready-to-run case. The run's figures
(FuzzStats) are printed and written for the bench (`write_stats`)."""

from __future__ import annotations

import collections
import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Unsatisfiable

from harness.fuzz.check import ExampleResult, finish_example, run_example, start_example
from harness.fuzz.pool import RankPool
from harness.fuzz.spec import ModelSpec, describe
from harness.fuzz.strategies import specs_for


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


def replay_command(spec: ModelSpec, faults: tuple[str, ...], impl: str = "ours", backend: str = "gloo") -> str:
    cmd = f"python -m harness fuzz --world-size {spec.world_size} --replay {shlex.quote(spec.to_json())}"
    cmd += f" --backend {backend}" if backend != "gloo" else ""
    cmd += f" --impls {impl}" if impl != "ours" else ""
    return cmd + (f" --faults {','.join(faults)}" if faults else "")


def warm_up_hypothesis(world_size: int, impl: str, drawn_world_size: bool = False) -> None:
    """Hypothesis's one-off costs in this process, paid before the rate is measured: a full garbage
    collection when it first seeds the random generators it manages, and its scan of the loaded
    modules for constants to draw."""
    draw_specs(world_size, 2, 0, impl, drawn_world_size=drawn_world_size)


def _fuzz_settings(max_examples: int, phases: tuple[Phase, ...]) -> settings:
    return settings(max_examples=max_examples, deadline=None, database=None, report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck), print_blob=False, phases=phases)


def draw_specs(world_size: int, max_examples: int, seed: int, impl: str = "ours",
               unused_params: bool = False, drawn_world_size: bool = False) -> list[ModelSpec]:
    """The models hypothesis's generate phase hands the property for this seed, in order, drawn
    without running any: its choices depend on the examples' outcomes only once one fails or is
    rejected, so until then these are the examples `fuzz` judges, whatever the pools' timing."""
    specs: list[ModelSpec] = []

    @hypothesis_seed(seed)
    @_fuzz_settings(max_examples, (Phase.generate,))
    @given(specs_for(world_size, impl, unused_params, drawn_world_size))
    def draw(spec: ModelSpec) -> None:
        specs.append(spec)

    draw()
    return specs


def fuzz(pool: RankPool, world_size: int, max_examples: int, seed: int, faults: tuple[str, ...] = (),
         on_example=None, impl: str = "ours", unused_params: bool = False,
         drawn_world_size: bool = False) -> FuzzStats:
    """Run hypothesis against the pool; stats.failures[-1] is the shrunk example when it failed.
    `unused_params`: also draw parameters without gradients (off: see model_specs);
    `drawn_world_size`: each example at a W of its own up to `world_size` (a `SimulatedPool`).

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
    specs = iter(draw_specs(world_size, max_examples, seed, impl, unused_params, drawn_world_size))
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
    @given(specs_for(world_size, impl, unused_params, drawn_world_size))
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


def format_failure(result: ExampleResult, impl: str = "ours", backend: str = "gloo") -> str:
    spec = result.spec
    lines = [f"minimal failing model (W={spec.world_size}, optimizer={spec.optimizer.kind}, steps={spec.steps}, "
             f"data={spec.data_mode}, accumulation={spec.accumulation}, faults={list(result.faults)}):",
             describe(spec), f"  spec: {spec.to_json()}", f"  first divergence: {result.summary()}"]
    if result.error is not None:
        lines.append("  " + "\n  ".join(result.error.strip().splitlines()[-15:]))
    lines.append(f"  replay: {replay_command(spec, result.faults, impl, backend)}")
    return "\n".join(lines)
