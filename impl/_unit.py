"""The hooks and lifecycle of one wrapped module (a "unit") and of the root unit.

Forward:  pre-hook unshards (all-gather) and points the original names at views;
          post-hook reshards unless reshard_after_forward=False or this is the root, and
          registers a hook on the outputs that re-gathers before this unit's backward.
Backward: each parameter view's post-accumulate-grad hook adds its gradient into the unit's
          padded gradient; after the last one the unit reduce-scatters, averages and reshards
          ([Note: Views into the unsharded buffer]). The root queues one callback at the end of
          backward that finishes every unit some of whose views got no gradient.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from impl._handle import FlatParamHandle, HandleState


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()


class FSDPUnit:
    def __init__(
        self,
        module: nn.Module,
        handles: list[FlatParamHandle],
        reshard_after_forward: bool,
        cast_inputs_to: torch.dtype | None,
    ) -> None:
        self.module = module
        self.handles = handles
        self.reshard_after_forward = reshard_after_forward
        self.cast_inputs_to = cast_inputs_to
        self.training_state = TrainingState.IDLE
        self.name = type(module).__name__
        self.is_root: bool | None = None  # decided at the first forward
        self.all_units: list[FSDPUnit] = []  # the root's view of every unit below it
        self._finalize_queued = False
        self.forward_prefetch: list[FSDPUnit] = []  # all-gathered async after this unit's pre-forward
        self.backward_prefetch: list[FSDPUnit] = []  # ... after this unit's pre-backward

    # -- root ------------------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        self.is_root = True
        for fqn, sub in self.module.named_modules():
            unit = sub.__dict__.get("_fsdp_unit")
            if unit is None:
                continue
            unit.name = fqn or "<root>"
            if unit is not self:
                if unit.is_root:
                    raise RuntimeError(
                        f"unit '{fqn}' already ran forward as a root; run the first forward "
                        f"through the outermost wrapped module"
                    )
                unit.is_root = False
            self.all_units.append(unit)

    def _root_queue_finalize(self) -> None:
        root = self if self.is_root else self._find_root()
        if root is None or root._finalize_queued:
            return
        root._finalize_queued = True
        Variable._execution_engine.queue_callback(root._finalize_backward)

    def _find_root(self) -> FSDPUnit | None:
        return self.__dict__.get("_root")

    def _finalize_backward(self) -> None:
        for unit in self.all_units:
            for handle in unit.handles:
                handle.finish_backward()  # units whose views did not all get a gradient
            unit.training_state = TrainingState.IDLE
        self._finalize_queued = False

    # -- forward -----------------------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.is_root is None:
            self._lazy_init()
            for unit in self.all_units:
                if unit is not self:
                    unit.__dict__["_root"] = self
        if not _in_backward():
            self.training_state = TrainingState.FORWARD
        for handle in self.handles:
            handle.check_materialized(self.name)
            if handle.state == HandleState.SHARDED:
                handle.zero_sharded_padding_()
            handle.unshard()
            handle.use_views()
        for unit in self.forward_prefetch:
            for handle in unit.handles:
                handle.unshard(async_op=True)
        if self.cast_inputs_to is not None:
            args, kwargs = _cast_floating((args, kwargs), self.cast_inputs_to)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if _in_backward():
            # Recomputation (activation checkpointing) inside backward: the parameters stay
            # unsharded until this unit's gradients are reduced.
            return output
        if self.reshard_after_forward and not self.is_root:
            for handle in self.handles:
                handle.reshard(for_backward_regather=True)
        tensors = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if tensors:
            register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        self.training_state = TrainingState.IDLE
        return output

    def owner_pre_forward(self, module: nn.Module, args: tuple) -> None:
        """Before a sub-module owning this unit's parameters runs: inside backward that is a
        recomputation, which may come after the unit released its unsharded parameters."""
        if _in_backward():
            for handle in self.handles:
                handle.recomputing = True  # its saved tensors are not all visible: hold on
                if handle.state == HandleState.SHARDED:
                    handle.unshard()

    # -- backward ----------------------------------------------------------------------------------
    def _pre_backward(self, grad: torch.Tensor) -> None:
        self._root_queue_finalize()
        self.training_state = TrainingState.PRE_BACKWARD
        for handle in self.handles:
            handle.unshard()
        for unit in self.backward_prefetch:
            for handle in unit.handles:
                handle.unshard(async_op=True)

    # -- FSDPModule methods ------------------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        for handle in self.handles:
            handle.sync_grads = requires_gradient_sync


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)
