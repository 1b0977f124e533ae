"""The error model: how far an honest sharded run may differ from the unsharded one, per element.

The full derivation is docs/error_model.md; in short:

1. Local computation is replayed, not bounded. Every rank runs the plain model's forward and
   backward on its local batch with the unsharded parameters (an all-gather is a copy), so its
   local loss and each micro-batch gradient are the same kernels on the same shapes as the plain
   model on that local batch. The shadow (harness/reference/shadow.py) replays exactly those W x M local
   computations from the cell's own parameters, so per rank the loss must be bitwise equal.
2. The only arithmetic an honest sharded run adds is the combination of those K = W x M local
   gradient terms into one average (reduce-scatter or all-reduce, local accumulation, a division
   by W before and/or after, a cast into the reduce dtype). Any such evaluation of the sum has
   |computed - exact| <= gamma_n * sum_k |term_k| / W (Higham, Thm 4.4; any order, any tree),
   with n = K + 2 + [cast] roundings on the longest path and gamma_n = n u / (1 - n u). The
   reference is the exact mean (float64 of the float32 terms), so the bound is rigorous: no
   safety factor, no constant counted by hand. Identical data is the special case of K equal
   terms: the bound is gamma_n |g|, a few ulps, at every W.
3. Parameters: the gradient error (plus the rounding of the exact mean to the parameter dtype)
   pushed through the optimizer's update, per element, with the shadow's optimizer state; plus
   one rounding of each elementwise operation of the update. Clipping adds the error of the clip
   coefficient (the norm of the gradient error, plus a rigorous bound on the rounding of the norm).
4. Initial parameters, padding, replicas: exact. A loss, gradient or parameter that is not finite
   fails on its own check; a reference that is not finite is an error (the case diverged).
5. The trajectory (free-running cell vs free-running reference) is judged against the envelope of
   honest noise measured on the reference itself (see `TRAJECTORY_FACTOR`).
6. Bias: an honest reduction's rounding errors carry no sign. Per gradient tensor, among the
   elements that differ from the exact mean, the count that differ upward and the count that
   differ in the direction of the gradient are each Binomial(n, 1/2); a shift or a scale error far
   below the per-element bound moves them, and a count beyond Hoeffding's threshold at
   `BIAS_FALSE_ALARM` fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cases.catalog import OptimizerSpec

# A cell's free-running trajectory may deviate from the reference by at most this many times the
# largest deviation of the perturbed reference runs (docs/error_model.md, "Trajectories").
TRAJECTORY_FACTOR = 4.0
# A gradient tensor may differ from the replay's by at most this many times the largest deviation
# of the reordered replays of its local backward ([Note: Reordered accumulation] in
# harness/reference/shadow.py; docs/error_model.md, "Reordered accumulation").
REORDER_FACTOR = 4.0
# Ulps of the final rounding of an updated parameter an honest run may differ by. The rigorous
# bound of two roundings, 2 u |p|, is one ulp, and an honest run reaches it exactly (the last
# rounding of p - lr * update flips for a gradient difference far below an ulp); allowing two
# keeps honest parameter margins at or below 0.5.
ROUNDING_ALLOWANCE = 2
# Perturbed reference runs whose envelope the trajectory check uses (antithetic pairs: one noise draw
# per pair and step, harness/run/worker.py PerturbedRuns): at least this many, and at least as many
# as give every trainable tensor MIN_PERTURBED_DRAWS draws (`perturbed_run_count`).
NUM_PERTURBED_RUNS = 2
# Deviations per tensor and step the envelope is the largest of, at the least: with fewer, a tensor of
# one or two elements false-alarms at a rate that is not small over a long run (docs/error_model.md,
# "Trajectories": 3.7% per step for one element judged by two runs, under 1e-5 with sixteen).
MIN_PERTURBED_DRAWS = 16
# Above this median tolerance / |g| over a gradient's elements a check could not tell an honest run
# from one whose gradients are off by that fraction: the cell is refused ("cannot verify").
MAX_MEDIAN_RELATIVE_TOLERANCE = 0.125
# The bias check's false-alarm probability per (tensor, step, statistic), under its hypothesis
# (docs/error_model.md, "Bias"): a run of N such tests false-alarms with probability <= N times this.
BIAS_FALSE_ALARM = 1e-12


def perturbed_run_count(sizes) -> int:
    """The perturbed runs (an even number: antithetic pairs) for a model whose trainable tensors have
    `sizes` elements: NUM_PERTURBED_RUNS, or as many as give the smallest MIN_PERTURBED_DRAWS
    deviations per step (n elements per run): 16 runs for a one-element tensor, 8 for two, 2 from
    eight elements up."""
    smallest = min((int(n) for n in sizes if n > 0), default=MIN_PERTURBED_DRAWS)
    pairs = max(NUM_PERTURBED_RUNS // 2, math.ceil(MIN_PERTURBED_DRAWS / (2 * smallest)))
    return 2 * pairs


def sign_test_threshold(n: int, false_alarm: float = BIAS_FALSE_ALARM) -> float:
    """t such that a count S ~ Binomial(n, 1/2) has P(|S - n/2| >= t) <= false_alarm (Hoeffding:
    P <= 2 exp(-2 t^2 / n)). Infinite for n = 0: no evidence, no verdict."""
    if n <= 0:
        return math.inf
    return math.sqrt(n * math.log(2.0 / false_alarm) / 2.0)


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for a p-bit significand: the largest relative error of one rounding."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating dtype")
    return torch.finfo(dtype).eps / 2


def underflow_error(dtype: torch.dtype) -> float:
    """Half the smallest subnormal of `dtype`: the largest absolute error of one rounding below its
    normal range."""
    return torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n successive roundings."""
    if n < 0 or n * u >= 1:
        raise ValueError(f"gamma(n={n}, u={u:.3g}) is undefined: n u must be < 1")
    return n * u / (1 - n * u)


@dataclass(frozen=True)
class ReductionModel:
    """How K local gradient terms become one averaged gradient in an honest sharded run."""

    num_terms: int  # K = (ranks contributing) x (micro-batches per step)
    u: float  # unit roundoff of the lowest precision the sum is carried out in
    casts: int = 0  # 1 when the terms are rounded into a lower-precision reduce dtype first
    # The absolute error one rounding may make below the normal range (half the smallest subnormal:
    # 2^-25 in float16, 2^-150 in float32): a division or a cast that underflows loses absolute,
    # not relative, precision (Higham, eq. 2.8), which float16 gradients reach.
    eta: float = 0.0

    def __post_init__(self) -> None:
        if self.num_terms < 1:
            raise ValueError(f"ReductionModel num_terms={self.num_terms} must be >= 1")

    @property
    def roundings(self) -> int:
        # K - 1 additions, a division before and one after the sum (either or both may happen),
        # and the cast into the reduce dtype.
        return self.num_terms - 1 + 2 + self.casts

    @property
    def relative(self) -> float:
        return gamma(self.roundings, self.u)

    def grad_bound(self, abs_mean: torch.Tensor) -> torch.Tensor:
        """abs_mean = sum_k |term_k| / W per element (float64)."""
        bound = self.relative * abs_mean.double()
        return bound + self.roundings * self.eta if self.eta else bound

    @classmethod
    def for_cell(cls, world_size: int, num_micro: int, compute_dtype: torch.dtype,
                 reduce_dtype: torch.dtype | None, grad_dtype: torch.dtype = torch.float32) -> ReductionModel:
        """The sum runs in the reduce dtype; with several micro-batches, terms are also accumulated
        locally in the dtype the unsharded gradient is computed in."""
        reduce_dtype = reduce_dtype or compute_dtype
        u = unit_roundoff(reduce_dtype)
        if num_micro > 1:
            u = max(u, unit_roundoff(compute_dtype))
        casts = int(unit_roundoff(reduce_dtype) > unit_roundoff(compute_dtype))
        eta = underflow_error(reduce_dtype)
        if num_micro > 1:
            eta = max(eta, underflow_error(compute_dtype))
        return cls(world_size * num_micro, u, casts, eta)


def relative_tolerance_stats(tol: torch.Tensor, value: torch.Tensor) -> tuple[float, float]:
    """(median, max) of tol / |value| over the elements where value != 0 (nan when none)."""
    mask = value != 0
    if not bool(mask.any()):
        return float("nan"), float("nan")
    ratio = (tol.double()[mask] / value.double().abs()[mask])
    return ratio.median().item(), ratio.max().item()


def clip_norm_bound(grads: dict[str, torch.Tensor], grad_tols: dict[str, torch.Tensor], norm_type: float,
                    u: float) -> tuple[float, float]:
    """(the norm of `grads`, a bound on |norm_cell - norm|) when the cell's gradients differ by at
    most `grad_tols` and it evaluates the norm in any order: ||grad_tol||_p + (rounding of the norm
    itself, the cell's and this one's)."""
    flat = torch.cat([g.double().reshape(-1) for g in grads.values()]) if grads else torch.zeros(0, dtype=torch.float64)
    flat_tol = torch.cat([t.double().reshape(-1) for t in grad_tols.values()]) if grads else torch.zeros(0, dtype=torch.float64)
    if math.isinf(norm_type):
        norm = flat.abs().max().item() if flat.numel() else 0.0
        dnorm = flat_tol.max().item() if flat.numel() else 0.0  # max is exact: only the inputs differ
    else:
        norm = flat.abs().pow(norm_type).sum().pow(1 / norm_type).item()
        # A sum of n non-negative terms (each a rounded power) in any order: relative gamma_{n+1};
        # the root adds one rounding.
        rounding = 2 * (gamma(flat.numel() + 1, u) / norm_type + 2 * u)  # the cell's and the shadow's
        dnorm = flat_tol.pow(norm_type).sum().pow(1 / norm_type).item() + rounding * (norm + flat_tol.abs().sum().item())
    return norm, dnorm


# [Note: Clipping judged with the cell's norm] (harness/judge/diff.py): a clipped gradient element
# is the gradient times the coefficient its norm gives, within this many units of roundoff of that
# product: one for the product's own rounding, two for a coefficient computed in another order
# than torch's max_norm / (norm + 1e-6) (every implementation of the field computes torch's).
CLIP_COEFFICIENT_ULPS = 3


def clip_coefficient(norm: float, max_norm: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The coefficient torch.nn.utils.clip_grad_norm_ multiplies the gradients by when its norm
    (in the gradients' dtype) is `norm`: min(1, max_norm / (norm + 1e-6)), rounded as it rounds."""
    return torch.clamp(max_norm / (torch.tensor(norm, dtype=dtype) + 1e-6), max=1.0)


def clip_coefficient_error(grads: dict[str, torch.Tensor], grad_tols: dict[str, torch.Tensor],
                           max_norm: float, norm_type: float, u: float) -> tuple[float, float]:
    """(c, bound on |c_cell - c|) for c = min(1, max_norm / (norm + 1e-6)) as clip_grad_norm_
    computes it, when the cell's gradients differ by at most `grad_tols` and it evaluates the norm
    in any order: |norm_cell - norm| <= ||grad_tol||_p + (rounding of the norm itself)."""
    norm, dnorm = clip_norm_bound(grads, grad_tols, norm_type, u)
    denom = norm + 1e-6
    coef = max_norm / denom
    if coef >= 1 and max_norm / max(denom - dnorm, 1e-300) >= 1:
        return 1.0, 0.0  # clamped to 1 either way: no clipping, no error
    coef = min(coef, 1.0)
    lo = max(denom - dnorm, 1e-300)
    dcoef = min(max_norm / lo, 1.0) - min(max_norm / (denom + dnorm), 1.0)
    return coef, dcoef + 2 * u * coef


# [Note: Bounds kept in float32, rounded up]
# A bound that outlives the step it was computed in (the optimizer state's error carried to the next
# step, sum |term| / W held from the replay until the judge reads it) is kept as the least float32
# not below its float64 value: half the memory of a model-sized float64 tensor, and still an upper
# bound, so every tolerance built on it stays rigorous. It is at most one float32 ulp (2^-23
# relative) above the float64 value, so a margin moves in its seventh digit at most; NaN stays NaN,
# a value beyond float32's range becomes +inf, one below its least subnormal that subnormal.
def round_up_to_float32(x: torch.Tensor) -> torch.Tensor:
    """The least float32 >= each element of `x` (float64; NaN kept)."""
    f = x.float()
    return torch.where(f.double() < x, torch.nextafter(f, torch.tensor(math.inf, device=f.device)), f)


# Elementwise float64 arithmetic over a whole model allocates a fresh tensor of the model's size per
# operation, and the allocator maps each from the kernel, zero-filled: at 16.8M parameters the
# page faults were most of the judge's time. In chunks of this many elements the temporaries are
# small and reused; every element is computed by the same operations, so the bits are the same.
# 2^16 (512 KiB of float64) keeps a chain's temporaries in the cache: AdamW's parameter bound over
# 20M elements on one thread of this VM took 1.12 s per call in chunks of 2^18, 0.79 s in 2^16
# (2^15, 2^14: 1.05, 1.01 s; `OptimizerErrorState._adamw` alone, timed in one process).
CHUNK_ELEMENTS = 1 << 16


def elementwise_in_chunks(fn, *tensors):
    """fn(*chunks) -> a tuple of tensors, applied to consecutive chunks of `tensors` (each of the
    same numel, or a 0-d tensor, or None, passed as it is) and laid end to end in the shape of the
    first tensor; the results are fn(*tensors)'s, element by element."""
    shape = tensors[0].shape
    numel = tensors[0].numel()
    flat = [t if t is None or t.dim() == 0 else t.reshape(-1) for t in tensors]
    if numel <= CHUNK_ELEMENTS:
        return tuple(r.reshape(shape) for r in fn(*tensors))
    outs = None
    for start in range(0, numel, CHUNK_ELEMENTS):
        end = min(numel, start + CHUNK_ELEMENTS)
        parts = fn(*(t if t is None or t.dim() == 0 else t[start:end] for t in flat))
        if outs is None:
            outs = [torch.empty(numel, dtype=r.dtype, device=r.device) for r in parts]
        for o, r in zip(outs, parts):
            o[start:end] = r
    return tuple(o.view(shape) for o in outs)


def accumulate_in_chunks(total: torch.Tensor, term: torch.Tensor, absolute: bool = False) -> torch.Tensor:
    """`total` += `term` (its absolute value with `absolute`) in place, `total` contiguous and of a
    wider or the same dtype: each chunk of `term` converted to `total`'s dtype (exact: a widening
    conversion), then added, which is what `total.add_(term)` computes element by element, so the
    same bits. Torch's loop over mixed dtypes converts element by element and measured 6x slower on
    this VM (a float32 term into a float64 sum of 124M elements: 0.56 s against 0.09 s), and
    `term.abs()` would allocate a term-sized tensor first."""
    return _accumulated(total, total, term, absolute)


def promoted_sum_in_chunks(total: torch.Tensor, term: torch.Tensor, absolute: bool = False) -> torch.Tensor:
    """A new float64 tensor: `total` promoted (exact) + `term` (its absolute value with `absolute`),
    a chunk at a time: the bits of `accumulate_in_chunks(total.double(), term, absolute)` in one
    pass over the result instead of two (the promotion's chunk is added to while in cache)."""
    out = torch.empty(total.shape, dtype=torch.float64, device=total.device)
    return _accumulated(out, total, term, absolute)


def _accumulated(out: torch.Tensor, total: torch.Tensor, term: torch.Tensor, absolute: bool) -> torch.Tensor:
    """out = total + term (|term| with `absolute`) in out's dtype, chunk by chunk; `out` contiguous,
    and `total` itself or a tensor of its elements to promote into it."""
    flat_out, flat_total, flat_term = out.view(-1), total.reshape(-1), term.reshape(-1)
    if flat_total.numel() != flat_term.numel():
        raise ValueError(f"accumulate_in_chunks: {flat_term.numel()} elements into {flat_total.numel()}")
    for start in range(0, flat_out.numel(), CHUNK_ELEMENTS):
        end = min(flat_out.numel(), start + CHUNK_ELEMENTS)
        chunk = flat_out[start:end]
        if out is not total:
            chunk.copy_(flat_total[start:end])  # a widening conversion: exact
        part = flat_term[start:end].to(out.dtype, copy=absolute)  # a copy to take |.| of: the term stays
        chunk.add_(part.abs_() if absolute else part)
    return out


@dataclass
class OptimizerErrorState:
    """Per-parameter bounds on |candidate state - shadow state|, carried across steps. The
    hyperparameters of each step are the ones the shadow's optimizer stepped that parameter with
    (its parameter group's, the learning rate the scheduler set for that step)."""

    spec: OptimizerSpec
    u: float  # unit roundoff of the parameters and optimizer state (the master dtype)
    bounds: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def param_bound(self, name: str, step: int, grad_tol: torch.Tensor, grad: torch.Tensor,
                    param: torch.Tensor, state: dict[str, torch.Tensor], hyper: dict) -> torch.Tensor:
        """Bound on |candidate param - shadow param| after `step` (1-based), from the same start.
        `grad` is the gradient the shadow stepped with, `grad_tol` the bound on the candidate's
        difference from it, `hyper` the parameter's lr, momentum, betas, eps at this step."""
        if self.spec.kind == "sgd":
            return self._sgd(name, grad_tol, param, state, hyper)
        return self._adamw(name, step, grad_tol, grad, param, state, hyper)

    def _sgd(self, name, grad_tol, param, state, hyper):
        u, lr, momentum = self.u, hyper["lr"], hyper["momentum"]
        p = param.double().abs()
        if momentum == 0 or "momentum_buffer" not in state:
            update_err = grad_tol
            update = p.new_zeros(()) if "momentum_buffer" not in state else state["momentum_buffer"].double().abs()
        else:
            buf = state["momentum_buffer"].double().abs()
            prev = self.bounds.get(name, {}).get("buf", torch.zeros_like(buf))
            # buf = momentum * buf + g (+ weight_decay * p): the same ops on inputs that differ.
            dbuf = momentum * prev.double() + grad_tol + 2 * u * buf
            self.bounds[name] = {"buf": round_up_to_float32(dbuf)}  # [Note: Bounds kept in float32, rounded up]
            update_err, update = dbuf, buf
        return lr * update_err + ROUNDING_ALLOWANCE * 2 * u * (p + lr * update)

    def _adamw(self, name, step, grad_tol, grad, param, state, hyper):
        u, lr, eps = self.u, hyper["lr"], hyper["eps"]
        beta1, beta2 = hyper["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        prev = self.bounds.get(name)
        bc1 = 1 - beta1**step
        sqrt_bc2 = math.sqrt(1 - beta2**step)
        step_size = lr / bc1

        def bound(grad_tol, grad, param, m, v, prev_m, prev_v):
            m, v, g = m.double(), v.double(), grad.double().abs()
            prev_m = torch.zeros_like(m) if prev_m is None else prev_m.double()
            prev_v = torch.zeros_like(v) if prev_v is None else prev_v.double()
            dm = beta1 * prev_m + (1 - beta1) * grad_tol + 2 * u * m.abs()
            dv = beta2 * prev_v + (1 - beta2) * (2 * g * grad_tol + grad_tol**2) + 2 * u * v
            denom = v.sqrt() / sqrt_bc2 + eps
            # |sqrt(a) - sqrt(v)| over |a - v| <= dv, tight also where v is near zero.
            ddenom = ((v + dv).sqrt() - (v - dv).clamp(min=0).sqrt()) / sqrt_bc2
            denom_lo = (denom - ddenom).clamp(min=eps)
            dupdate = step_size * (dm / denom_lo + m.abs() * ddenom / (denom * denom_lo))
            update = step_size * m.abs() / denom
            # carried to the next step as float32 upper bounds ([Note: Bounds kept in float32, rounded up])
            return (dupdate + ROUNDING_ALLOWANCE * 2 * u * (param.double().abs() + update),
                    round_up_to_float32(dm), round_up_to_float32(dv))

        out, dm, dv = elementwise_in_chunks(bound, grad_tol, grad, param, m, v,
                                            None if prev is None else prev["m"], None if prev is None else prev["v"])
        self.bounds[name] = {"m": dm, "v": dv}
        return out
