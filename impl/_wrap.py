"""Auto-wrap policies, as in the seeds' config (transformer_layer_cls_to_wrap, min_num_params)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn

from impl.api import fully_shard


@dataclass(frozen=True)
class ModuleClassPolicy:
    """Wrap every module that is an instance of one of `classes` (e.g. the transformer block)."""

    classes: tuple[type, ...]

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("ModuleClassPolicy: classes must name at least one module class")

    def __call__(self, module: nn.Module, unwrapped_numel: int) -> bool:
        return isinstance(module, self.classes)


@dataclass(frozen=True)
class SizePolicy:
    """Wrap a module once the parameters it would own (not yet wrapped below it) reach the size."""

    min_num_params: int

    def __post_init__(self) -> None:
        if self.min_num_params < 1:
            raise ValueError(f"SizePolicy: min_num_params={self.min_num_params} must be >= 1")

    def __call__(self, module: nn.Module, unwrapped_numel: int) -> bool:
        return unwrapped_numel >= self.min_num_params


@dataclass(frozen=True)
class AnyPolicy:
    policies: tuple[Callable[[nn.Module, int], bool], ...] = field(default_factory=tuple)

    def __call__(self, module: nn.Module, unwrapped_numel: int) -> bool:
        return any(p(module, unwrapped_numel) for p in self.policies)


def auto_wrap(model: nn.Module, policy: Callable[[nn.Module, int], bool], **fully_shard_kwargs) -> list[str]:
    """Apply fully_shard bottom-up wherever `policy` says so, then to the root; return the
    wrapped modules' names in the order they were wrapped (the root last, as '')."""
    wrapped: list[str] = []

    def visit(fqn: str, module: nn.Module) -> int:
        """Post-order: returns the numel of parameters under `module` not yet wrapped."""
        numel = sum(p.numel() for p in module.parameters(recurse=False))
        for name, child in module.named_children():
            numel += visit(f"{fqn}.{name}" if fqn else name, child)
        if module is not model and numel > 0 and policy(module, numel):
            fully_shard(module, **fully_shard_kwargs)
            wrapped.append(fqn)
            return 0
        return numel

    visit("", model)
    fully_shard(model, **fully_shard_kwargs)
    wrapped.append("")
    return wrapped
