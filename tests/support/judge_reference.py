"""The judge as it was before [Note: Batched checks] (harness/judge/segments.py): every check
one tensor at a time. Kept only as the oracle of tests/harness/judge/test_judge_batched.py, which requires the
batched judge to return what this one returns; not used by the harness."""

from __future__ import annotations

import math
from dataclasses import asdict

import torch

from cases.catalog import Case, get_case
from harness.judge.checks.base import CheckStats, coords as _coords
from harness.judge.diff import DiffStats, OptimizerResult, ReferenceDiverged, compare, flat, owner_of, precision_refusal, reduction_model
from harness.judge.checks import CHECK_ORDER
from harness.judge.result import ALL_PARAMETERS, CLIP_NORM, RUN_UPDATE_STATISTICS, UPDATE_STATISTICS, Violation
from harness.reference.tolerance import (CLIP_COEFFICIENT_ULPS, TRAJECTORY_FACTOR, OptimizerErrorState, ReductionModel,
                                     clip_coefficient, clip_coefficient_error, clip_norm_bound, sign_test_threshold,
                                     unit_roundoff)


def _ratios(diff: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """|diff| / tol per element; inf where the element fails with tol == 0 or diff is NaN."""
    tol = tol.double().expand_as(diff)
    ratio = diff / tol.clamp(min=1e-300)
    failed = ~(diff <= tol)
    ratio = torch.where(failed & ((tol == 0) | diff.isnan()), torch.full_like(diff, float("inf")), ratio)
    return torch.where(diff == 0, torch.zeros_like(diff), ratio)


def _tensor_violation(optimizer, step, check, name, actual, expected, tol, layout,
                      worst: dict | None = None) -> tuple[Violation | None, float]:
    """(the worst failing element of `actual` vs `expected` within `tol`, or None; the max ratio).
    `worst`, when given, keeps the |diff| and tol of the element with the largest ratio so far."""
    if actual.shape != expected.shape:
        raise ValueError(f"{check} '{name}' step={step}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.numel() == 0:
        return None, 0.0
    diff = (actual.double() - expected.double()).abs()
    ratio = _ratios(diff, tol)
    tol = tol.double().expand_as(diff)
    bad = ~(diff <= tol)
    at = int(ratio.reshape(-1).argmax().item())
    max_ratio = ratio.reshape(-1)[at].item()
    if worst is not None and not max_ratio <= worst.get("margin", -1.0):
        worst.update(margin=max_ratio, diff=diff.reshape(-1)[at].item(), tol=tol.reshape(-1)[at].item(), name=name)
    if not bool(bad.any()):
        return None, max_ratio
    index = int(torch.where(bad, ratio, torch.full_like(ratio, -1.0)).reshape(-1).argmax().item())
    return Violation(
        optimizer, step, check, name, ratio.reshape(-1)[index].item(), diff.reshape(-1)[index].item(),
        tol.reshape(-1)[index].item(), actual.reshape(-1)[index].item(), expected.reshape(-1)[index].item(),
        index, _coords(actual.shape, index), owner_of(layout, actual.shape, index), False, int(bad.sum().item()),
    ), max_ratio


def _bias(optimizer, step, name, actual, expected) -> Violation | None:
    """The sign test of one gradient against its exact mean: the more tilted of its two counts as
    a Violation (ratio = |count - n/2| / threshold, > 1: failed), or None when no element differs."""
    diff = (actual.double() - expected.double()).reshape(-1)
    expected = expected.double().reshape(-1)
    # Elements with one exact value are, as a rule, one computation repeated (a broadcast, duplicated
    # rows): their errors are one coin, so each value counts once. Non-finite values fail elsewhere.
    keep = (diff != 0) & diff.isfinite()
    values, order = expected[keep].sort(stable=True)
    first = torch.ones_like(values, dtype=torch.bool)
    first[1:] = values[1:] != values[:-1]
    diff, expected = diff[keep][order][first], values[first]
    nonzero = expected != 0
    counts = {"upward": (int((diff > 0).sum()), diff.numel()),
              "along_gradient": (int(((diff > 0) == (expected > 0))[nonzero].sum()), int(nonzero.sum()))}
    return _tilt(optimizer, step, name, counts, tuple(counts))


def _update_counts(diff: torch.Tensor, update: torch.Tensor, before: torch.Tensor) -> dict[str, tuple[int, int]]:
    """The sign counts of one parameter's differences from the replayed step, one element per
    distinct (update, parameter before) pair: the first by update, then parameter, then position."""
    diff, update, before = (t.double().reshape(-1).tolist() for t in (diff, update, before))
    kept, last = [], None
    for j in sorted(range(len(diff)), key=lambda j: (update[j], before[j], j)):
        if diff[j] != 0 and math.isfinite(diff[j]) and (update[j], before[j]) != last:
            kept.append(j)
            last = (update[j], before[j])
    along = [j for j in kept if update[j] != 0]
    return {"upward": (sum(diff[j] > 0 for j in kept), len(kept)),
            "along": (sum((diff[j] > 0) == (update[j] > 0) for j in along), len(along))}


def _tilt(optimizer, step, name, counts: dict[str, tuple[int, int]], statistics: tuple[str, str]) -> Violation | None:
    """The more tilted of two counts, named by `statistics`, as a Violation (None: no element differs)."""
    worst = None
    for statistic, (count, n) in zip(statistics, counts.values()):
        if n:
            threshold = sign_test_threshold(n)
            tilt = abs(count - n / 2)
            if worst is None or tilt / threshold > worst.ratio:
                worst = Violation(optimizer, step, "bias", name, tilt / threshold, tilt, threshold, count / n, 0.5,
                                  num_violating=n, statistic=statistic)
    return worst


def _nonfinite(optimizer, step, name, tensor, layout, rank=None) -> Violation | None:
    bad = ~torch.isfinite(tensor)
    if not bool(bad.any()):
        return None
    index = int(bad.reshape(-1).nonzero()[0].item())
    value = tensor.reshape(-1)[index].item()
    owner = rank if rank is not None else owner_of(layout, tensor.shape, index)
    return Violation(optimizer, step, "nonfinite", name, float("inf"), float("inf"), 0.0, value, float("nan"),
                     index, _coords(tensor.shape, index), owner, False, int(bad.sum().item()))


def _require_finite(what: str, step: int, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise ReferenceDiverged(f"the unsharded reference diverged: {what} '{name}' is not finite at step {step}; "
                                    f"the case cannot be judged (lower the learning rate or fix the model)")


class StepBounds:
    """The elementwise tolerances of one cell's grad and param checks, step after step (the
    optimizer's state error is carried across steps): what check_snapshot and baselines apply."""

    def __init__(self, case: Case, spec, world_size: int) -> None:
        self.case = case
        self.reduction = reduction_model(case, world_size)
        self.u_param = unit_roundoff(torch.float32)  # master parameters and optimizer state
        self.opt_state = OptimizerErrorState(spec, self.u_param)
        self.clip_may_have_acted = False  # from then on no update is sign-tested
        self.reordered_from: dict | None = None  # from then on no sign is tested

    def grad_bounds(self, shadow: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """({name: reduction bound}, {name: reordering allowance} or None)."""
        bounds = {}
        for name in shadow["grads"]:
            # A tied parameter's gradient sums more terms (one per use): its own bound.
            terms = shadow["num_terms"][name]
            reduction = self.reduction if terms == self.reduction.num_terms else \
                ReductionModel(terms, self.reduction.u, self.reduction.casts, self.reduction.eta)
            bounds[name] = reduction.grad_bound(shadow["abs_grads"][name])
        reorder = shadow.get("reorder")
        return bounds, ({n: reorder[n].double() for n in shadow["grads"]} if reorder else None)

    def step(self, step: int, shadow: dict, reordered: bool = False,
             clip_norms: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        features, u = self.case.features, self.u_param
        self.clip_norm = None
        param_tols, stepped, stepped_tols = {}, {}, {}
        grad_tols, allowance = self.grad_bounds(shadow)
        if reordered and allowance is not None:  # the reordered local backward's allowance, one per tensor
            grad_tols = {n: t + allowance[n] for n, t in grad_tols.items()}
        for name, exact in shadow["grads"].items():
            stepped[name] = exact.float().double()  # what the shadow's optimizer stepped with
            stepped_tols[name] = grad_tols[name] + (stepped[name] - exact.double()).abs()
        if features.clip_norm_type is not None:
            self.clip_norm = clip_norm_bound(stepped, stepped_tols, features.clip_norm_type, u)
            if clip_norms is not None and clip_norms.numel() and bool(torch.isfinite(clip_norms).all()):
                coef = float(clip_coefficient(float(clip_norms[0]), features.clip_max_norm))
                dcoef = 0.0 if coef == 1.0 else 2 * u * coef
                self.clip_may_have_acted = self.clip_may_have_acted or coef < 1
            else:
                coef, dcoef = clip_coefficient_error(stepped, stepped_tols, features.clip_max_norm,
                                                     features.clip_norm_type, u)
                self.clip_may_have_acted = self.clip_may_have_acted or coef < 1 or dcoef > 0
            stepped_tols = {n: (coef + dcoef) * t + dcoef * stepped[n].abs() + u * coef * stepped[n].abs()
                            for n, t in stepped_tols.items()}
            stepped = {n: coef * g for n, g in stepped.items()}
        for name, gtol in stepped_tols.items():
            state = shadow["state"].get(name, {})
            own_step = int(state["step"]) if "step" in state else step  # behind the run's after steps without a gradient
            param_tols[name] = self.opt_state.param_bound(name, own_step, gtol, stepped[name], shadow["params"][name],
                                                          state, shadow["hyper"][name])
        return grad_tols, param_tols


def check_snapshot(snap: dict, init_state: dict[str, torch.Tensor], ref: dict | None,
                   case: Case | None = None) -> OptimizerResult:
    """All checks of one (cell, optimizer) snapshot. `init_state` is the reference initial state
    every rank loaded; `ref` the reference run's snapshot (None: no trajectory check, as for the
    fuzzer's drawn models, which have no free-running reference); `case` the cell's case when it is
    not in the catalog. Raises ReferenceDiverged when the reference is not finite, ValueError when
    the evidence is inconsistent (missing steps, shapes)."""
    cell = snap["cell"]
    case = case if case is not None else get_case(cell["case"])
    spec = case.optimizer(snap["optimizer"])
    world_size = int(snap["world_size"])
    step_bounds = StepBounds(case, spec, world_size)
    reduction, u_param = step_bounds.reduction, step_bounds.u_param
    result = OptimizerResult(snap["optimizer"])
    stats = {c: CheckStats() for c in CHECK_ORDER}
    stats["grad"].u = reduction.u
    stats["param"].u = u_param
    stats["trajectory"].u = u_param
    layouts = snap["layouts"]
    viol = result.violations
    kind = spec.kind
    padding = snap["padding"]  # the adapter's declared convention (harness/adapters/base.py, Padding)

    def shard_rows(rec):
        """(key, (W, shard_numel) rows, whether its padding is declared zero) of every raw shard."""
        return ([(k, t, padding["params"] == "zero") for k, t in rec["shards"].items()]
                + [(k + " (grad)", t, padding["grads"] == "zero") for k, t in rec["shard_grads"].items()])

    def intervals_of(rec, key):
        return rec["padding_intervals"][key.removesuffix(" (grad)")]

    step_worst: dict[tuple[int, str], dict] = {}  # (step, check) -> the element nearest its tolerance

    def judge(check, step, name, actual, expected, tol, layout, value=None):
        worst = step_worst.setdefault((step, check), {})
        v, ratio = _tensor_violation(kind, step, check, name, actual, expected, tol, layout, worst)
        stats[check].add(actual.numel(), ratio, tol if value is not None else None, value)
        if v:
            viol.append(v)

    zero = torch.zeros((), dtype=torch.float64)
    for name, p in snap["init"]["params"].items():
        stats["nonfinite"].add(p.numel())
        v = _nonfinite(kind, 0, name, p, layouts.get(name))
        if v:
            viol.append(v)
        judge("init", 0, name, p, init_state[name], zero, layouts.get(name))

    steps = snap["steps"]
    ref_steps = ref["steps"] if ref is not None else None
    if ref_steps is not None and len(ref_steps) != len(steps):
        raise ValueError(f"the reference has {len(ref_steps)} steps, the cell {len(steps)}")
    perturbed = None
    if ref is not None:
        perturbed = ref.get("perturbed")
        if not perturbed or any(len(run) != len(steps) for run in perturbed):
            raise ValueError("the reference snapshot lacks its perturbed runs for every step (trajectory envelope)")

    traj: dict[str, list[DiffStats]] = {"loss": [], "grad": [], "param": []}
    def record_tilt(step, name, tilt):
        """A sign test's outcome: its margin folded in, its violation kept when it failed."""
        stats["bias"].add(1, tilt.ratio if tilt else 0.0)
        worst = step_worst.setdefault((step, "bias"), {})
        if tilt and not tilt.ratio <= worst.get("margin", -1.0):
            worst.update(margin=tilt.ratio, diff=tilt.abs_diff, tol=tilt.tol, name=name)
        if tilt and not tilt.ratio <= 1:
            viol.append(tilt)

    params_before = snap["init"]["params"]
    differed: dict[str, torch.Tensor] = {}
    run_counts = {"upward": (0, 0), "along": (0, 0)}
    for i, rec in enumerate(steps):
        step, shadow = rec["step"], rec["shadow"]
        step_layouts = rec.get("layouts", layouts)  # a resharding case changes them mid-run
        if any(v.check == "nonfinite" for v in viol):
            # The cell went non-finite at an earlier step: the shadow now starts from its non-finite
            # parameters, so later steps say nothing more; the first divergence is already named.
            result.stopped_after = steps[i - 1]["step"] if i else 0
            break
        # The shadow starts from the cell's finite parameters of the previous step: a non-finite
        # value in it is the unsharded model diverging, not the implementation.
        _require_finite("loss", step, {"<loss>": shadow["loss"]})
        _require_finite("gradient", step, shadow["grads"])
        _require_finite("parameter", step, shadow["params"])

        # nonfinite: the cell's own values, first occurrence named
        stats["nonfinite"].add(rec["loss"].numel())
        for r, value in enumerate(rec["loss"].tolist()):
            if not torch.isfinite(torch.tensor(value)):
                viol.append(Violation(kind, step, "nonfinite", "<loss>", float("inf"), float("inf"), 0.0, value,
                                      float("nan"), rank=r))
        for group in (rec["grads"], rec["params"]):
            for name, t in group.items():
                stats["nonfinite"].add(t.numel())
                v = _nonfinite(kind, step, name, t, step_layouts.get(name))
                if v:
                    viol.append(v)
        for key, rows, padding_judged in shard_rows(rec):
            for r in range(rows.shape[0]):
                # Padding of an UNSPECIFIED convention may hold anything (uninitialised memory):
                # zeroed in a copy, so an index found still names the shard's own element.
                judged = rows[r] if padding_judged else _without_padding(rows[r], intervals_of(rec, key)[r])
                stats["nonfinite"].add(judged.numel())
                v = _nonfinite(kind, step, key, judged, None, rank=r)
                if v:
                    viol.append(v)

        # loss: each rank's local loss is the replay's, bitwise
        losses, expected = rec["loss"], shadow["loss"]
        result.losses.append({"optimizer": kind, "step": step, "loss": losses.double().mean().item(),
                              "replay": expected.double().mean().item(),
                              "reference": ref_steps[i]["loss"].double().mean().item() if ref_steps else None})
        if losses.shape != expected.shape:
            raise ValueError(f"step {step}: {losses.numel()} rank losses, the replay has {expected.numel()}")
        for r in range(losses.numel()):
            d = (losses[r].double() - expected[r].double()).abs().item()
            stats["loss"].add(1, 0.0 if d == 0 else float("inf"))
            if not d == 0:
                viol.append(Violation(kind, step, "loss", "<loss>", float("inf"), d, 0.0, losses[r].item(),
                                      expected[r].item(), rank=r))

        # grad: within the reduction bound of the exact mean of the local terms; param: that bound
        # through clipping and the optimizer
        # [Note: Parameters without a gradient] (harness/judge/diff.py): a gradient the replay does
        # not have must be absent or exactly zero; one the replay has must be there.
        for name, g in rec["grads"].items():
            if name not in shadow["grads"] and not bool((g == 0).all()):
                judge("grad", step, name, g, torch.zeros_like(g), zero, step_layouts.get(name))
        for name, expected in shadow["grads"].items():
            if name not in rec["grads"]:
                index = int(expected.abs().reshape(-1).argmax().item()) if expected.numel() else None
                value = expected.reshape(-1)[index].item() if index is not None else 0.0
                stats["grad"].add(expected.numel(), float("inf"))
                viol.append(Violation(kind, step, "grad", name, float("inf"), abs(value), 0.0, float("nan"), value,
                                      index, None if index is None else _coords(expected.shape, index),
                                      None if index is None else owner_of(step_layouts.get(name), expected.shape, index),
                                      num_violating=expected.numel(), lost_gradient=True))
        cell_grads = rec["grads"]
        rec = {**rec, "grads": {n: g for n, g in rec["grads"].items() if n in shadow["grads"]}}
        if step_bounds.reordered_from is None:
            reduction_tols, allowance = step_bounds.grad_bounds(shadow)
            diffs = {n: (g.double() - shadow["grads"][n].double()).abs() for n, g in rec["grads"].items()}
            if allowance is not None and all(bool((d <= reduction_tols[n] + allowance[n]).all())
                                             for n, d in diffs.items()):
                beyond = {}
                for n, d in diffs.items():  # the first tensor wins ties, as the flat argmax does
                    r = d / reduction_tols[n]
                    r = torch.where(torch.isnan(r) | (r <= 1), 0.0, r)
                    if r.numel() and float(r.max()) > 0 and float(r.max()) > max(beyond.values(), default=0.0):
                        beyond[n] = float(r.max())
                if beyond:
                    name = max(beyond, key=beyond.get)
                    step_bounds.reordered_from = {"step": step, "name": name, "ratio": beyond[name]}
        clip_norms = rec.get("clip_norm")
        grad_tols, param_tols = step_bounds.step(step, shadow, step_bounds.reordered_from is not None, clip_norms)
        if clip_norms is not None and step_bounds.clip_norm is not None:
            # the clip check: each rank's norm, then every clipped element (harness/judge/diff.py)
            norm, dnorm = step_bounds.clip_norm
            worst = step_worst.setdefault((step, "clip"), {})
            for r, value in enumerate(clip_norms.double().tolist()):
                if math.isnan(value) and not bool(torch.isfinite(clip_norms).any()):
                    continue
                diff = abs(value - norm)
                ratio = (0.0 if diff == 0 else diff / dnorm if dnorm > 0 else math.inf) if diff == diff else math.inf
                stats["clip"].add(1, ratio)
                if not ratio <= worst.get("margin", -1.0):
                    worst.update(margin=ratio, diff=diff, tol=dnorm, name=CLIP_NORM)
                if not ratio <= 1:
                    viol.append(Violation(kind, step, "clip", CLIP_NORM, ratio, diff, dnorm, value, norm, rank=r))
            clipped = rec.get("clipped_grads")
            if clipped is not None and bool(torch.isfinite(clip_norms).all()):
                coef = clip_coefficient(float(clip_norms[0]), step_bounds.case.features.clip_max_norm)
                for name, g in cell_grads.items():
                    tol = CLIP_COEFFICIENT_ULPS * unit_roundoff(g.dtype) * float(coef) * g.double().abs()
                    judge("clip", step, name, clipped[name], g * coef.to(g.dtype), tol, step_layouts.get(name))
        for name, g in rec["grads"].items():
            judge("grad", step, name, g, shadow["grads"][name], grad_tols[name], step_layouts.get(name),
                  value=shadow["grads"][name])
            if step_bounds.reordered_from is None:
                record_tilt(step, name, _bias(kind, step, name, g, shadow["grads"][name]))
            p_ref = shadow["params"][name]
            judge("param", step, name, rec["params"][name], p_ref, param_tols[name], step_layouts.get(name), value=p_ref)
        for name in rec["params"].keys() - rec["grads"].keys():
            # No gradient (frozen): no arithmetic touches the parameter, so it must match exactly.
            judge("param", step, name, rec["params"][name], shadow["params"][name], zero, step_layouts.get(name))

        # bias of the updates: per parameter, then over the run with each element at its first difference
        if not step_bounds.clip_may_have_acted and step_bounds.reordered_from is None:
            def bias_of(name, counts, statistics):
                record_tilt(step, name, _tilt(kind, step, name, counts, statistics))

            for name in rec["grads"]:
                p, replayed, before = rec["params"][name].double(), shadow["params"][name].double(), params_before[name].double()
                diff = p - replayed
                bias_of(name, _update_counts(diff, replayed - before, before), UPDATE_STATISTICS)
                seen = differed.get(name, torch.zeros(p.shape, dtype=torch.bool))
                for key, (count, n) in _update_counts(torch.where(seen, 0.0, diff), replayed - before, before).items():
                    run_counts[key] = (run_counts[key][0] + count, run_counts[key][1] + n)
                differed[name] = seen | (diff != 0)
            bias_of(ALL_PARAMETERS, run_counts, RUN_UPDATE_STATISTICS)
        params_before = rec["params"]

        # replicas: every rank's full tensors bitwise equal
        replicas = rec.get("replicas")
        if replicas is not None:
            digests = replicas["digests"]
            for j, name in enumerate(replicas["names"]):
                column = digests[:, j].tolist()
                stats["replicas"].add(len(column))
                if len(set(column)) > 1:
                    agreed = max(set(column), key=lambda d: (column.count(d), -column.index(d)))
                    for r, d in enumerate(column):
                        if d != agreed:
                            viol.append(Violation(kind, step, "replicas", name, float("inf"), float("nan"), 0.0,
                                                  float("nan"), float("nan"), rank=r))

        # padding: exactly zero where the adapter declares Padding.ZERO
        for key, rows, padding_judged in shard_rows(rec):
            if not padding_judged:
                continue
            for r, intervals in enumerate(intervals_of(rec, key)):
                at = torch.cat([torch.arange(start, end) for start, end in intervals] + [torch.arange(0)])
                pad = rows[r, at]
                stats["padding"].add(pad.numel())
                if pad.numel() and (pad != 0).any():
                    first = int((pad != 0).nonzero()[0].item())
                    viol.append(Violation(kind, step, "padding", key, float("inf"), abs(pad[first].item()), 0.0,
                                          pad[first].item(), 0.0, index=int(at[first]), rank=r, in_padding=True,
                                          num_violating=int((pad != 0).sum().item())))

        # trajectory: the free-running cell vs the free-running reference, within the envelope
        if ref_steps is not None:
            ref_rec = ref_steps[i]
            if ref_rec["step"] != step:
                raise ValueError(f"reference step {ref_rec['step']} where the cell has step {step}")
            _require_finite("reference parameter", step, ref_rec["params"])
            for name, p in rec["params"].items():
                p_ref = ref_rec["params"][name].double()
                envelope = torch.stack([(run[i][name].double() - p_ref).abs().max() for run in perturbed]).max()
                deviation = (p.double() - p_ref).abs()
                # A one-ulp flip of the last rounding needs no gradient difference to happen (AdamW's
                # first update is lr * sign(g)), so the envelope starts at the largest element's ulp.
                floor = 2 * u_param * p_ref.abs().max() if p_ref.numel() else zero
                tol = TRAJECTORY_FACTOR * (envelope + floor)
                worst = int(deviation.reshape(-1).argmax().item()) if deviation.numel() else 0
                d = deviation.max() if deviation.numel() else zero
                v, ratio = _tensor_violation(kind, step, "trajectory", name, d.reshape(1), zero.reshape(1),
                                             tol.reshape(1), None, step_worst.setdefault((step, "trajectory"), {}))
                stats["trajectory"].add(p.numel(), ratio)
                if v:
                    viol.append(Violation(kind, step, "trajectory", name, v.ratio, v.abs_diff, v.tol,
                                          p.reshape(-1)[worst].item(), ref_rec["params"][name].reshape(-1)[worst].item(),
                                          worst, _coords(p.shape, worst), owner_of(step_layouts.get(name), p.shape, worst)))

            split = cell["data_mode"] == "split"
            actual_losses = rec["loss"].double().mean().reshape(1) if split else rec["loss"].double()
            ref_loss = ref_rec["loss"].double().mean()
            step_stats = {
                "loss": compare(actual_losses.float(), ref_loss.float().expand_as(actual_losses)),
                "grad": compare(flat(both := {n: g for n, g in cell_grads.items() if n in ref_rec["grads"]}),
                                flat(ref_rec["grads"], both)),
                "param": compare(flat(rec["params"]), flat(ref_rec["params"], rec["params"])),
            }
            for q, merged in step_stats.items():
                traj[q].append(merged)
                result.per_step.append({"optimizer": kind, "step": step, "quantity": q, **asdict(merged),
                                        "bitwise_equal": merged.bitwise_equal})
    result.trajectory = {q: DiffStats.merge(s) for q, s in traj.items()}
    result.step_checks = [{"optimizer": kind, "step": step, "check": check, **worst}
                          for (step, check), worst in sorted(step_worst.items(), key=lambda kv: kv[0]) if worst]
    result.checks = {c: s.summary() for c, s in stats.items()}
    result.margins = {c: s.max_ratio for c, s in stats.items()}
    if step_bounds.reordered_from is not None:
        result.checks["bias"]["not_applied_from"] = step_bounds.reordered_from
    result.error = precision_refusal(result.checks["grad"], reduction)
    return result


def _without_padding(shard: torch.Tensor, intervals) -> torch.Tensor:
    """A copy of a shard with its padding intervals set to zero."""
    out = shard.clone()
    for start, end in intervals:
        out[start:end] = 0
    return out
