"""Golden baselines: the single-process reference's numerics, recorded once and checked by the gate.

The equivalence checks compare a sharded run with the plain model run in the same commit, so a
change to the model math itself (a different init, a new activation, a changed loss) passes
them: both sides move together. A baseline pins the plain model: `baseline record` stores, for
each case and optimizer of the reference run (impl=single, W = 1), every step's loss and a digest
of every gradient, parameter and module buffer; `gate --baseline FILE` compares the run's own
reference with it.

Format (`FORMAT`), JSON so that a baseline diffs and reviews like code:

    {"format": FORMAT, "key": {"torch", "cuda", "backend", "device", "gpu", "threads"},
     "recorded": {"git_commit", "python", "platform", "cpu_capability"},   # informational
     "cases": {case: {"steps": N, "optimizers": {kind: {
         "init": {name: [sum, norm]}, "init_buffers": {name: [sum, norm]},
         "steps": [{"step": t, "loss": L, "grads": {name: [sum, norm]}, "params": {name: [sum, norm]},
                    "buffers": {name: [sum, norm]}}]}}}}}

A digest is (sum, L2 norm) of the tensor, accumulated in float64 (fp32 values are exact in fp64).

[Note: Baseline tolerance]
The key (torch version, CUDA version and GPU name for a CUDA run, backend, device type, intra-op
threads per rank; harness/report/environment.py, taken from the run's plan) pins the kernels; a baseline
from another key is refused (PlanError, exit 2) rather than compared. Within a key the reference
is deterministic, and what a digest may still differ by is bounded by the error model: if every
element satisfies |a - b| <= tol (docs/error_model.md, the per-step tolerance the gate's own checks
use, computed from this run's shadow), then |sum(a) - sum(b)| <= sum(tol) and, by the reverse
triangle inequality, |norm(a) - norm(b)| <= norm(a - b) <= norm(tol). Initial parameters, the loss
and module buffers are exact (the buffers check's argument: [Note: Buffers] in harness/judge/diff.py).
The per-step bound does not cover rounding differences compounded over several free-running
steps; within one key there are none (the gate's run and the recording run are the same
computation), so on a machine whose kernels round differently, re-record the baseline there.

A baseline is validated on load (every type, every step 1..steps, the plan's cases and
optimizers): a malformed file is refused with one line naming the bad entry (exit 2). Checks
never stop at the shorter of two lists, and a non-finite value, recorded or measured, fails.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cases.catalog import get_case
from harness.run.evidence import check_snapshot_evidence, model_buffers, model_parameters
from harness.errors import PlanError
from harness.run.plan import RunPlan
from harness.run.snapshot import load_snapshot, snapshot_path, write_atomic_text
from harness.judge.diff import StepBounds
from harness.judge.result import Verdict, verdict_of
from harness.report.environment import BASELINE_KEY_FIELDS, baseline_key, plan_environment

FORMAT = "fsdp-equiv-baseline/3"  # /2: the key gained cuda and gpu; /3: module buffers
KEY_FIELDS = BASELINE_KEY_FIELDS


class BaselineRefused(PlanError):
    """The baseline cannot be compared with this run (malformed, another key, a case or steps it lacks)."""


class BaselineNotRecorded(RuntimeError):
    """The reference run cannot be recorded (it crashed, or produced non-finite values)."""


def environment_key(plan: RunPlan) -> dict:
    """The key a baseline of `plan`'s reference is recorded under, and checked against."""
    return baseline_key(plan.backend, plan.device, plan.threads)


def digest(t: torch.Tensor) -> list[float]:
    x = t.detach().double().reshape(-1)
    return [x.sum().item(), x.norm().item()]


def _digest_tolerance(tol: torch.Tensor) -> list[float]:
    t = tol.double().reshape(-1)
    return [t.sum().item(), t.norm().item()]


# -- record ---------------------------------------------------------------------------------------

def reference_plan(plan: RunPlan) -> RunPlan:
    """Only the plan's reference cells (impl=single, W = 1), run as the cells of one launch."""
    from dataclasses import replace

    return replace(plan, cells=plan.references, references=())


def baseline_from_snapshots(ref_plan: RunPlan) -> dict:
    """The baseline of a finished `reference_plan` run."""
    env = plan_environment(ref_plan)
    cases: dict = {}
    for ref in ref_plan.cells:
        optimizers = {}
        sizes, grad_names = model_parameters(ref.case)
        buffer_sizes = model_buffers(ref.case)
        for spec in get_case(ref.case).optimizers:
            path = snapshot_path(ref_plan.snapshot_dir, ref.cell_id, spec.kind)
            try:
                snap = load_snapshot(path)
                check_snapshot_evidence(snap, ref, spec.kind, ref_plan.run_id, sizes, grad_names, buffer_sizes)
            except Exception as e:
                raise BaselineNotRecorded(f"snapshot {path}: {type(e).__name__}: {e}") from None
            optimizers[spec.kind] = {
                "init": {n: digest(p) for n, p in snap["init"]["params"].items()},
                "init_buffers": {n: digest(b) for n, b in snap["init"]["buffers"]["values"].items()},
                "steps": [{"step": rec["step"], "loss": rec["loss"].double()[0].item(),
                           "grads": {n: digest(g) for n, g in rec["grads"].items()},
                           "params": {n: digest(p) for n, p in rec["params"].items()},
                           "buffers": {n: digest(b) for n, b in rec["buffers"]["values"].items()}}
                          for rec in snap["steps"]],
            }
        cases[ref.case] = {"steps": ref.steps, "optimizers": optimizers}
    bad = _first_non_finite(cases, "cases")
    if bad:
        raise BaselineNotRecorded(f"the reference run produced a non-finite value at {bad}: the case diverged")
    return {
        "format": FORMAT,
        "key": environment_key(ref_plan),
        "recorded": {k: env[k] for k in ("git_commit", "git_dirty", "python", "platform", "cpu_capability", "cudnn",
                                         "nccl")},
        "cases": cases,
    }


def _first_non_finite(obj, where: str) -> str | None:
    if isinstance(obj, float) and not math.isfinite(obj):
        return where
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        found = _first_non_finite(v, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}")
        if found:
            return found
    return None


def check_record_target(path: Path) -> None:
    """`baseline record --out FILE` must be writable; refused (exit 2) before the reference runs."""
    from harness.errors import UserError

    if str(path).strip() == "" or path.is_dir():
        raise UserError(f"baseline record --out={str(path)!r} must name a file (for example baselines/cpu.json)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"baseline record --out={path}: cannot write there ({e.strerror or e}); "
                        f"choose a writable location") from None


def write_baseline(path: Path, baseline: dict) -> None:
    write_atomic_text(Path(path), json.dumps(baseline, indent=1) + "\n")


# -- load and validate (before any rank starts) ---------------------------------------------------

def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _digests(where: str, value) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{where} is {type(value).__name__}, not {{name: [sum, norm]}}")
    for name, d in value.items():
        if not (isinstance(d, list) and len(d) == 2 and all(_is_number(x) for x in d)):
            raise ValueError(f"{where}.{name} is {d!r}, not [sum, norm]")


def validate_baseline(baseline) -> None:
    """ValueError naming the first malformed entry (see the format in the module docstring)."""
    if not isinstance(baseline, dict):
        raise ValueError(f"the file holds a {type(baseline).__name__}, not an object")
    if baseline.get("format") != FORMAT:
        raise ValueError(f"format={baseline.get('format')!r} is not {FORMAT!r}")
    key = baseline.get("key")
    if not isinstance(key, dict) or any(k not in key for k in KEY_FIELDS):
        raise ValueError(f"key={key!r} lacks one of {list(KEY_FIELDS)}")
    cases = baseline.get("cases")
    if not isinstance(cases, dict):
        raise ValueError(f"cases is {type(cases).__name__}, not an object")
    for case, entry in cases.items():
        where = f"cases.{case}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is {type(entry).__name__}, not an object")
        steps = entry.get("steps")
        if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
            raise ValueError(f"{where}.steps={steps!r} is not an integer >= 1")
        optimizers = entry.get("optimizers")
        if not isinstance(optimizers, dict):
            raise ValueError(f"{where}.optimizers is {type(optimizers).__name__}, not an object")
        for kind, opt in optimizers.items():
            w = f"{where}.optimizers.{kind}"
            if not isinstance(opt, dict):
                raise ValueError(f"{w} is {type(opt).__name__}, not an object")
            _digests(f"{w}.init", opt.get("init"))
            _digests(f"{w}.init_buffers", opt.get("init_buffers"))
            records = opt.get("steps")
            if not isinstance(records, list) or len(records) != steps:
                got = len(records) if isinstance(records, list) else type(records).__name__
                raise ValueError(f"{w}.steps has {got} records, {where}.steps={steps} says {steps}")
            for i, rec in enumerate(records):
                r = f"{w}.steps[{i}]"
                if not isinstance(rec, dict) or rec.get("step") != i + 1 or isinstance(rec.get("step"), bool):
                    raise ValueError(f"{r} is not the record of step {i + 1}")
                if not _is_number(rec.get("loss")):
                    raise ValueError(f"{r}.loss={rec.get('loss')!r} is not a number")
                _digests(f"{r}.grads", rec.get("grads"))
                _digests(f"{r}.params", rec.get("params"))
                _digests(f"{r}.buffers", rec.get("buffers"))


def load_baseline(path: str | Path, plan: RunPlan) -> dict:
    """The baseline at `path`, refused with one clear line when it cannot judge `plan`."""
    path = Path(path)
    try:
        baseline = json.loads(path.read_text())
    except OSError as e:
        raise BaselineRefused(f"--baseline={path}: cannot read it: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BaselineRefused(f"--baseline={path}: not JSON ({e})") from None
    try:
        validate_baseline(baseline)
    except ValueError as e:
        raise BaselineRefused(f"--baseline={path} is malformed: {e}; re-record it: python -m harness baseline "
                              f"record --out {path}") from None
    here = environment_key(plan)
    recorded = baseline["key"]
    differ = [f"{k}: baseline={recorded.get(k)!r} this run={here[k]!r}" for k in KEY_FIELDS if recorded.get(k) != here[k]]
    if differ:
        raise BaselineRefused(
            f"--baseline={path} was recorded under another environment ({'; '.join(differ)}); its numerics "
            f"are not comparable with this run's. Record one here: python -m harness baseline record --out {path}")
    for ref in plan.references:
        entry = baseline["cases"].get(ref.case)
        if entry is None:
            raise BaselineRefused(f"--baseline={path} has no case={ref.case} (has {sorted(baseline['cases'])}); "
                                  f"record it: python -m harness baseline record --cases {ref.case} --out FILE")
        if entry["steps"] < ref.steps:
            raise BaselineRefused(f"--baseline={path} recorded steps={entry['steps']} of case={ref.case}, this gate runs "
                                  f"steps={ref.steps}; run the gate with --steps <= {entry['steps']} or re-record")
        missing = [o.kind for o in get_case(ref.case).optimizers if o.kind not in entry["optimizers"]]
        if missing:
            raise BaselineRefused(f"--baseline={path} has no optimizer(s) {missing} for case={ref.case}; re-record it: "
                                  f"python -m harness baseline record --cases {ref.case} --out FILE")
    return baseline


# -- check ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BaselineViolation:
    case: str
    optimizer: str
    step: int  # 0: initial parameters
    quantity: str  # loss | init | buffers | grad | param | names
    name: str
    stat: str  # value | sum | norm
    actual: float
    expected: float
    tol: float

    def describe(self, path: str) -> str:
        d = abs(self.actual - self.expected) if math.isfinite(self.actual) and math.isfinite(self.expected) else float("inf")
        return (f"baseline {path}: case={self.case} optimizer={self.optimizer} step={self.step} {self.quantity} "
                f"'{self.name}' {self.stat}: actual={self.actual:.9g} baseline={self.expected:.9g} |diff|={d:.3g} "
                f"> tol={self.tol:.3g} (the single-process reference drifted from the recorded baseline)")


@dataclass
class BaselineResult:
    path: str
    case: str
    violations: list[BaselineViolation] = field(default_factory=list)
    error: str | None = None  # no reference snapshot to check
    num_checked: int = 0
    wall_s: float = 0.0  # seconds the check took (its JUnit test case's time)

    @property
    def verdict(self) -> Verdict:
        return verdict_of(self.error, self.violations)

    @property
    def cell_id(self) -> str:
        return f"baseline.{self.case}"


def _step_tolerances(snap: dict):
    """Per step: (loss tol, {name: grad tol}, {name: param tol}) of the error model, elementwise,
    from the run's shadow: the same tolerances the gate's per-step checks use (harness/judge/diff.py).
    The loss is exact: the reference replays the same local computation."""
    case = get_case(snap["cell"]["case"])
    bounds = StepBounds(case, case.optimizer(snap["optimizer"]), int(snap["world_size"]))
    for rec in snap["steps"]:
        grad_tols, param_tols = bounds.step(rec["step"], rec["shadow"])
        yield 0.0, grad_tols, param_tols


def within(actual: float, expected: float, tol: float) -> bool:
    """|actual - expected| <= tol, false for any NaN or Inf (Inf - Inf is NaN, not 0)."""
    return math.isfinite(actual) and math.isfinite(expected) and abs(actual - expected) <= tol


def _check_digests(out: BaselineResult, opt: str, step: int, quantity: str, tensors: dict, recorded: dict,
                   tols: dict | None) -> None:
    if set(tensors) != set(recorded):
        missing, extra = sorted(set(recorded) - set(tensors)), sorted(set(tensors) - set(recorded))
        out.violations.append(BaselineViolation(out.case, opt, step, "names", f"missing {missing[:3]} extra {extra[:3]}",
                                                "count", len(tensors), len(recorded), 0.0))
        return
    for name, t in tensors.items():
        actual = digest(t)
        allowed = _digest_tolerance(tols[name]) if tols is not None else [0.0, 0.0]
        for stat, a, e, tol in zip(("sum", "norm"), actual, recorded[name], allowed, strict=True):
            out.num_checked += 1
            if not within(a, e, tol):
                out.violations.append(BaselineViolation(out.case, opt, step, quantity, name, stat, a, e, tol))


def check_baseline(plan: RunPlan, baseline: dict, path: str) -> list[BaselineResult]:
    """One result per case of the plan: its reference run (this gate's own) against the baseline
    (validated by load_baseline: every case and optimizer of the plan is in it)."""
    results = []
    for ref in plan.references:
        out = BaselineResult(path, ref.case)
        results.append(out)
        start = time.perf_counter()
        recorded_case = baseline["cases"][ref.case]
        sizes, grad_names = model_parameters(ref.case)
        buffer_sizes = model_buffers(ref.case)
        for spec in get_case(ref.case).optimizers:
            recorded = recorded_case["optimizers"][spec.kind]
            snap_path = snapshot_path(plan.snapshot_dir, ref.cell_id, spec.kind)
            try:
                snap = load_snapshot(snap_path)
                check_snapshot_evidence(snap, ref, spec.kind, plan.run_id, sizes, grad_names, buffer_sizes)
            except Exception as e:
                out.error = (f"no usable reference snapshot {snap_path} ({type(e).__name__}: {e}); "
                             f"the reference run failed, see its row")
                break
            _check_digests(out, spec.kind, 0, "init", snap["init"]["params"], recorded["init"], None)
            _check_digests(out, spec.kind, 0, "buffers", snap["init"]["buffers"]["values"], recorded["init_buffers"], None)
            # The run's steps are 1..ref.steps (checked above); the baseline may hold more.
            recorded_steps = recorded["steps"][: ref.steps]
            for rec, rec_base, (loss_tol, grad_tols, param_tols) in zip(snap["steps"], recorded_steps,
                                                                        list(_step_tolerances(snap)), strict=True):
                assert rec["step"] == rec_base["step"], (rec["step"], rec_base["step"])
                loss = rec["loss"].double()[0].item()
                out.num_checked += 1
                if not within(loss, rec_base["loss"], loss_tol):
                    out.violations.append(BaselineViolation(ref.case, spec.kind, rec["step"], "loss", "<loss>", "value",
                                                            loss, rec_base["loss"], loss_tol))
                _check_digests(out, spec.kind, rec["step"], "grad", rec["grads"], rec_base["grads"], grad_tols)
                _check_digests(out, spec.kind, rec["step"], "param", rec["params"], rec_base["params"], param_tols)
                _check_digests(out, spec.kind, rec["step"], "buffers", rec["buffers"]["values"], rec_base["buffers"], None)
        out.violations.sort(key=lambda v: (v.step, ("names", "init", "loss", "buffers", "grad", "param").index(v.quantity)))
        out.wall_s = time.perf_counter() - start
    return results
