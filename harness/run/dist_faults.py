"""Collective-level faults: planted bugs in what torch.distributed delivers, for ANY implementation.

The faults of impl/ (impl/_faults.py) are bugs inside our own FSDP; these act one level lower, on
the collectives an implementation's training step issues, so they plant the same kinds of bug
into torch FSDP2, FSDP1, DeepSpeed or a user's adapter without touching their code. The mutants
verb (`mutants --impls X`) proves the harness catches each of them on X.

[Note: Where collective faults act]
- The seam is the `ProcessGroup` class of torch's C++ bindings: every Python collective of
  torch.distributed (`all_reduce`, `reduce_scatter_tensor` / `reduce_scatter_single`,
  `_reduce_scatter_base`, `all_gather_into_tensor` / `all_gather_single`, `_all_gather_base`,
  `all_gather`, the coalesced tensor forms) ends in a method of it, whoever bound the Python function
  first (impl/_collectives.py binds its own at import). Measured on torch 2.13, gloo, W = 2:
  FSDP2 and ours issue `all_gather_single` and `reduce_scatter_single`; FSDP1 `allgather` (the
  list form) and `reduce_scatter_single`, HYBRID_SHARD `allreduce`; DeepSpeed ZeRO-1/2
  `allreduce` and `all_gather_single`, ZeRO-3 also `reduce_scatter_single`. Functional
  collectives (DTensor's `full_tensor`, DTensor gradient-norm clipping) and DDP's C++ reducer
  call the process group from C++ and are not reached.
- The faults are armed only inside the training step (zero_grad, forward and backward, clipping
  and the optimizer step: `PlantedAdapter`, or `armed()` where a worker drives the model itself).
  The evidence the harness gathers (full tensors, the ranks' shards) travels unfaulted.
- Honest runs never install anything: `planted()` returns the adapter itself when no collective
  fault is requested, so the process group's methods are torch's own, bitwise.
- A requested fault that never met a collective it acts on in a whole cell is an error
  (`check_acted`, NEVER_ACTED in its text), not a silent pass: the mutants verb reports it n/a.
  Each fault decides the same on every rank (drop changes the last rank's input only, but
  counts the reduction on every rank), so every rank raises alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from harness.faults import NEVER_ACTED, split_faults

SCALE = {"dist_scale_1e-5": 1e-5}
# The collective faults this seam plants (the catalog's "collective" layer, harness/faults.py).
PLANTS = frozenset({*SCALE, "dist_drop_last_rank", "dist_rotate_all_gather", "dist_stale_reduction"})
# Reductions whose result is a (weighted) sum: what a gradient reduction is. MAX / MIN (overflow
# flags, norms of inf) are left alone.
_SUMMING = (dist.ReduceOp.RedOpType.SUM, dist.ReduceOp.RedOpType.AVG, dist.ReduceOp.RedOpType.PREMUL_SUM)
# ProcessGroup method -> (kind, how its arguments hold outputs and inputs); see _outputs / _zeroed.
COLLECTIVE_METHODS = {
    "allreduce": ("reduce", "inplace"),
    "allreduce_coalesced": ("reduce", "inplace"),
    "reduce_scatter_single": ("reduce", "tensor"),
    "_reduce_scatter_base": ("reduce", "tensor"),
    "reduce_scatter": ("reduce", "lists"),
    "reduce_scatter_tensor_coalesced": ("reduce", "lists"),
    "reduce_scatter_single_coalesced": ("reduce", "lists"),
    "all_gather_single": ("gather", "tensor"),
    "_allgather_base": ("gather", "tensor"),
    "allgather": ("gather", "lists"),
    "allgather_into_tensor_coalesced": ("gather", "lists"),
    "all_gather_single_coalesced": ("gather", "lists"),
}


def scheduler_steps(faults: Iterable[str], scheduler, where: str) -> int:
    """How many times the loop steps the LR scheduler after an optimizer step: once, or twice with
    lr_scheduler_stepped_twice, which is an error where there is no scheduler to step."""
    if "lr_scheduler_stepped_twice" not in faults:
        return 1
    if scheduler is None:
        raise RuntimeError(f"{where}: fault lr_scheduler_stepped_twice {NEVER_ACTED}: the optimizer has no "
                           f"lr_scheduler (a case with one: lr_schedule)")
    return 2


def is_summing(opts) -> bool:
    if opts is None:  # the default options: a sum
        return True
    op = getattr(opts, "reduceOp", opts)  # an options object, or a bare ReduceOp in the older overloads
    return getattr(op, "op", op) in _SUMMING


def flat_tensors(xs) -> list[torch.Tensor]:
    if isinstance(xs, torch.Tensor):
        return [xs]
    return [t for x in xs for t in flat_tensors(x)]


def _outputs(layout: str, args: tuple) -> list[torch.Tensor]:
    """Every tensor the collective writes, flattened (in-place ones: the inputs themselves)."""
    return flat_tensors(args[0])


def _rotate(kind_layout: str, args: tuple, world_size: int) -> None:
    """Rank r's slot of every all-gather output now holds rank (r + 1) % W's shard."""
    if kind_layout == "tensor":
        outs = [args[0]]
    elif isinstance(args[0], torch.Tensor) or all(isinstance(o, torch.Tensor) for o in args[0]):
        outs = flat_tensors(args[0])  # coalesced: one concatenated output per input
    else:
        for per_input in args[0]:  # list form: one list of W tensors per input
            values = [t.clone() for t in per_input]
            for r, t in enumerate(per_input):
                t.copy_(values[(r + 1) % world_size])
        return
    for out in outs:
        chunks = out.reshape(world_size, -1)  # (W, n): rank order
        out.copy_(chunks.roll(-1, dims=0).reshape(out.shape))


class CollectiveFaults:
    """The collective faults of one cell or fuzz example, with their state (the stale fault's
    first results) and how often each met a collective it acts on."""

    def __init__(self, faults: Iterable[str]) -> None:
        _, self.faults = split_faults(faults)
        if self.faults - PLANTS:
            raise ValueError(f"collective faults {sorted(self.faults - PLANTS)} have no seam here; it plants {sorted(PLANTS)}")
        self.acted = dict.fromkeys(sorted(self.faults), 0)
        self._first_results: dict[tuple, torch.Tensor] = {}
        self._calls_by_key: dict[tuple, int] = {}
        self._depth = 0
        self._originals: dict[str, object] = {}

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """The process group's collectives carry the faults while inside (re-entrant)."""
        if self._depth == 0:
            for name in COLLECTIVE_METHODS:
                if name in ProcessGroup.__dict__:
                    # The class's own entry goes back on exit (pybind11 wraps it to bind self);
                    # getattr gives the unbound function the faulty one calls with the group.
                    self._originals[name] = ProcessGroup.__dict__[name]
                    setattr(ProcessGroup, name, self._faulty(name, getattr(ProcessGroup, name)))
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for name, original in self._originals.items():
                    setattr(ProcessGroup, name, original)
                self._originals.clear()

    def _faulty(self, name: str, original):
        kind, layout = COLLECTIVE_METHODS[name]
        plant = self

        def collective(group, *args, **kwargs):
            return plant._call(group, kind, layout, name, original, args, kwargs)

        collective.__name__ = name
        return collective

    def _call(self, group, kind: str, layout: str, name: str, original, args: tuple, kwargs: dict):
        opts = args[-1] if len(args) > 1 else kwargs.get("opts")
        if kind == "gather":
            if "dist_rotate_all_gather" not in self.faults:
                return original(group, *args, **kwargs)
            work = original(group, *args, **kwargs)
            if work is not None:
                work.wait()  # the output is complete only now
            _rotate(layout, args, group.size())
            self.acted["dist_rotate_all_gather"] += 1
            return _Delivered.of(work, flat_tensors(args[0]))
        outputs = [t for t in _outputs(layout, args)]
        if not (is_summing(opts) and outputs and all(t.is_floating_point() for t in outputs)):
            return original(group, *args, **kwargs)
        if "dist_drop_last_rank" in self.faults:
            self.acted["dist_drop_last_rank"] += 1
            if group.rank() == group.size() - 1:
                if layout == "inplace":
                    for t in outputs:
                        t.zero_()
                else:
                    args = (args[0], _zeros_like(args[1]), *args[2:])
        work = original(group, *args, **kwargs)
        if work is not None:
            work.wait()  # post-call faults change the result; a zeroed input must outlive the call
        for fault, eps in SCALE.items():
            if fault in self.faults:
                self.acted[fault] += 1
                for t in outputs:
                    t.mul_(1.0 + eps)
        if "dist_stale_reduction" in self.faults:
            for t in outputs:
                key = (name, tuple(t.shape), t.dtype)
                self._calls_by_key[key] = self._calls_by_key.get(key, 0) + 1
                if self._calls_by_key[key] == 1:
                    self._first_results[key] = t.detach().clone()
                elif self._calls_by_key[key] == 2:
                    t.copy_(self._first_results.pop(key))
                    self.acted["dist_stale_reduction"] += 1
        return _Delivered.of(work, outputs)

    def check_acted(self, where: str) -> None:
        idle = [f for f, n in self.acted.items() if n == 0]
        if idle:
            raise RuntimeError(
                f"{where}: collective fault(s) {idle} {NEVER_ACTED}: the training step issued no torch.distributed "
                f"collective they act on through the Python process group (a C++ reducer such as DDP's, functional "
                f"collectives, or too few steps / no repeated shapes for the stale fault); they cannot test this run")


class _Delivered:
    """The collective's Work, whose wait() delivers the faulted result however often it is called.

    A backend may complete the output inside wait() (gloo's reduce_scatter_single on torch 2.13
    writes it again at each wait, measured: a result scaled after the first wait was overwritten
    by the caller's own wait), so the faulted values are copied back after every wait."""

    def __init__(self, work, outputs: list[torch.Tensor]) -> None:
        self._work = work
        self._outputs = outputs
        self._faulted = [t.detach().clone() for t in outputs]

    @classmethod
    def of(cls, work, outputs: list[torch.Tensor]):
        return None if work is None else cls(work, outputs)

    def wait(self, *args, **kwargs):
        done = self._work.wait(*args, **kwargs)
        for t, faulted in zip(self._outputs, self._faulted):
            t.copy_(faulted)
        return done

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _zeros_like(inputs):
    if isinstance(inputs, torch.Tensor):
        return torch.zeros_like(inputs)
    return [_zeros_like(x) for x in inputs]


class PlantedAdapter:
    """An adapter whose training-step methods run with collective faults armed; everything else
    (wrap, evidence, checkpoints) passes through unfaulted, with only impl/'s faults in the context."""

    def __init__(self, adapter, plant: CollectiveFaults) -> None:
        self.adapter = adapter
        self.plant = plant

    def __getattr__(self, name: str):
        return getattr(self.adapter, name)

    def _impl_ctx(self, ctx):
        return replace(ctx, faults=split_faults(ctx.faults)[0])

    def wrap(self, model, wrap_paths, ctx):
        return self.adapter.wrap(model, wrap_paths, self._impl_ctx(ctx))

    def reshard_checkpoint(self, model, optim, spec, ctx, *args):
        return self.adapter.reshard_checkpoint(model, optim, spec, self._impl_ctx(ctx), *args)

    def full_state_roundtrip(self, model, build_model, wrap_paths, ctx, directory):
        return self.adapter.full_state_roundtrip(model, build_model, wrap_paths, self._impl_ctx(ctx), directory)

    def zero_grad(self, *args):
        with self.plant.armed():
            return self.adapter.zero_grad(*args)

    def forward_backward(self, *args):
        with self.plant.armed():
            return self.adapter.forward_backward(*args)

    def optimizer_step(self, model, optim, features, after_clip=None):
        from harness.adapters.base import takes_after_clip

        with self.plant.armed():
            if after_clip is None or not takes_after_clip(self.adapter):
                return self.adapter.optimizer_step(model, optim, features)
            return self.adapter.optimizer_step(model, optim, features, after_clip)


def planted(adapter, faults: Iterable[str]):
    """`adapter` itself when no collective fault is requested (an honest run installs nothing);
    otherwise a PlantedAdapter carrying them."""
    plant = CollectiveFaults(faults)
    return PlantedAdapter(adapter, plant) if plant.faults else adapter


def armed(adapter) -> contextlib.AbstractContextManager:
    """For a worker that drives the wrapped model itself: the faults of a PlantedAdapter armed."""
    return adapter.plant.armed() if isinstance(adapter, PlantedAdapter) else contextlib.nullcontext()


def check_acted(adapter, where: str) -> None:
    """After a whole cell: raise when a requested collective fault never acted ([Note: Where
    collective faults act])."""
    if isinstance(adapter, PlantedAdapter):
        adapter.plant.check_acted(where)
