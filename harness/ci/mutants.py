"""`python -m harness mutants`: every planted fault must be caught, and the honest run must pass
with room to spare. Per implementation (`--impls`, default ours): the collective faults
(harness/run/dist_faults.py, planted in what torch.distributed delivers: any implementation) and,
for impl=ours, the faults planted inside impl/ (every fault of harness/faults.py is one of the two); a fault an implementation cannot
take is reported n/a (impl/'s faults elsewhere; a collective fault that never met a collective it
acts on, NEVER_ACTED).

Two batteries, both once unmutated and once per fault:
- the gate matrix (catalog cases through the standard run machinery; a fault is part of the
  Cell, so every mutant of one world size shares ONE torchrun launch);
- a fixed corpus of fuzz models through one persistent rank pool per world size: the features
  the catalog cases lack (tied parameters in one unit, gradient accumulation, frozen parameters,
  units with fewer elements than ranks, nested units).
A mutant is caught when any cell or corpus model fails a check (or a rank raises or hangs); the
table names the check of its strongest evidence and its |diff| / tol. The honest margin is the
largest |diff| / tol of every tolerance check over every honest cell and corpus model.
"""

from __future__ import annotations

import copy
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from cases.catalog import CASES, OptimizerSpec
from harness.judge.checks import BOUNDED, JUDGED
from harness.judge.result import Judgement, Verdict, first_of
from harness.errors import UserError
from harness.fuzz.check import ExampleResult, run_example
from harness.fuzz.pool import PoolConfig, PoolExitError, RankPool
from harness.fuzz.spec import BlockSpec, ModelSpec
from harness.faults import FAULTS, NEVER_ACTED, check_faults, of_layer
from harness.run.output import OutputDir
from harness.run.snapshot import write_atomic_text

GATE_CASES = ("mlp", "transformer")
GATE_WORLD_SIZES = (2, 4)  # W = 4: uneven and smaller-than-W flat parameters (see cases/catalog.py)
GATE_STEPS = 2
CORPUS_WORLD_SIZES = (2, 4)
HONEST = "(none)"
# Faults that act only under a feature the standard cases lack run those cases too (and so do the
# honest cells, so the honest margin covers them): harness/faults.py, each fault's `cases`.
# Real architectures (cases/architectures.py): every fault runs on each too, honestly and planted,
# and the per-case table shows it caught on each. A fault that acts only under a feature a case
# lacks cannot act there: the table names the feature instead of counting the fault.
ARCH_CASES = ("gpt2", "llama", "moe")


# Per fault with a need (harness/faults.py `needs`): whether a case has that feature.
ACTS_ON = {
    "grad_accum_overwrite": lambda case, features: features.grad_accum > 1,
    "master_lost_to_param_dtype": lambda case, features: features.mixed_precision,
    "replica_grad_drift": lambda case, features: features.mesh != "shard",
    "tied_param_duplicated": lambda case, features: _has_tied_parameter(case.build_model()),
    "buffers_zeroed_at_wrap": lambda case, features: any(True for _ in case.build_model().buffers()),
    "unused_params_stepped": lambda case, features: _has_parameter_without_gradient(case),
    "reduce_at_last_gradient": lambda case, features: _has_rank_dependent_gradient(case),
    "clip_twice": lambda case, features: features.clip_norm_type is not None,
    "clip_norm_world_group": lambda case, features: features.clip_norm_type is not None and features.mesh == "hybrid",
    "grad_sync_every_micro": lambda case, features: features.grad_accum > 1,
    "reshard_after_forward_ignored": lambda case, features: not features.reshard_after_forward,
    "mesh_dims_swapped": lambda case, features: features.mesh != "shard",
    "zero1_state_replicated": lambda case, features: features.zero1,
    "grad_scale_from_step_6": lambda case, features: GATE_STEPS >= 6,
    # dividing by a power of two is exact in any dtype
    "grad_predivide_param_dtype": lambda case, features: any(w & (w - 1) for w in GATE_WORLD_SIZES),
    # the gate runs real ranks, at most 16 (`run --backend simulated --world-sizes 128` shows it)
    "rank_index_in_6_bits": lambda case, features: max(GATE_WORLD_SIZES) > 64,
}
# The needs answered by building the model (a case missing a package cannot say).
_BUILDS_THE_MODEL = ("tied_param_duplicated", "buffers_zeroed_at_wrap", "unused_params_stepped", "reduce_at_last_gradient")


def fault_cannot_act(fault: str, case_name: str) -> str | None:
    """Why `fault` cannot act on a catalog case (the feature it needs and the case lacks), or None.

    Answering may build the case's model (tied parameters, buffers); where the case needs a package
    this environment lacks, the answer is "unknown without <package>" rather than an ImportError."""
    from cases.catalog import get_case

    need = FAULTS[fault].needs if fault in FAULTS else None
    if need is None:
        return None
    case = get_case(case_name)
    if fault in _BUILDS_THE_MODEL and case.missing_requirements():
        return f"unknown without {', '.join(case.missing_requirements())}"
    return None if ACTS_ON[fault](case, case.features) else f"n/a: needs {need}"


def _has_parameter_without_gradient(case) -> bool:
    """Whether the plain model's first step leaves a trainable parameter without a gradient."""
    from harness.adapters.local_step import forward_backward

    model = case.build_model()
    inputs, targets = case.make_batch(case.seed, 1, case.global_batch)
    forward_backward(model, case.loss_fn, inputs, targets, 1)
    return any(p.requires_grad and p.grad is None for p in model.parameters())


def _has_rank_dependent_gradient(case) -> bool:
    """Whether, on the first step's batch split over the gate's world sizes, one rank gives a
    trainable parameter a gradient and another does not."""
    from cases.data import local_batch
    from harness.adapters.local_step import forward_backward

    if "split" not in case.data_modes:
        return False
    batch = case.make_batch(case.seed, 1, case.global_batch)
    built = case.build_model()
    for world_size in GATE_WORLD_SIZES:
        if case.global_batch % world_size:
            continue
        with_grad = set()
        for rank in range(world_size):
            model = copy.deepcopy(built)
            inputs, targets = local_batch(batch, "split", rank, world_size)
            forward_backward(model, case.loss_fn, inputs, targets, 1)
            with_grad.add(frozenset(n for n, p in model.named_parameters() if p.grad is not None))
        if len(with_grad) > 1:
            return True
    return False


def _has_tied_parameter(model) -> bool:
    return len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.named_parameters()))


def corpus(world_size: int) -> dict[str, ModelSpec]:
    """Fixed fuzz models covering what the catalog cases do not."""
    w = world_size
    adamw = OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01)
    sgd = OptimizerSpec("sgd", lr=0.05, momentum=0.9)
    return {
        "tied_accum": ModelSpec(w, 3, 2, (
            BlockSpec(width=3, tied=True, gain=True, aux_numel=w + 1),
            BlockSpec(width=2, bias=False, aux_numel=2 * w - 1),
        ), adamw, steps=2, batch_per_rank=2, accumulation=2, data_mode="split", seed=1),
        "nested_frozen_small": ModelSpec(w, 2, 1, (
            BlockSpec(width=4, frozen=True, inner=BlockSpec(width=1, bias=False, inner=BlockSpec(
                width=2, tied=True, aux_numel=max(1, w - 1)))),
        ), sgd, steps=2, batch_per_rank=2, accumulation=2, sync_every_micro=False, data_mode="identical", seed=2),
    }


@dataclass
class Evidence(Judgement):
    """The judgement of one run (gate cell or corpus model) of one mutant."""

    source: str  # 'gate <cell id>' or 'fuzz <corpus name> W=<w>'

    @property
    def not_applicable(self) -> bool:
        """The fault never acted in this run (a collective fault the implementation never met)."""
        return self.error is not None and NEVER_ACTED in self.error

    @property
    def failed(self) -> bool:
        return (self.error is not None and not self.not_applicable) or bool(self.violations)


@dataclass
class MutantRow:
    mutant: str
    what: str
    evidence: list[Evidence] = field(default_factory=list)
    cannot_take: str | None = None  # why the implementation cannot take this fault at all

    @property
    def caught(self) -> bool:
        return any(e.failed for e in self.evidence)

    @property
    def not_applicable(self) -> str | None:
        """Why no run could show this fault: the implementation cannot take it, or it never acted."""
        if self.cannot_take:
            return self.cannot_take
        if self.mutant != HONEST and not self.caught and self.evidence and all(
                e.not_applicable or not e.source.startswith("gate") for e in self.evidence) and any(
                e.not_applicable for e in self.evidence):
            return "n/a: never acted (no collective it acts on in the training step)"
        return None

    def strongest(self) -> Evidence | None:
        failed = [e for e in self.evidence if e.failed]
        if not failed:
            return None
        # The gate's own evidence first; then an exact check (inf) or the largest ratio; a crash
        # only when nothing else caught it.
        return max(failed, key=lambda e: (e.source.startswith("gate"), max((v.ratio for v in e.violations), default=-1.0)))

    def failing(self, source: str) -> str:
        runs = [e for e in self.evidence if e.source.startswith(source) and not e.not_applicable]
        return f"{sum(e.failed for e in runs)}/{len(runs)}"

    def check(self) -> str:
        e = self.strongest()
        if e is None:
            return "-"
        if e.first_divergence is None:
            return "crash"
        return e.first_divergence.check

    def ratio(self, checks: tuple[str, ...] = BOUNDED) -> float:
        """|diff| / tol of the first divergence of its strongest evidence; for an honest row the
        largest margin of `checks`."""
        if self.mutant == HONEST:
            return max((e.margins.get(c, 0.0) for e in self.evidence for c in checks), default=0.0)
        e = self.strongest()
        if e is None:
            return max((e.margins.get(c, 0.0) for e in self.evidence for c in JUDGED), default=0.0)
        return e.first_divergence.ratio if e.first_divergence is not None else math.inf

    def first_divergence(self) -> str:
        e = self.strongest()
        if e is None:
            return ""
        if e.first_divergence is None:
            return f"{e.source}: " + (e.error or "").strip().splitlines()[-1][:200]
        return e.first_divergence.describe(e.source)


def _gate_evidence(out_dir: Path, faults: list[str], timeout_s: float, world_sizes: tuple[int, ...],
                   arch_cases: tuple[str, ...] = (), impl: str = "ours") -> dict[str, list[Evidence]]:
    from harness.run.orchestrate import Progress, run_plan
    from harness.run.plan import build_plan
    from harness.report.build import build_report, report_files
    from harness.judge.verdict import evaluate

    from cases.catalog import get_case

    extra = tuple(sorted({c for f in faults for c in FAULTS[f].cases}))
    every_case = GATE_CASES + extra + arch_cases
    # Each case in the data modes it has (batchnorm: identical only), one plan for all of them.
    modes_of = {c: tuple(m for m in ("identical", "split") if m in get_case(c).data_modes) for c in every_case}
    plans = [build_plan(cases=tuple(c for c in every_case if modes_of[c] == modes), impls=(impl,),
                        world_sizes=world_sizes, data_modes=modes, steps=GATE_STEPS, timeout_s=timeout_s,
                        out_dir=out_dir) for modes in dict.fromkeys(modes_of.values())]
    base = replace(plans[0], cells=sum((p.cells for p in plans), ()), references=sum((p.references for p in plans), ()),
                   skipped=sum((p.skipped for p in plans), ()))
    acts = {(f, c): fault_cannot_act(f, c) is None for f in faults for c in arch_cases}
    cells = base.cells + tuple(replace(c, faults=(f,)) for f in faults for c in base.cells
                               if c.case in GATE_CASES + FAULTS[f].cases or acts.get((f, c.case)))
    plan = replace(base, cells=cells)
    with OutputDir(plan.out_dir, plan.run_id, ("snapshots", "logs", "init")) as output:
        outcome = run_plan(plan, Progress(plan))
        results, references, matrices = evaluate(plan, outcome)
        output.write_report_set(report_files(
            build_report(results, references, matrices, outcome, "python -m harness mutants (gate battery)")))
    by_fault: dict[str, list[Evidence]] = {}
    for r in results:
        key = r.cell.faults[0] if r.cell.faults else HONEST
        by_fault.setdefault(key, []).append(
            Evidence(source=f"gate {r.cell.cell_id}", violations=r.violations, margins=r.margins, error=r.error))
    for r in references:
        if r.verdict != Verdict.PASS:  # a broken reference spoils every comparison: report it as honest failure
            by_fault.setdefault(HONEST, []).append(Evidence(source=f"gate {r.cell.cell_id}", violations=r.violations, error=r.error))
    return by_fault


def corpus_for(impl: str, world_size: int) -> dict[str, ModelSpec]:
    """The corpus as `impl` can run it, as the fuzzer draws for it (fuzz/main.py `specs_for`): an
    adapter that does not map gradient accumulation (its `unsupported` names it, as the ten-line
    FSDP1 adapter's does) trains the accumulation models with one micro-batch per step instead of
    failing them honestly on a sync control it never declared; one that refuses 0-d parameters
    (torch FSDP2, DeepSpeed) trains them without their 0-d gains instead of not at all."""
    from cases.features import Features
    from harness.adapters.registry import resolve_impl

    adapter = resolve_impl(impl)

    def takes(spec: ModelSpec) -> ModelSpec:
        if spec.accumulation > 1 and adapter.unsupported(Features(grad_accum=spec.accumulation)) is not None:
            spec = replace(spec, accumulation=1)
        if not adapter.shards_scalar_params:
            spec = replace(spec, blocks=tuple(_without_gain(b) for b in spec.blocks))
        return spec

    return {name: takes(spec) for name, spec in corpus(world_size).items()}


def _without_gain(block: BlockSpec) -> BlockSpec:
    """The block with its 0-d gain's element moved into its 1-D aux parameter: the unit's numel,
    the padding edge the corpus model was built to hit, is unchanged."""
    return replace(block, gain=False, aux_numel=block.aux_numel + int(block.gain),
                   inner=None if block.inner is None else _without_gain(block.inner))


def _corpus_evidence(out_dir: Path, faults: list[str], world_sizes: tuple[int, ...],
                     impl: str = "ours") -> dict[str, list[Evidence]]:
    by_fault: dict[str, list[Evidence]] = {}
    for w in world_sizes:
        pool_evidence: list[tuple[str, Evidence]] = []
        try:
            with RankPool(PoolConfig(w, out_dir / "logs", example_timeout_s=60.0)) as pool:
                for name, spec in corpus_for(impl, w).items():
                    for fault in [HONEST, *faults]:
                        res: ExampleResult = run_example(pool, spec, () if fault == HONEST else (fault,), impl)
                        if res.refused is not None:  # the implementation refuses this model at wrap: no run
                            continue
                        pool_evidence.append((fault, Evidence(source=f"fuzz {name} W={w}", violations=res.violations,
                                                              margins=res.margins, error=res.error)))
        except PoolExitError as e:  # complete evidence from ranks that failed at exit: no verdict on any of it
            pool_evidence = [(fault, Evidence(source=ev.source, error=f"the pool failed at exit: {e}"))
                             for fault, ev in pool_evidence]
        for fault, ev in pool_evidence:
            by_fault.setdefault(fault, []).append(ev)
    return by_fault


def _fmt_ratio(x: float) -> str:
    return "inf (exact check)" if math.isinf(x) else f"{x:.3g}"


def table(rows: list[MutantRow]) -> str:
    lines = ["| mutant | caught | check | margin: diff/tol | failing runs: gate, fuzz | first divergence |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if row.not_applicable:
            lines.append(f"| {row.mutant} | n/a | - | - | {row.failing('gate')}, {row.failing('fuzz')} | "
                         f"{row.not_applicable} |")
        elif row.mutant == HONEST:
            ok = not row.caught
            lines.append(f"| {HONEST} (honest) | {'passes' if ok else 'FAILS'} | - | {_fmt_ratio(row.ratio())} (max over "
                         f"{len(row.evidence)} runs) | {row.failing('gate')}, {row.failing('fuzz')} | "
                         f"{row.first_divergence().replace('|', '/')} |")
        else:
            lines.append(f"| {row.mutant} | {'yes' if row.caught else 'NO'} | {row.check()} | {_fmt_ratio(row.ratio())} | "
                         f"{row.failing('gate')}, {row.failing('fuzz')} | {row.first_divergence().replace('|', '/')} |")
    return "\n".join(lines)


def case_table(rows: list[MutantRow], arch_cases: tuple[str, ...]) -> tuple[str, bool]:
    """Per fault and architecture case: caught (the check of the first divergence and its
    |diff| / tol), NO, or n/a with the feature the case lacks; and whether each fault that can act
    on a case is caught there and the honest cells of every case pass."""
    lines = ["| mutant | " + " | ".join(arch_cases) + " |", "| --- |" + " --- |" * len(arch_cases)]
    ok = True
    for row in rows:
        entries = []
        for case in arch_cases:
            runs = [e for e in row.evidence if e.source.startswith(f"gate {case}.")]
            if row.mutant == HONEST:
                good = bool(runs) and not any(e.failed for e in runs)
                entries.append(f"{'passes' if good else 'FAILS'} ({len(runs)} cells)")
                ok &= good
                continue
            why = fault_cannot_act(row.mutant, case) or row.not_applicable
            if not why and runs and all(e.not_applicable for e in runs):
                why = "n/a: never acted"
            if why:
                entries.append(why)
                continue
            failed = [e for e in runs if e.failed]
            ok &= bool(failed)
            if not failed:
                entries.append(f"NO (0/{len(runs)} cells)")
                continue
            first = first_of([e.first_divergence for e in failed if e.first_divergence is not None])
            what = "crash" if first is None else f"{first.check} {_fmt_ratio(first.ratio)}"
            entries.append(f"yes: {what} ({len(failed)}/{len(runs)} cells)")
        label = f"{HONEST} (honest)" if row.mutant == HONEST else row.mutant
        lines.append(f"| {label} | " + " | ".join(entries) + " |")
    return "\n".join(lines), ok


def main(out_dir: Path, timeout_s: float, only: tuple[str, ...] | None = None,
         world_sizes: tuple[int, ...] | None = None, arch_cases: tuple[str, ...] = ARCH_CASES,
         impls: tuple[str, ...] = ("ours",)) -> bool:
    """world_sizes: both batteries at these W instead of GATE_WORLD_SIZES / CORPUS_WORLD_SIZES;
    arch_cases: the real architectures every fault also runs on (() for none); impls: each
    implementation's mutants in turn (built-in names or a user's 'file.py:Class')."""
    from harness.adapters.registry import resolve_sharded_impl

    planted = {name: fault.plants for name, fault in of_layer("impl").items()}
    gate_world_sizes = world_sizes or GATE_WORLD_SIZES
    corpus_world_sizes = world_sizes or CORPUS_WORLD_SIZES
    if min(gate_world_sizes) < 2:
        raise UserError(f"mutants world sizes {list(gate_world_sizes)}: every fault needs W >= 2 to act")
    if not impls or len(set(impls)) != len(impls):
        raise UserError(f"mutants --impls {','.join(impls)}: name each implementation once")
    names: dict[str, str] = {}  # adapter name (its output subdirectory) -> the --impls entry
    for impl in impls:
        adapter = resolve_sharded_impl(impl, "mutants", "no fault can act on it")
        if adapter.name in names:
            raise UserError(f"mutants --impls {names[adapter.name]} and {impl} share the name {adapter.name!r}; "
                            f"give one of them another `name`")
        names[adapter.name] = impl
    collective = {name: fault.plants for name, fault in of_layer("collective").items()}
    everything = {**planted, **collective}
    faults = list(only) if only else sorted(planted) + sorted(collective)
    check_faults(faults, impls if only else ("ours",), loop=False)
    unknown_cases = sorted(set(arch_cases) - set(CASES))
    if unknown_cases:
        raise UserError(f"mutants --cases: unknown case(s) {unknown_cases}; the real architectures are {list(ARCH_CASES)}")
    with OutputDir(out_dir, uuid.uuid4().hex, ("gate", "fuzz", "mutants.md")):
        start = time.monotonic()
        sections, ok = [], True
        for name, impl in names.items():
            sub = Path() if len(impls) == 1 else Path(name)
            impl_ok, text = _run(out_dir, sub, impl, faults, everything, timeout_s, gate_world_sizes,
                                 corpus_world_sizes, tuple(arch_cases))
            sections.append(text if len(impls) == 1 else f"## impl={impl}: {'PASS' if impl_ok else 'FAIL'}\n\n{text}")
            ok &= impl_ok
        text = "\n".join([f"# Mutants: {'PASS' if ok else 'FAIL'}", "", *sections, "",
                          f"Wall time {time.monotonic() - start:.0f}s."])
    write_atomic_text(out_dir / "mutants.md", text + "\n")
    print(text)
    print(f"report: {out_dir / 'mutants.md'}")
    return ok


def _run(out_dir: Path, sub: Path, impl: str, faults: list[str], descriptions: dict[str, str], timeout_s: float,
         gate_world_sizes: tuple[int, ...], corpus_world_sizes: tuple[int, ...],
         arch_cases: tuple[str, ...]) -> tuple[bool, str]:
    """One implementation's mutants: (every applicable fault caught and the honest runs pass, its section)."""
    runnable = [f for f in faults if impl == "ours" or f in of_layer("collective")]
    start = time.monotonic()
    gate = _gate_evidence(out_dir / "gate" / sub, runnable, timeout_s, gate_world_sizes, arch_cases, impl)
    gate_s = time.monotonic() - start
    fuzz = _corpus_evidence(out_dir / "fuzz" / sub, runnable, corpus_world_sizes, impl)
    rows = [MutantRow(HONEST, "unmutated", gate.get(HONEST, []) + fuzz.get(HONEST, []))]
    rows += [MutantRow(f, descriptions[f], gate.get(f, []) + fuzz.get(f, []),
                       None if f in runnable else "n/a: planted inside impl/, impl=ours only") for f in faults]
    for row in rows[1:]:
        # A fault that can act on none of the batteries' cases (the feature it needs is in none of
        # them) is named n/a with that need, never counted as missed nor as caught.
        battery = GATE_CASES + FAULTS[row.mutant].cases + tuple(arch_cases or ())
        if row.cannot_take is None and not row.caught and FAULTS[row.mutant].needs is not None and all(
                fault_cannot_act(row.mutant, c) for c in battery):
            row.cannot_take = (f"n/a: acts on none of the batteries' cases (needs "
                               f"{FAULTS[row.mutant].needs})")
    honest = rows[0]
    honest_margin = honest.ratio()
    mutants = [r for r in rows[1:] if not r.not_applicable]
    per_source = {
        "gate": [r for r in mutants if any(e.failed for e in r.evidence if e.source.startswith("gate"))],
        "fuzz": [r for r in mutants if any(e.failed for e in r.evidence if e.source.startswith("fuzz"))],
    }
    per_case, per_case_ok = case_table(rows, arch_cases) if arch_cases else ("", True)
    ok = not honest.caught and all(r.caught for r in mutants) and per_case_ok
    text = "\n".join([
        f"Batteries: gate matrix (cases {list(GATE_CASES)} for every fault, and per fault "
        f"{ {f: FAULTS[f].cases for f in runnable if FAULTS[f].cases} }; impl={impl}, W={list(gate_world_sizes)}, "
        f"identical+split data, {GATE_STEPS} steps, sgd+adamw; one launch for every mutant and world size, {gate_s:.0f}s) and the "
        f"fuzz corpus ({sorted(corpus(2))} at W={list(corpus_world_sizes)}, one rank pool per W; models the "
        f"implementation refuses at wrap are not run).",
        f"Caught by the gate battery: {len(per_source['gate'])}/{len(mutants)}; by the fuzz corpus: "
        f"{len(per_source['fuzz'])}/{len(mutants)} ({len(rows) - 1 - len(mutants)} n/a).", "",
        table(rows), "",
        f"Honest margin (largest |diff|/tol of the {'/'.join(BOUNDED)} checks over every honest run): "
        f"{honest_margin:.3g} (an honest run stays below 1; the gradient bound's own worst case for an honest "
        f"reduction of K same-signed terms is (K-1)/(K+1) of it, 0.6 at K = 4: docs/error_model.md, "
        f"'How close an honest run comes').",
        f"Honest bias margin (largest |count - n/2| / threshold of the sign counts of a gradient or an update, "
        f"|z| / 7.5 for fair coins; fails above 1): {honest.ratio(('bias',)):.3g}.",
        *(["", f"Per real architecture (the gate battery's cells of each case, W={list(gate_world_sizes)}, identical+split): "
           f"every fault that can act on a case is caught on it: {'yes' if per_case_ok else 'NO'}.", "", per_case]
          if arch_cases else []),
    ])
    return ok, text
