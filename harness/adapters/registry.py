"""`--impls` names to adapters: a built-in name, or a user's 'module:Class' / 'file.py:Class'."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Callable

from harness.adapters.base import NAME_PATTERN, Adapter
from harness.adapters.ddp import DDP
from harness.adapters.deepspeed import DEEPSPEED_VARIANTS
from harness.adapters.fsdp1 import FSDP1_VARIANTS
from harness.adapters.fsdp2 import FSDP2
from harness.adapters.ours import Ours
from harness.adapters.single import Single
from harness.errors import UserError

BUILTIN_IMPLS: dict[str, Callable[[], Adapter]] = {
    "ours": Ours, "fsdp2": FSDP2, **FSDP1_VARIANTS, **DEEPSPEED_VARIANTS, "ddp": DDP, "single": Single,
}


def resolve_impl(spec: str) -> Adapter:
    """A built-in name, or 'module.path:attr' / 'path/to/file.py:attr' naming an Adapter subclass
    (or instance). ValueError, naming the fix, for anything else."""
    if spec in BUILTIN_IMPLS:
        return BUILTIN_IMPLS[spec]()
    if ":" not in spec:
        raise ValueError(
            f"unknown impl {spec!r}; built-in: {sorted(BUILTIN_IMPLS)}, or give 'module:Class' / 'file.py:Class'"
        )
    target, attr = spec.rsplit(":", 1)
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.is_file():
                raise ValueError(f"impl {spec!r}: no file {path}")
            mod_name = "harness_user_impl_" + "".join(c if c.isalnum() else "_" for c in str(path))
            module_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as e:
        raise ValueError(f"impl {spec!r}: cannot import {target!r}: {e}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"impl {spec!r}: {target!r} has no attribute {attr!r}")
    if not (isinstance(obj, Adapter) or (isinstance(obj, type) and issubclass(obj, Adapter))):
        raise ValueError(f"impl {spec!r}: {attr} is not a subclass of harness.adapters.Adapter; subclass it "
                         f"(only `name` and wrap(model, wrap_paths, ctx) are required)")
    adapter = obj() if isinstance(obj, type) else obj
    if type(adapter).wrap is Adapter.wrap:
        raise ValueError(f"impl {spec!r}: {attr} does not implement wrap(model, wrap_paths, ctx)")
    if not isinstance(adapter.name, str) or not NAME_PATTERN.fullmatch(adapter.name):
        raise ValueError(f"impl {spec!r}: {attr}.name={adapter.name!r} must be a non-empty name of letters, digits "
                         f"and '_' (it keys the cells and reports); set the class attribute `name`")
    if adapter.name in BUILTIN_IMPLS:
        raise ValueError(f"impl {spec!r}: {attr}.name={adapter.name!r} is a built-in implementation's name; "
                         f"give your adapter its own name")
    return adapter


def resolve_sharded_impl(spec: str, verb: str, needs: str) -> Adapter:
    """`resolve_impl` for a verb that drives a pool of ranks (fuzz, mutants): UserError, one line,
    for a name that does not resolve and for an adapter without a process group (`needs`: what
    the verb could not do with it)."""
    try:
        adapter = resolve_impl(spec)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not adapter.needs_process_group:
        raise UserError(f"{verb} --impls {spec} runs without a process group: {needs}")
    return adapter
