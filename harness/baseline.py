"""Golden baselines: the single-process reference's numerics, recorded once and checked by the gate.

The equivalence checks compare a sharded run with the plain model run in the same commit, so a
change to the model math itself (a different init, a new activation, a changed loss) passes
them: both sides move together. A baseline pins the plain model: `baseline record` stores, for
each case and optimizer of the reference run (impl=single, W = 1), every step's loss and a digest
of every gradient and parameter; `gate --baseline FILE` compares the run's own reference with it.

Format (`FORMAT`), JSON so that a baseline diffs and reviews like code:

    {"format": FORMAT, "key": {"torch", "backend", "device", "threads"},
     "recorded": {"git_commit", "python", "platform", "cpu_capability"},   # informational
     "cases": {case: {"steps": N, "optimizers": {kind: {
         "init": {name: [sum, norm]},
         "steps": [{"step": t, "loss": L, "grads": {name: [sum, norm]}, "params": {name: [sum, norm]}}]}}}}}

A digest is (sum, L2 norm) of the tensor, accumulated in float64 (fp32 values are exact in fp64).

[Note: Baseline tolerance]
The key (torch version, backend, device type, intra-op threads) pins the kernels; a baseline
from another key is refused (PlanError, exit 2) rather than compared. Within a key the reference
is deterministic, and what a digest may still differ by is bounded by the error model: if every
element satisfies |a - b| <= tol (docs/error_model.md, the per-step tolerance the gate's own checks
use, computed from this run's shadow), then |sum(a) - sum(b)| <= sum(tol) and, by the reverse
triangle inequality, |norm(a) - norm(b)| <= norm(a - b) <= norm(tol). Initial parameters are exact.
The per-step bound does not cover rounding differences compounded over several free-running
steps; within one key there are none (the gate's run and the recording run are the same
computation), so on a machine whose kernels round differently, re-record the baseline there.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cases.catalog import get_case
from harness.plan import Cell, PlanError, RunPlan
from harness.snapshot import load_snapshot, snapshot_path, write_atomic_text
from harness.tolerance import SAFETY_FACTOR, ErrorModel, OptimizerErrorState

FORMAT = "fsdp-equiv-baseline/1"
KEY_FIELDS = ("torch", "backend", "device", "threads")


class BaselineRefused(PlanError):
    """The baseline cannot be compared with this run (another key, a case or steps it lacks)."""


def environment_key(threads: int) -> dict:
    from harness.report import environment

    env = environment(threads)
    return {"torch": env["torch"], "backend": env["backend"], "device": env["device"], "threads": threads}


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
    from harness.report import environment

    env = environment(ref_plan.threads)
    cases: dict = {}
    for ref in ref_plan.cells:
        optimizers = {}
        for spec in get_case(ref.case).optimizers:
            snap = load_snapshot(snapshot_path(ref_plan.snapshot_dir, ref.cell_id, spec.kind))
            optimizers[spec.kind] = {
                "init": {n: digest(p) for n, p in snap["init"]["params"].items()},
                "steps": [{"step": rec["step"], "loss": rec["loss"].double()[0].item(),
                           "grads": {n: digest(g) for n, g in rec["grads"].items()},
                           "params": {n: digest(p) for n, p in rec["params"].items()}}
                          for rec in snap["steps"]],
            }
        cases[ref.case] = {"steps": ref.steps, "optimizers": optimizers}
    return {
        "format": FORMAT,
        "key": environment_key(ref_plan.threads),
        "recorded": {"git_commit": env["git_commit"], "git_dirty": env["git_dirty"], "python": env["python"],
                     "platform": platform.platform(), "cpu_capability": _cpu_capability()},
        "cases": cases,
    }


def _cpu_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch: informational only
        return "unknown"


def write_baseline(path: Path, baseline: dict) -> None:
    write_atomic_text(Path(path), json.dumps(baseline, indent=1) + "\n")


# -- load and validate (before any rank starts) ---------------------------------------------------

def load_baseline(path: str | Path, plan: RunPlan) -> dict:
    """The baseline at `path`, refused with one clear line when it cannot judge `plan`."""
    path = Path(path)
    try:
        baseline = json.loads(path.read_text())
    except OSError as e:
        raise BaselineRefused(f"--baseline={path}: cannot read it: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise BaselineRefused(f"--baseline={path}: not JSON ({e})") from None
    if not isinstance(baseline, dict) or baseline.get("format") != FORMAT:
        raise BaselineRefused(f"--baseline={path}: format={baseline.get('format') if isinstance(baseline, dict) else None!r} "
                              f"is not {FORMAT!r}")
    here = environment_key(plan.threads)
    recorded = baseline.get("key", {})
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
    return baseline


# -- check ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BaselineViolation:
    case: str
    optimizer: str
    step: int  # 0: initial parameters
    quantity: str  # loss | init | grad | param | names
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

    @property
    def verdict(self) -> str:
        return "error" if self.error else ("fail" if self.violations else "pass")

    @property
    def cell_id(self) -> str:
        return f"baseline.{self.case}"


def _step_tolerances(snap: dict):
    """Per step: (loss tol, {name: grad tol}, {name: param tol}) of the error model, elementwise,
    from the run's shadow: the same tolerances the gate's per-step checks use (harness/diff.py)."""
    case = get_case(snap["cell"]["case"])
    spec = case.optimizer(snap["optimizer"])
    model = ErrorModel(case.global_batch * case.terms_per_sample + case.accumulation_length(), case.tolerance_scale)
    opt_state = OptimizerErrorState(spec, model.u)
    for rec in snap["steps"]:
        shadow = rec["shadow"]
        grad_tols, param_tols = {}, {}
        for name in rec["grads"]:
            gbound = model.grad_bound(shadow["abs_grads"][name], shadow["grads"][name])
            pbound = opt_state.param_bound(name, rec["step"], gbound, shadow["grads"][name], shadow["params"][name],
                                           shadow["state"].get(name, {}))
            grad_tols[name], param_tols[name] = SAFETY_FACTOR * gbound, SAFETY_FACTOR * pbound
        yield SAFETY_FACTOR * model.loss_bound(shadow["loss"].double().item()), grad_tols, param_tols


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
        for stat, a, e, tol in zip(("sum", "norm"), actual, recorded[name], allowed):
            out.num_checked += 1
            if not abs(a - e) <= tol:
                out.violations.append(BaselineViolation(out.case, opt, step, quantity, name, stat, a, e, tol))


def check_baseline(plan: RunPlan, baseline: dict, path: str) -> list[BaselineResult]:
    """One result per case of the plan: its reference run (this gate's own) against the baseline."""
    results = []
    for ref in plan.references:
        out = BaselineResult(path, ref.case)
        results.append(out)
        recorded_case = baseline["cases"][ref.case]
        for spec in get_case(ref.case).optimizers:
            recorded = recorded_case["optimizers"].get(spec.kind)
            snap_path = snapshot_path(plan.snapshot_dir, ref.cell_id, spec.kind)
            if recorded is None:
                out.violations.append(BaselineViolation(ref.case, spec.kind, 0, "names", "<optimizer>", "missing",
                                                        0.0, 0.0, 0.0))
                continue
            if not snap_path.exists():
                out.error = f"no reference snapshot {snap_path}: the reference run crashed, see its row"
                break
            snap = load_snapshot(snap_path)
            _check_digests(out, spec.kind, 0, "init", snap["init"]["params"], recorded["init"], None)
            for rec, rec_base, (loss_tol, grad_tols, param_tols) in zip(snap["steps"], recorded["steps"],
                                                                        _step_tolerances(snap)):
                loss = rec["loss"].double()[0].item()
                out.num_checked += 1
                if not abs(loss - rec_base["loss"]) <= loss_tol:
                    out.violations.append(BaselineViolation(ref.case, spec.kind, rec["step"], "loss", "<loss>", "value",
                                                            loss, rec_base["loss"], loss_tol))
                _check_digests(out, spec.kind, rec["step"], "grad", rec["grads"], rec_base["grads"], grad_tols)
                _check_digests(out, spec.kind, rec["step"], "param", rec["params"], rec_base["params"], param_tols)
        out.violations.sort(key=lambda v: (v.step, ("names", "init", "loss", "grad", "param").index(v.quantity)))
    return results
