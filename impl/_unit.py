"""The hooks and lifecycle of one wrapped module (a "unit") and of the root unit.

Forward:  pre-hook unshards (all-gather) and points the original names at views;
          post-hook reshards where `reshards_after_forward` says so (FSDP2's rule: None reshards
          every unit but the root, True every unit, the root too; False none), and
          registers a hook on the outputs that re-gathers before this unit's backward.
Backward: each parameter view's post-accumulate-grad hook keeps its gradient as its slot's (or
          adds it into it); after the last one the unit reshards ([Note: Views into the unsharded
          buffer]). A unit's reduce-scatter starts at the pre-backward of the next unit whose
          forward ran before it ([Note: Rank-consistent reductions], [Note: Overlapped gradient
          reduction]). The root queues one callback at the end of backward that reduces every
          unit still due and waits for the last reduction.

[Note: Rank-consistent reductions]
Every rank must issue the same collectives in the same order, but which parameters get a gradient
may differ between ranks (an expert no token of this rank's batch chose), so "the last view of the
unit got its gradient" happens on some ranks and never on others. A unit therefore starts its
reduction only at points every rank's backward passes alike: the pre-backward of a unit Y whose
last forward ended before the unit's first forward of this iteration began (then every backward
op of the unit has run: autograd runs ready nodes latest-created first, and every op of the
unit was created after Y's outputs), or the root's end-of-backward callback; at either point
every unit due whose forward came later is reduced, latest forward first. Whether this rank gave
each parameter a gradient travels with the reduction ([Note: Gradients with their used flags] in
impl/_handle.py). A unit whose last view reports earlier still reshards at once. What this cannot
make consistent: a unit whose forward runs on some ranks and not on others (its all-gathers fall
out of step first), or whose backward is reached on some ranks only.

[Note: Implicit prefetch]
Unless the user chose (set_modules_to_forward_prefetch / ..._backward_prefetch, [] for none),
each unit starts one all-gather ahead: in forward, of the unit whose pre-forward followed its own
in the previous forward; in backward, of the unit whose post-forward preceded its own in this
forward (backward runs the units in reverse). The backend gathers while this unit computes, at
the cost of one more unit unsharded. A guess that does not come true (control flow changed) only
gathers early: a unit still gathers at its own pre-forward / pre-backward if it has not, and
every unit is resharded at the end of backward.

[Note: Module groups]
`fully_shard([embed, head])` makes one unit of several modules (FSDP2's idiom for a tied embedding
and output head, which one flat parameter must hold). Every member holds the unit and gets its
hooks; the unit's pass through forward begins at the pre-forward of whichever member runs first
(the all-gather, the lifecycle's FORWARD) and ends at the post-forward of the last member to run
(the reshard, the pre-backward hook, IDLE); the members in between only point their names at the
views. A member that did not run in a forward (a chunked loss calling the head later) leaves the
pass open: the root's post-forward ends it on the root's output, and the end of backward clears
what is left. Names of a group's parameters are each relative to their member (the handle's
`slot_members`), so code that names parameters goes through `units_with_prefixes`, which meets
each unit once with every member's prefix.

[Note: Backwards through part of the model]
A chunked loss may backpropagate each chunk through the head alone (`head(chunk).sum().backward()`)
before the hidden state's own backward through the rest. The end of such a backward must not
finish the units it did not reach whose forward's graph is still alive (their views saved by it,
`FlatParamHandle.graph_holds_views`, the storage counts of [Note: Releasing unsharded parameters]):
finishing them forgets their views and frees their parameters, which the later backward then reads
(autograd's "data is not allocated", or a crash). Such a unit waits, views and state kept, for the
backward that reaches it. A unit whose graph is gone (its output unused, on every rank alike) is
finished and reduced as before, so the collectives stay in step.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from impl._handle import FlatParamHandle, GradReducer, HandleState


class TrainingState(Enum):
    """Where a unit is in its iteration ([Note: Unit lifecycle])."""

    IDLE = auto()  # between its forward and its backward, or between iterations
    FORWARD = auto()  # between its pre-forward and post-forward hooks
    PRE_BACKWARD = auto()  # its backward began, until the root's end-of-backward callback


# [Note: Unit lifecycle]
# A unit goes IDLE -> FORWARD (pre-forward) -> IDLE (post-forward), as many times as its module
# runs in one forward, then IDLE -> PRE_BACKWARD when the gradient of one of its outputs arrives
# (again for each forward it ran), and back to IDLE in the root's end-of-backward callback. The
# root enters PRE_BACKWARD first (its outputs are the last made in forward, so autograd reaches
# them first; a backward that starts below them, from an inner output, moves the root too), so
# "the root is in PRE_BACKWARD" is what "this forward runs inside backward" means:
# a recomputation (activation checkpointing), which neither moves the unit's state nor its
# reductions' clock, and keeps the parameters unsharded for the gradients to come. Every move is
# checked against TRANSITIONS; any other is a bug of impl or a forward that raised half-way, and
# is raised with the rank, the unit and both states.
TRANSITIONS = frozenset({
    (TrainingState.IDLE, TrainingState.FORWARD),
    (TrainingState.FORWARD, TrainingState.IDLE),
    (TrainingState.IDLE, TrainingState.PRE_BACKWARD),
    (TrainingState.PRE_BACKWARD, TrainingState.PRE_BACKWARD),  # a unit that ran more than one forward
    (TrainingState.PRE_BACKWARD, TrainingState.IDLE),
    (TrainingState.IDLE, TrainingState.IDLE),  # the end of backward for a unit whose backward never began
})


class FSDPUnit:
    def __init__(
        self,
        module: nn.Module,
        handles: list[FlatParamHandle],
        reshard_after_forward: bool | None,
        cast_inputs_to: torch.dtype | None,
        cast_outputs_to: torch.dtype | None = None,
        members: list[nn.Module] | None = None,
    ) -> None:
        self.module = module
        # [Note: Module groups]: every module whose parameters this unit holds; one but for a list
        # passed to fully_shard, whose pass through forward runs from the first member's
        # pre-forward to the last member's post-forward.
        self.members = list(members) if members else [module]
        self._to_run: set[int] = set()  # ids of the members yet to run in this forward's pass
        self._backward_began = False  # its pre-backward ran in the backward under way
        self.handles = handles
        self.reshard_after_forward = reshard_after_forward  # as configured: None, True or False
        self.cast_inputs_to = cast_inputs_to
        self.cast_outputs_to = cast_outputs_to  # MixedPrecisionPolicy.output_dtype
        self.training_state = TrainingState.IDLE  # moved by `_enter` only ([Note: Unit lifecycle])
        self.name = type(module).__name__
        self.is_root: bool | None = None  # decided at the first forward
        # Errors of parameters this unit's modules share with another unit, raised at the root's
        # first forward (as FSDP2 raises them): set by fully_shard.
        self.conflicts: list[str] = []
        self.root: FSDPUnit | None = None  # the root unit above this one, set at the root's first forward
        self.all_units: list[FSDPUnit] = []  # the root's view of every unit below it
        self._finalize_queued = False
        # All-gathered asynchronously after this unit's pre-forward / pre-backward: set by the
        # user, or None for the implicit choice ([Note: Implicit prefetch]).
        self.forward_prefetch: list[FSDPUnit] | None = None
        self.backward_prefetch: list[FSDPUnit] | None = None
        self._next_in_forward: FSDPUnit | None = None  # the unit whose pre-forward came next, last time
        self._next_in_backward: FSDPUnit | None = None  # the unit whose post-forward came before this one's
        self._last_pre_forward: FSDPUnit | None = None  # as a root: in the forward under way
        self._last_post_forward: FSDPUnit | None = None  # as a root: in the forward under way
        # [Note: Rank-consistent reductions]: this unit's first pre-forward and last post-forward
        # of the forward under way, on its root's clock (ticked by both, reset by each forward).
        self.forward_begin: int | None = None
        self.forward_end: int | None = None
        self._clock = 0  # as a root
        self.reducer = GradReducer()  # as a root: the gradient reductions of every unit below it
        # As a root: False leaves the last reduction of a backward in flight (FSDP2's
        # set_is_last_backward, for micro-batches); the next reduction or last backward waits for it.
        self.is_last_backward = True

    # -- root ------------------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        self.is_root = True
        for fqn, sub in self.module.named_modules():
            unit = sub.__dict__.get("_fsdp_unit")
            if unit is None or any(u is unit for u in self.all_units):
                continue  # a group's unit is met once per member ([Note: Module groups])
            unit.name = fqn or "<root>"
            if unit is not self:
                if unit.is_root:
                    raise RuntimeError(
                        f"unit '{fqn}' already ran forward as a root; run the first forward "
                        f"through the outermost wrapped module"
                    )
                unit.is_root = False
            self.all_units.append(unit)
        for unit in self.all_units:
            if unit.conflicts:
                raise ValueError(unit.conflicts[0])

    def _root_queue_finalize(self) -> None:
        root = self.root_unit
        if root is None or root._finalize_queued:
            return
        root._finalize_queued = True
        Variable._execution_engine.queue_callback(root._finalize_backward)

    @property
    def root_unit(self) -> FSDPUnit | None:
        """The root this unit runs under (itself for the root); None before the root's first forward."""
        return self if self.is_root else self.root

    @property
    def reshards_after_forward(self) -> bool:
        """Whether post-forward frees the unsharded parameters (backward gathers them again): as
        configured, and where that is None every unit but the root (whose backward starts at once)."""
        if self.reshard_after_forward is None:
            return not self.is_root
        return self.reshard_after_forward

    def in_backward(self) -> bool:
        """Whether a forward now is a recomputation inside backward ([Note: Unit lifecycle])."""
        return (self.root_unit or self).training_state is TrainingState.PRE_BACKWARD

    def _enter(self, state: TrainingState) -> None:
        """Move to `state`, which must follow the unit's own by TRANSITIONS ([Note: Unit lifecycle])."""
        if (self.training_state, state) not in TRANSITIONS:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            raise RuntimeError(
                f"rank {rank}: FSDP unit '{self.name}' moved from {self.training_state.name} to {state.name}, "
                f"which its lifecycle does not allow (a forward that raised half-way, or a hook out of order)"
            )
        self.training_state = state

    def _finalize_backward(self) -> None:
        for unit in self._latest_forward_first(self.all_units):
            # [Note: Backwards through part of the model]: a unit this backward did not reach whose
            # forward's graph still holds its parameters waits for a backward of its own.
            waits = not unit._backward_began and any(h.graph_holds_views() for h in unit.handles)
            if not waits:
                for handle in unit.handles:
                    handle.reduce_gradients()  # every unit still due, some of whose views got no gradient here
                unit._to_run.clear()
            unit._enter(TrainingState.IDLE)
            unit._backward_began = False
        if self.is_last_backward:
            self.reducer.wait()  # every .grad complete before backward returns
        self._finalize_queued = False

    def _reduce_units_after(self, end: int | None) -> None:
        """As a root: reduce every unit due whose forward began after `end` ([Note: Rank-consistent
        reductions])."""
        if end is None:
            return
        later = [u for u in self.all_units if u.forward_begin is not None and u.forward_begin > end]
        for unit in self._latest_forward_first(later):
            for handle in unit.handles:
                if handle.reduce_due:
                    handle.reduce_gradients()

    @staticmethod
    def _latest_forward_first(units: list[FSDPUnit]) -> list[FSDPUnit]:
        return sorted(units, key=lambda u: -1 if u.forward_begin is None else u.forward_begin, reverse=True)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- forward -----------------------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.is_root is None:
            self._lazy_init()
            for unit in self.all_units:
                if unit is not self:
                    unit.root = self
                for handle in unit.handles:
                    handle.reducer = self.reducer
        in_backward = self.in_backward()
        # A group's pass through forward is under way from its first member's pre-forward until
        # its last member's post-forward ([Note: Module groups]): later members only gather.
        first = not in_backward and not (self._to_run and self.training_state is TrainingState.FORWARD)
        if first:
            self._enter(TrainingState.FORWARD)
            self._record_pre_forward()
            if len(self.members) > 1:
                self._to_run = {id(m) for m in self.members}
        for handle in self.handles:
            handle.check_materialized(self.name, self.is_root)
            if handle.state == HandleState.SHARDED:
                handle.zero_sharded_padding_()
            handle.unshard()
            handle.use_views()
        if first:
            _prefetch(self.forward_prefetch, self._next_in_forward)
        if self.cast_inputs_to is not None:
            args, kwargs = _cast_floating((args, kwargs), self.cast_inputs_to)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.in_backward():
            # Recomputation (activation checkpointing) inside backward: the parameters stay
            # unsharded until this unit's gradients are reduced.
            return output
        if self._to_run:
            self._to_run.discard(id(module))
            if self._to_run:  # the group's pass goes on: its other members are still to run
                return _cast_floating(output, self.cast_outputs_to) if self.cast_outputs_to is not None else output
        if self.is_root:
            output = self._end_open_passes(output)
        return self._end_forward(output)

    def _end_open_passes(self, output: Any) -> Any:
        """As a root at its post-forward: end the pass of every group some member of which did not
        run in this forward ([Note: Module groups]), on the root's output, so its backward comes."""
        for unit in reversed(self.all_units):
            if unit is not self and unit._to_run and unit.training_state is TrainingState.FORWARD:
                unit._to_run.clear()
                output = unit._end_forward(output)
        return output

    def _end_forward(self, output: Any) -> Any:
        """The end of this unit's pass through forward: reshard as configured, register the hook
        that gathers again before its backward, return to IDLE."""
        if self.reshards_after_forward:
            for handle in self.handles:
                handle.reshard(for_backward_regather=True)
        root = self.root_unit
        if root is not None:
            self._next_in_backward, root._last_post_forward = root._last_post_forward, self
            self.forward_end = root._tick()
        if self.cast_outputs_to is not None:
            output = _cast_floating(output, self.cast_outputs_to)
        tensors = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if tensors:
            register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        self._enter(TrainingState.IDLE)
        return output

    def owner_pre_forward(self, module: nn.Module, args: tuple) -> None:
        """Before a sub-module owning this unit's parameters runs: inside backward that is a
        recomputation, which may come after the unit released its unsharded parameters."""
        if self.in_backward():
            for handle in self.handles:
                handle.recomputing = True  # its saved tensors are not all visible: hold on
                if handle.release_checked:
                    # Another rank may have released where this one kept its parameters: gather
                    # again on every rank alike, or the collectives fall out of step.
                    handle.release_checked = False
                    handle.reshard()
                handle.unshard()

    # -- backward ----------------------------------------------------------------------------------
    def _pre_backward(self, grad: torch.Tensor) -> None:
        self._root_queue_finalize()
        root = self.root_unit
        if root is not None:
            root._reduce_units_after(self.forward_end)
            if root is not self and root.training_state is TrainingState.IDLE:
                root._enter(TrainingState.PRE_BACKWARD)  # a backward that began below the root's outputs
        if self._to_run and self.training_state is TrainingState.FORWARD:
            # A group's pass some member ran in after the root's forward (a chunked loss's head):
            # it ends here, its parameters kept for the backward ([Note: Module groups]).
            self._to_run.clear()
            self._enter(TrainingState.IDLE)
        self._enter(TrainingState.PRE_BACKWARD)
        self._backward_began = True
        for handle in self.handles:
            handle.unshard()
        _prefetch(self.backward_prefetch, self._next_in_backward)

    def _record_pre_forward(self) -> None:
        if self.is_root:  # a new forward: every unit of it comes after this one
            self._last_pre_forward = self._last_post_forward = None
            self._clock = 0
            for unit in self.all_units:
                unit.forward_begin = unit.forward_end = None
                for handle in unit.handles:  # a smaller group's N-th serves one backward only
                    handle.drop_post_forward()
        root = self.root_unit
        if root is None:
            return
        if self.forward_begin is None:
            self.forward_begin = root._tick()
        if root._last_pre_forward is not None:
            root._last_pre_forward._next_in_forward = self
        root._last_pre_forward = self

    def reset_iteration(self) -> None:
        """As a root: forget an iteration an exception cut short (FSDPModule.reset_iter_state): the
        reduction in flight dropped, every unit resharded and IDLE, its passes and clocks cleared.
        The one move of the lifecycle outside TRANSITIONS ([Note: Unit lifecycle])."""
        self.reducer.drop()
        for unit in self.all_units or [self]:
            for handle in unit.handles:
                handle.reset_iteration()
            unit.training_state = TrainingState.IDLE
            unit._to_run.clear()
            unit.forward_begin = unit.forward_end = None
        self._finalize_queued = False
        self._clock = 0
        self._last_pre_forward = self._last_post_forward = None

    # -- FSDPModule methods ------------------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        for handle in self.handles:
            handle.sync_grads = handle.comm.seams.gradient_sync(requires_gradient_sync)


def _prefetch(chosen: list[FSDPUnit] | None, implicit: FSDPUnit | None) -> None:
    """Start the all-gathers of the units the user chose, or else of the implicit one."""
    for unit in chosen if chosen is not None else [implicit] if implicit is not None else []:
        for handle in unit.handles:
            handle.unshard(async_op=True)


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def units_with_prefixes(model: nn.Module) -> list[tuple[FSDPUnit, list[str | None]]]:
    """Every unit under `model` once, in the order of its first member in `model.named_modules()`,
    with each member's name prefix in `model` ("" for `model` itself, "a.b." below it; None for a
    member outside `model`): a group's unit is held by every member ([Note: Module groups])."""
    found: dict[int, tuple[FSDPUnit, list[str | None]]] = {}
    for fqn, module in model.named_modules():
        unit = module.__dict__.get("_fsdp_unit")
        if unit is None:
            continue
        _, prefixes = found.setdefault(id(unit), (unit, [None] * len(unit.members)))
        for j, member in enumerate(unit.members):
            if member is module:
                prefixes[j] = f"{fqn}." if fqn else ""
    return list(found.values())
