"""Losses that depend on how the batch is split, refused before any rank starts.

[Note: Batch makeup]
The reference of a cell is the mean of the K = W x M local gradient terms its ranks compute (W
ranks of split data, M = grad_accum micro-batches each; docs/error_model.md). That mean is the
unsharded run's gradient only when the whole batch's loss is the mean of the local losses: a mean
of per-sample terms that do not look at the other samples. A model or loss that couples samples
(BatchNorm normalising over its own batch, a per-token mean over a padded batch where ranks hold
different numbers of real tokens, a sum where a mean belongs) makes every split its own training
run. The replay reproduces that run faithfully, so its cells would pass while their step-1 loss
is not the unsharded one, and another W of the same case would train yet another run.

So the plan measures it once per case and split, on step 1's batch: in float64 (a deep copy of
the plain model, the batch's floating tensors cast to double) the whole-batch loss L against the
mean of the K local losses, each local batch taken the way the ranks take it (`local_batch`, then
`micro_batches`). An honest model's difference is rounding only, below n * 1.1e-16 relative for a
forward of depth n; a coupling moves the loss by far more. A difference above THRESHOLD refuses
the split with one line. A model that cannot run in float64 (it raises, or computes any operation
in another floating dtype) is not measured, and the run says why.
"""

from __future__ import annotations

import copy
import functools
import math
import weakref
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from cases.catalog import get_case
from cases.data import call_model, local_batch, map_tensors, micro_batches
from harness.errors import PlanError
from harness.run.isolated import ChildFailed, child_checks

# Relative difference of the float64 losses above which a split is a different run
# (docs/error_model.md, "Batch makeup"): honest rounding of a forward of depth n stays below
# n * 1.1e-16, under 1.1e-9 up to a depth of 10^7; float32's own unit roundoff is 6e-8.
THRESHOLD = 1e-8


@dataclass(frozen=True)
class Split:
    """How one cell takes its batch: `world_size` ranks (1 for identical data), `grad_accum` micro-batches each."""

    data_mode: str
    world_size: int
    grad_accum: int

    @property
    def num_parts(self) -> int:
        return self.world_size * self.grad_accum

    def describe(self) -> str:
        data = f"world_size={self.world_size} with split data" if self.data_mode == "split" else "identical data"
        return data + (f", grad_accum={self.grad_accum} micro-batches" if self.grad_accum > 1 else "")


def splits_of(case_spec: str, world_sizes: tuple[int, ...], data_modes: tuple[str, ...]) -> list[Split]:
    """The splits of the run's cells of this case that cut its batch into more than one part."""
    grad_accum = get_case(case_spec).features.grad_accum
    out = [Split("split", w, grad_accum) for w in world_sizes if "split" in data_modes and w * grad_accum > 1]
    if "identical" in data_modes and grad_accum > 1:
        out.append(Split("identical", 1, grad_accum))
    return out


def check_batch_makeup(case_spec: str, world_sizes: tuple[int, ...], data_modes: tuple[str, ...],
                       isolated: bool = False) -> list[str]:
    """Raise PlanError for the first split of this case whose mean local loss is not the whole
    batch's; return the notes of a case that could not be measured (empty when measured). With
    `isolated` the float64 model is built and run in a child process (`measured_in_a_child`), so
    that the caller's memory never holds a copy of a big model."""
    splits = splits_of(case_spec, world_sizes, data_modes)
    if not splits:
        return []
    case = get_case(case_spec)
    if case.missing_requirements():
        return []  # the run reports the missing package itself
    measurements = (measured_in_a_child(case_spec, splits) if isolated else
                    [relative_difference(case_spec, split.world_size, split.grad_accum) for split in splits])
    for split, measured in zip(splits, measurements):
        if isinstance(measured, str):
            return [f"case={case_spec}: the batch-makeup check did not run ({measured}); whether its loss depends on "
                    f"how the batch is split is not known ([Note: Batch makeup], harness/run/batch_makeup.py)"]
        if not measured <= THRESHOLD:  # NaN refuses too
            raise PlanError(
                f"case={case_spec}: at {split.describe()} the mean of the {split.num_parts} local losses differs "
                f"from the whole batch's loss by {measured:.2e} relative (float64, step 1; honest rounding stays "
                f"below {THRESHOLD:.0e}), so every rank's loss depends on which samples share its batch and the "
                f"run is not the unsharded one; make each sample's loss term independent of the others (BatchNorm "
                f"normalises each rank's batch; a mean over a padded batch's real tokens must divide by the whole "
                f"batch's count), or give the case data_modes=('identical',)"
                + (" and Features(grad_accum=1)" if split.grad_accum > 1 else ""))
    return []


def measured_in_a_child(case_spec: str, splits: list[Split]) -> list[float | str]:
    """`relative_difference` of every split, computed by a child process (harness/run/isolated.py;
    the one that validated a user's case, when it measured these splits), or why it could not be."""
    try:
        _, measured = child_checks(case_spec, ":" in case_spec, split_key(splits))
    except ChildFailed as e:
        return [str(e)] * len(splits)
    return measured


def split_key(splits: list[Split]) -> tuple[tuple[int, int], ...]:
    """The (world size, micro-batches) of each split, as the child checks take them."""
    return tuple((split.world_size, split.grad_accum) for split in splits)


@functools.lru_cache(maxsize=None)
def relative_difference(case_spec: str, world_size: int, grad_accum: int) -> float | str:
    """|L - mean_k L_k| / max(|L|, mean_k |L_k|) in float64, L_k the losses of step 1's batch split
    over `world_size` ranks and `grad_accum` micro-batches each (K of them), or why it could not be
    measured. Cached per (case, split)."""
    probe = _probe(case_spec)
    if isinstance(probe, str):
        return probe
    model, batch, whole = probe
    parts = [micro for rank in range(world_size)
             for micro in micro_batches(local_batch(batch, "split", rank, world_size), grad_accum)]
    try:
        local = torch.stack([_loss(model, get_case(case_spec), part) for part in parts])
    except _NotFloat64 as e:
        return str(e)
    except Exception as e:
        return f"the float64 forward of a local batch raised {type(e).__name__}: {_one_line(e)}"
    scale = max(abs(whole), float(local.abs().mean()))
    return 0.0 if scale == 0 else abs(whole - float(local.mean())) / scale


@functools.lru_cache(maxsize=2)
def _probe(case_spec: str) -> tuple[torch.nn.Module, tuple, float] | str:
    """(the plain model in float64, step 1's batch with its floating tensors in float64, the
    whole-batch loss), or why the model cannot run in float64."""
    case = get_case(case_spec)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(case.seed)
            model = copy.deepcopy(case.build_model()).double()
        batch = map_tensors(lambda t: t.double() if t.is_floating_point() else t,
                            case.make_batch(case.seed, 1, case.global_batch))
    except Exception as e:
        return f"building the float64 model or batch raised {type(e).__name__}: {_one_line(e)}"
    try:
        whole = float(_loss(model, case, batch))
    except _NotFloat64 as e:
        return str(e)
    except Exception as e:
        return f"the float64 forward raised {type(e).__name__}: {_one_line(e)}"
    if not math.isfinite(whole):
        return f"the float64 loss of step 1's batch is {whole}"
    return model, batch, whole


class _NotFloat64(Exception):
    """The forward computed something in another floating dtype: its rounding is not float64's."""


class _Float64Watch(TorchDispatchMode):
    """Keeps the batch's values in float64 through the model's own casts, and records the first
    operation that still computes from the batch in a floating dtype other than float64. Only
    values derived from the batch's tensors count: a table the model computes in float32 from
    positions or constants alone (a RoPE table) is the same in every local forward and the whole
    one, so its rounding cannot tell them apart."""

    def __init__(self, batch_tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.first: str | None = None
        self._derived: dict[int, weakref.ref] = {}  # id -> the tensor (ids of dead tensors are reused)
        for t in batch_tensors:
            self._mark(t)

    def _mark(self, t: torch.Tensor) -> None:
        self._derived[id(t)] = weakref.ref(t)

    def _is_derived(self, t) -> bool:
        ref = self._derived.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        derived = any(self._is_derived(t) for t in pytree.tree_leaves((args, kwargs)))
        narrower = kwargs.get("dtype")
        if derived and isinstance(narrower, torch.dtype) and narrower.is_floating_point and narrower != torch.float64:
            # A cast of the batch's values to a narrower float (RMSNorm's `.to(torch.float32)`, a
            # loss on `logits.float()`) stays in float64: the measure is of the model's arithmetic,
            # not of its rounding.
            kwargs = {**kwargs, "dtype": torch.float64}
        out = func(*args, **kwargs)
        if derived:
            for t in pytree.tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                self._mark(t)
                if self.first is None and t.is_floating_point() and t.dtype != torch.float64:
                    self.first = f"{func} computes from the batch in {str(t.dtype).removeprefix('torch.')}"
        return out


def _loss(model: torch.nn.Module, case, batch) -> torch.Tensor:
    """The case's loss on `batch` in float64 with the buffers as built (a training forward may
    update them, as BatchNorm's running statistics; none of the losses compared reads another's)."""
    inputs, targets = batch
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    watch = _Float64Watch([t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)])
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), watch:
            loss = case.loss_fn(call_model(model, inputs), targets)
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers and b.shape == buffers[name].shape:
                    b.copy_(buffers[name])
    if watch.first is not None:
        raise _NotFloat64(f"the model does not run in float64: {watch.first}")
    if not isinstance(loss, torch.Tensor) or loss.dtype != torch.float64 or loss.dim() != 0:
        raise _NotFloat64("the loss in float64 is not a float64 scalar")
    return loss.detach()


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
