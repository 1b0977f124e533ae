"""Parameter groups an implementation cannot honour, refused before any rank starts.

A case's `OptimizerSpec.param_groups` give parameters their own learning rate or weight decay
("no weight decay on biases and norms"). An implementation that flattens a unit's parameters into
one tensor (ours: one flat parameter per wrapped module) gives the optimizer one tensor with one
set of hyperparameters for all of them, so a grouping that splits a unit cannot be run; the
adapter says which tensors hold several parameters (`Adapter.shared_tensors`), and a split is
refused here with one line naming the unit, its parameters in each group and the ways out.
"""

from __future__ import annotations

import torch

from cases.case import Case, OptimizerSpec
from harness.errors import PlanError

SHOWN = 3  # parameter names shown per group


def check_param_groups(case: Case, case_spec: str, impls: dict) -> None:
    """Raise PlanError when an implementation of `impls` ({spec: adapter}) holds parameters of two
    groups of one of the case's optimizers in one tensor. Builds the model once, only for a case
    with parameter groups."""
    grouped = [spec for spec in case.optimizers if spec.param_groups]
    if not grouped or case.missing_requirements():
        return
    for impl, adapter in impls.items():
        if _unsupported(case, adapter):
            continue  # its cells are skipped: nothing is trained
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(case.seed)
            model = case.build_model()
        try:
            shared = adapter.shared_tensors(model, case.wrap_paths(model), case.features)
        except Exception:  # e.g. a wrap the implementation refuses: the ranks report it as their own failure
            continue
        for spec in grouped:
            for unit, names in shared:
                split = _by_group(spec, names)
                if len(split) > 1:
                    raise PlanError(_message(case_spec, impl, adapter.name, spec, unit, split))


def _unsupported(case: Case, adapter) -> bool:
    from harness.adapters.features import device_available

    return bool(device_available(case.features) or adapter.unsupported(case.features))


def _by_group(spec: OptimizerSpec, names: tuple[str, ...]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in names:
        index = spec.group_index(name)
        label = f"param_groups[{index}]" if index < len(spec.param_groups) else "default group"
        out.setdefault(label, []).append(name)
    return out


def _message(case_spec: str, impl: str, impl_name: str, spec: OptimizerSpec, unit: str,
             split: dict[str, list[str]]) -> str:
    groups = "; ".join(f"{label}: {names[:SHOWN]}" + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
                       for label, names in split.items())
    return (f"case={case_spec} impl={impl}: optimizer {spec.kind}'s param_groups split unit '{unit}' ({groups}), "
            f"but {impl_name} holds a unit's parameters in one flat parameter with one learning rate and weight "
            f"decay; run this case with an implementation that keeps per-parameter tensors (--impls fsdp2), wrap "
            f"so that no unit holds parameters of two groups (a module's weight and bias always share its unit), "
            f"or use a case without that grouping")
