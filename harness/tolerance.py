"""The error model: how far an honest sharded run may differ from the unsharded one, per element.

Summary (the full reasoning is docs/error_model.md):

1. Per step, the reference is the *shadow*: the plain model stepped on the global batch from the
   cell's own parameters of the previous step. Differences never compound through the training
   trajectory into the check (Adam amplifies a 1e-10 gradient difference near v = 0 into a 1e-4
   parameter difference two steps later; that is reported in the W x W matrices, not judged).
2. Gradients. The mean gradient is a sum over global_batch * terms_per_sample terms that a
   sharded run adds in another order (per-rank partial sums, then the reduce-scatter), and each
   sample's own forward/backward may run through kernels picked for another local batch size,
   whose dot products round differently. Two orders of one sum differ by at most
   2 * gamma_n * sum|x_i| (Higham, gamma_n ~ n * u); with n = global_batch * terms_per_sample +
   the case's accumulation length (Case.accumulation_length) this gives
       tol_grad = s * (2 * n * u * A + u * |g|),  A = mean over samples of |per-sample gradient|,
   u the unit roundoff of the dtype (2^-24 for fp32), s the case's tolerance_scale (>= 1).
3. Loss: the mean of n non-negative terms: tol_loss = s * 2 * n * u * |L|.
4. Parameters: the admissible gradient error is pushed through the optimizer's update, per
   element, using the shadow's optimizer state (first order, carrying the state error across
   steps); plus the elementwise rounding of the update itself. See `propagate_*`.
5. Initial parameters and padding: exact (a copy and zeros involve no arithmetic).
6. The tolerance a check uses is SAFETY_FACTOR x the bound. An honest run can reach the bound
   (a parameter whose final rounding flips by one ulp does), so honest runs sit at or below half
   the tolerance and "margin < 0.5" reads "within the derived bound".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cases.catalog import OptimizerSpec

SAFETY_FACTOR = 2.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for a p-bit significand: the largest relative error of one rounding."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating dtype")
    return torch.finfo(dtype).eps / 2


@dataclass(frozen=True)
class ErrorModel:
    num_terms: int  # n: terms summed into one gradient element / the loss
    tolerance_scale: float = 1.0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_terms < 1:
            raise ValueError(f"ErrorModel num_terms={self.num_terms} must be >= 1")
        if not self.tolerance_scale >= 1:
            raise ValueError(f"ErrorModel tolerance_scale={self.tolerance_scale} must be >= 1")

    @property
    def u(self) -> float:
        return unit_roundoff(self.dtype)

    def grad_bound(self, abs_grad: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        u = self.u
        return self.tolerance_scale * (2 * self.num_terms * u * abs_grad.double() + u * grad.double().abs())

    def loss_bound(self, loss: float) -> float:
        return self.tolerance_scale * 2 * self.num_terms * self.u * abs(loss)


@dataclass
class OptimizerErrorState:
    """Per-parameter bounds on |candidate state - shadow state|, carried across steps."""

    spec: OptimizerSpec
    u: float
    bounds: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def param_bound(self, name: str, step: int, grad_tol: torch.Tensor, grad: torch.Tensor,
                  param: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Bound on |candidate param - shadow param| after `step` (1-based), from the same start."""
        if self.spec.kind == "sgd":
            return self._sgd(name, grad_tol, param, state)
        return self._adamw(name, step, grad_tol, grad, param, state)

    def _sgd(self, name, grad_tol, param, state):
        spec, u = self.spec, self.u
        p = param.double().abs()
        if spec.momentum == 0 or "momentum_buffer" not in state:
            update_err = grad_tol
            update = p.new_zeros(()) if "momentum_buffer" not in state else state["momentum_buffer"].double().abs()
        else:
            buf = state["momentum_buffer"].double().abs()
            prev = self.bounds.get(name, {}).get("buf", torch.zeros_like(buf))
            # buf = momentum * buf + g (+ weight_decay * p): the same ops on inputs that differ.
            dbuf = spec.momentum * prev + grad_tol + 2 * u * buf
            self.bounds[name] = {"buf": dbuf}
            update_err, update = dbuf, buf
        return spec.lr * update_err + 2 * u * (p + spec.lr * update)

    def _adamw(self, name, step, grad_tol, grad, param, state):
        spec, u = self.spec, self.u
        beta1, beta2 = spec.betas
        m = state["exp_avg"].double()
        v = state["exp_avg_sq"].double()
        g = grad.double().abs()
        prev = self.bounds.get(name, {"m": torch.zeros_like(m), "v": torch.zeros_like(v)})
        dm = beta1 * prev["m"] + (1 - beta1) * grad_tol + 2 * u * m.abs()
        dv = beta2 * prev["v"] + (1 - beta2) * (2 * g * grad_tol + grad_tol**2) + 2 * u * v
        self.bounds[name] = {"m": dm, "v": dv}
        bc1 = 1 - beta1**step
        sqrt_bc2 = math.sqrt(1 - beta2**step)
        step_size = spec.lr / bc1
        denom = v.sqrt() / sqrt_bc2 + spec.eps
        # |sqrt(a) - sqrt(v)| over |a - v| <= dv, tight also where v is near zero.
        ddenom = ((v + dv).sqrt() - (v - dv).clamp(min=0).sqrt()) / sqrt_bc2
        denom_lo = (denom - ddenom).clamp(min=spec.eps)
        dupdate = step_size * (dm / denom_lo + m.abs() * ddenom / (denom * denom_lo))
        update = step_size * m.abs() / denom
        return dupdate + 2 * u * (param.double().abs() + update)
