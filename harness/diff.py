"""Diffs: abs / rel / ULP statistics, the per-step checks against the error model, and the
first divergence of a failing cell (step, parameter, element, coordinates, owning rank, padding).

Two comparisons per cell and optimizer:
- trajectory: the cell's losses, gradients and parameters vs the reference run (impl=single,
  W = 1) at every step; reported (max_abs_diff, W x W matrices), not judged;
- checks: every step vs the shadow (same starting parameters) within the error model's
  tolerance, the initial parameters vs the reference state exactly, and padding exactly zero.
  These decide the verdict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from cases.catalog import Case, get_case
from harness.tolerance import SAFETY_FACTOR, ErrorModel, OptimizerErrorState

CHECK_ORDER = ("init", "ranks", "loss", "grad", "param", "padding")


@dataclass(frozen=True)
class DiffStats:
    max_abs: float
    max_rel: float
    max_ulp: int
    num_diff: int
    numel: int

    @property
    def bitwise_equal(self) -> bool:
        return self.num_diff == 0

    @staticmethod
    def merge(stats: list[DiffStats]) -> DiffStats:
        if not stats:
            return DiffStats(0.0, 0.0, 0, 0, 0)
        return DiffStats(max(s.max_abs for s in stats), max(s.max_rel for s in stats),
                         max(s.max_ulp for s in stats), sum(s.num_diff for s in stats),
                         sum(s.numel for s in stats))


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of representable values between a and b (same float dtype), as int64."""
    if a.dtype != b.dtype or not a.dtype.is_floating_point:
        raise ValueError(f"ulp_distance needs two tensors of one float dtype, got {a.dtype} and {b.dtype}")
    int_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    low = torch.iinfo(int_dtype).min

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(int_dtype).to(torch.int64)
        return torch.where(bits < 0, low - bits, bits)  # -0.0 and +0.0 both map to 0

    return (ordered(a) - ordered(b)).abs()


def compare(actual: torch.Tensor, expected: torch.Tensor) -> DiffStats:
    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.numel() == 0:
        return DiffStats(0.0, 0.0, 0, 0, 0)
    diff = (actual.double() - expected.double()).abs()
    differs = actual != expected
    rel = diff / expected.double().abs().clamp(min=torch.finfo(expected.dtype).tiny)
    return DiffStats(
        max_abs=diff.max().item(),
        max_rel=rel.max().item() if differs.any() else 0.0,
        max_ulp=int(ulp_distance(actual, expected).max().item()),
        num_diff=int(differs.sum().item()),
        numel=actual.numel(),
    )


@dataclass(frozen=True)
class Violation:
    """One element beyond its tolerance: the evidence for a failing check."""

    optimizer: str
    step: int  # 0: initial parameters
    check: str  # one of CHECK_ORDER
    name: str  # original parameter name, '<loss>', or '<unit>/<flat param>' for padding
    ratio: float  # |diff| / tol (inf when tol is 0)
    abs_diff: float
    tol: float
    actual: float
    expected: float
    index: int | None = None  # flat index into the parameter (or into the rank's shard)
    coords: tuple[int, ...] | None = None
    rank: int | None = None  # the rank whose shard holds the element (None: replicated)
    in_padding: bool = False
    num_violating: int = 1  # elements of this tensor beyond tolerance

    def sort_key(self) -> tuple:
        return (self.step, CHECK_ORDER.index(self.check), -self.ratio)

    def describe(self, cell_id: str) -> str:
        where = f"'{self.name}'"
        if self.index is not None:
            where += f"[{self.index}]"
            if self.coords is not None:
                where += f" at {self.coords}"
        if self.check == "ranks":
            owner = f"rank {self.rank} disagrees with the other ranks"
        elif self.check == "loss":
            owner = "mean over ranks" if self.rank is None else f"on rank {self.rank}"
        else:
            owner = "replicated on every rank" if self.rank is None else f"in rank {self.rank}'s shard"
        pad = " (padding)" if self.in_padding else ""
        return (f"{cell_id} optimizer={self.optimizer} step={self.step} {self.check}: {where} {owner}{pad}: "
                f"actual={self.actual:.9g} expected={self.expected:.9g} |diff|={self.abs_diff:.3g} "
                f"> tol={self.tol:.3g} (ratio {self.ratio:.3g}, {self.num_violating} element(s))")

    def to_json(self) -> dict:
        d = asdict(self)
        d["coords"] = list(self.coords) if self.coords is not None else None
        d["ratio"] = self.ratio if self.ratio != float("inf") else "inf"
        return d


def owner_of(layout: dict | None, size: torch.Size, index: int) -> int | None:
    if not layout or layout["kind"] == "replicated":
        return None
    if layout["kind"] == "flat":
        return (layout["offset"] + index) // max(layout["shard_numel"], 1)
    if layout["kind"] == "dim0":
        row = index // max(1, (size.numel() // max(layout["rows"], 1))) if len(size) else 0
        return row // max(layout["chunk_rows"], 1)
    return None


def _coords(size: torch.Size, index: int) -> tuple[int, ...]:
    coords = []
    for dim in reversed(size):
        coords.append(index % dim)
        index //= dim
    return tuple(reversed(coords))


def _tensor_violation(optimizer, step, check, name, actual, expected, tol, layout) -> Violation | None:
    diff = (actual.double() - expected.double()).abs()
    bad = diff > tol
    if not bad.any():
        return None
    ratio = torch.where(bad, diff / tol.clamp(min=1e-300), torch.zeros_like(diff))
    ratio = torch.where(bad & (tol == 0), torch.full_like(diff, float("inf")), ratio)
    index = int(ratio.reshape(-1).argmax().item())
    return Violation(
        optimizer, step, check, name, ratio.reshape(-1)[index].item(), diff.reshape(-1)[index].item(),
        tol.reshape(-1)[index].item() if tol.dim() else tol.item(), actual.reshape(-1)[index].item(),
        expected.reshape(-1)[index].item(), index, _coords(actual.shape, index),
        owner_of(layout, actual.shape, index), False, int(bad.sum().item()),
    )


def _max_ratio(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> float:
    diff = (actual.double() - expected.double()).abs()
    if not (diff > 0).any():
        return 0.0
    return (diff / tol.clamp(min=1e-300)).max().item()


@dataclass
class OptimizerResult:
    optimizer: str
    violations: list[Violation] = field(default_factory=list)
    margins: dict[str, float] = field(default_factory=dict)  # check -> max |diff| / tol
    trajectory: dict[str, DiffStats] = field(default_factory=dict)  # quantity -> vs reference
    per_step: list[dict] = field(default_factory=list)


def flat(tensors: dict[str, torch.Tensor], order: dict | None = None) -> torch.Tensor:
    """One 1-D tensor of `tensors` in the key order of `order` (default: their own)."""
    keys = list(order if order is not None else tensors)
    return torch.cat([tensors[k].reshape(-1) for k in keys]) if keys else torch.zeros(0)


def _rank_disagreement(optimizer: str, step: int, losses: torch.Tensor, expected: float) -> list[Violation]:
    """With identical data every rank runs the same forward on the same gathered parameters with
    the same kernels, so their losses are bitwise equal; a rank that disagrees computed with
    something else. The agreed value is the most common one (ties: the one nearest the shadow)."""
    values = losses.tolist()
    if len(set(values)) == 1:
        return []
    agreed = max(set(values), key=lambda v: (values.count(v), -abs(v - expected)))
    return [Violation(optimizer, step, "ranks", "<loss>", float("inf"), abs(v - agreed), 0.0, v, agreed, rank=r)
            for r, v in enumerate(values) if v != agreed]


def check_snapshot(snap: dict, init_state: dict[str, torch.Tensor], ref: dict | None,
                   case: Case | None = None) -> OptimizerResult:
    """All checks of one (cell, optimizer) snapshot. `init_state` is the reference initial state
    every rank loaded; `ref` the reference run's snapshot (None: no trajectory comparison);
    `case` the cell's case when it is not in the catalog (the fuzzer's drawn models)."""
    cell = snap["cell"]
    case = case if case is not None else get_case(cell["case"])
    spec = case.optimizer(snap["optimizer"])
    model = ErrorModel(case.global_batch * case.terms_per_sample + case.accumulation_length(), case.tolerance_scale,
                       dtype=case.features.compute_dtype)
    opt_state = OptimizerErrorState(spec, model.u)
    result = OptimizerResult(snap["optimizer"])
    margins = {c: 0.0 for c in CHECK_ORDER}
    layouts = snap["layouts"]
    viol = result.violations

    for name, p in snap["init"]["params"].items():
        v = _tensor_violation(spec.kind, 0, "init", name, p, init_state[name],
                              torch.zeros((), dtype=torch.float64), layouts.get(name))
        if v:
            viol.append(v)
    split = cell["data_mode"] == "split"
    traj: dict[str, list[DiffStats]] = {"loss": [], "grad": [], "param": []}
    for rec, ref_rec in zip(snap["steps"], (ref["steps"] if ref else [None] * len(snap["steps"]))):
        step, shadow = rec["step"], rec["shadow"]
        # loss: each rank's own loss (identical data) or the mean of the local means (split)
        losses = rec["loss"].double()
        actual_losses = losses.mean().reshape(1) if split else losses
        expected = shadow["loss"].double().item()
        if not split and len(losses) > 1:
            viol.extend(_rank_disagreement(spec.kind, step, rec["loss"], expected))
        tol = SAFETY_FACTOR * model.loss_bound(expected)
        for r, value in enumerate(actual_losses.tolist()):
            d = abs(value - expected)
            margins["loss"] = max(margins["loss"], d / tol if tol else (0.0 if d == 0 else float("inf")))
            if d > tol:
                viol.append(Violation(spec.kind, step, "loss", "<loss>", d / tol if tol else float("inf"), d, tol,
                                      value, expected, rank=None if split else r))
        step_stats = {"loss": [], "grad": [], "param": []}
        for name, g in rec["grads"].items():
            g_ref = shadow["grads"][name]
            gbound = model.grad_bound(shadow["abs_grads"][name], g_ref)
            gtol = SAFETY_FACTOR * gbound
            margins["grad"] = max(margins["grad"], _max_ratio(g, g_ref, gtol))
            v = _tensor_violation(spec.kind, step, "grad", name, g, g_ref, gtol, layouts.get(name))
            if v:
                viol.append(v)
            pbound = opt_state.param_bound(name, step, gbound, g_ref, shadow["params"][name],
                                           shadow["state"].get(name, {}))
            ptol = SAFETY_FACTOR * pbound
            p, p_ref = rec["params"][name], shadow["params"][name]
            margins["param"] = max(margins["param"], _max_ratio(p, p_ref, ptol))
            v = _tensor_violation(spec.kind, step, "param", name, p, p_ref, ptol, layouts.get(name))
            if v:
                viol.append(v)
        for name in rec["params"].keys() - rec["grads"].keys():
            # No gradient (frozen): no arithmetic touches the parameter, so it must match exactly.
            v = _tensor_violation(spec.kind, step, "param", name, rec["params"][name], shadow["params"][name],
                                  torch.zeros((), dtype=torch.float64), layouts.get(name))
            if v:
                viol.append(v)
        for key, rows in list(rec["shards"].items()) + [(k + " (grad)", t) for k, t in rec["shard_grads"].items()]:
            for r, intervals in enumerate(rec["padding_intervals"][key.removesuffix(" (grad)")]):
                at = torch.cat([torch.arange(start, end) for start, end in intervals] + [torch.arange(0)])
                pad = rows[r, at]
                if pad.numel() and (pad != 0).any():
                    i = int((pad != 0).nonzero()[0].item())
                    viol.append(Violation(spec.kind, step, "padding", key, float("inf"), abs(pad[i].item()), 0.0,
                                          pad[i].item(), 0.0, index=int(at[i]), rank=r, in_padding=True,
                                          num_violating=int((pad != 0).sum().item())))
        if ref_rec is not None:
            ref_loss = ref_rec["loss"].double().mean()
            step_stats["loss"].append(compare(actual_losses.float(), ref_loss.float().expand_as(actual_losses)))
            step_stats["grad"].append(compare(flat(rec["grads"]), flat(ref_rec["grads"], rec["grads"])))
            step_stats["param"].append(compare(flat(rec["params"]), flat(ref_rec["params"], rec["params"])))
            for q in traj:
                merged = DiffStats.merge(step_stats[q])
                traj[q].append(merged)
                result.per_step.append({"optimizer": spec.kind, "step": step, "quantity": q, **asdict(merged),
                                        "bitwise_equal": merged.bitwise_equal})
    result.trajectory = {q: DiffStats.merge(s) for q, s in traj.items()}
    result.margins = margins
    return result
