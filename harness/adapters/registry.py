"""`--impls` names to adapters: a built-in name, or a user's 'module:Class' / 'file.py:Class'."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from harness.adapters.base import Adapter
from harness.adapters.ddp import DDP
from harness.adapters.fsdp2 import FSDP2
from harness.adapters.ours import Ours
from harness.adapters.single import Single

BUILTIN_IMPLS: dict[str, type] = {"ours": Ours, "fsdp2": FSDP2, "ddp": DDP, "single": Single}


def resolve_impl(spec: str) -> Adapter:
    """A built-in name, or 'module.path:attr' / 'path/to/file.py:attr' naming an Adapter."""
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
    adapter = obj() if isinstance(obj, type) else obj
    if not isinstance(adapter, Adapter):
        missing = [m for m in ("name", "needs_process_group", "wrap", "full_params", "full_grads", "layouts",
                               "raw_shards") if not hasattr(adapter, m)]
        raise ValueError(f"impl {spec!r} does not satisfy harness.adapters.Adapter; missing {missing}")
    return adapter
