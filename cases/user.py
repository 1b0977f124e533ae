"""A user's own case, loaded without editing the package: `--cases my_pkg.mod:make_case` or
`--cases path/to/file.py:make_case`, where the attribute is a `Case` or a zero-argument callable
returning one. The parent and every rank load it the same way (from the same spec string).

`validate_case` runs the case once on the CPU before any rank starts (a model with parameters, a
batch that splits along dim 0, a scalar finite loss with a gradient), so a mistake in it is one
line naming the fix instead of a traceback in W ranks.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from pathlib import Path

import torch

from cases.catalog import Case


def is_case_spec(name: str) -> bool:
    return ":" in name


def load_case(spec: str) -> Case:
    """The Case a 'module:attr' / 'file.py:attr' spec names; ValueError (one line) otherwise."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"case {spec!r}: give 'module.path:attr' or 'path/to/file.py:attr'")
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.is_file():
                raise ValueError(f"case {spec!r}: no file {path}")
            name = "harness_user_case_" + "".join(c if c.isalnum() else "_" for c in str(path))
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ValueError:
        raise
    except Exception as e:  # a syntax error or an exception at import: the user's file, not ours
        raise ValueError(f"case {spec!r}: importing {target!r} raised {type(e).__name__}: {e}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"case {spec!r}: {target!r} has no attribute {attr!r}")
    if not isinstance(obj, Case):
        if not callable(obj):
            raise ValueError(f"case {spec!r}: {attr!r} is a {type(obj).__name__}, not a Case or a function returning one")
        try:
            obj = obj()
        except Exception as e:
            raise ValueError(f"case {spec!r}: {attr}() raised {type(e).__name__}: {e}") from None
        if not isinstance(obj, Case):
            raise ValueError(f"case {spec!r}: {attr}() returned a {type(obj).__name__}, not a cases.catalog.Case")
    return obj


def validate_case(case: Case, spec: str) -> None:
    """One forward/backward of the plain model on the case's first global batch, on the CPU."""
    where = f"case {spec!r} (name={case.name})"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case.seed)
        try:
            model = case.build_model()
        except Exception as e:
            raise ValueError(f"{where}: build_model() raised {type(e).__name__}: {e}") from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{where}: build_model() returned a {type(model).__name__}, not an nn.Module")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"{where}: the model has no trainable parameters; nothing to shard or compare")
    try:
        batch = case.make_batch(case.seed, 1, case.global_batch)
    except Exception as e:
        raise ValueError(f"{where}: make_batch(seed, 1, {case.global_batch}) raised {type(e).__name__}: {e}") from None
    if not (isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise ValueError(f"{where}: make_batch must return (inputs, targets) tensors, got {type(batch).__name__}")
    for what, t in zip(("inputs", "targets"), batch):
        if t.dim() == 0 or t.size(0) != case.global_batch:
            raise ValueError(f"{where}: {what} has shape {tuple(t.shape)}; dim 0 must be the batch "
                             f"(global_batch={case.global_batch}) so that split data can divide it")
    try:
        out = model(batch[0])
        out = out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else out
        loss = case.loss_fn(out, batch[1])
    except Exception as e:
        raise ValueError(f"{where}: the forward or loss_fn raised {type(e).__name__}: {e}") from None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"{where}: loss_fn must return a floating scalar (a mean over the batch), got {shape}")
    if not math.isfinite(loss.item()):
        raise ValueError(f"{where}: the loss of the first batch is {loss.item()}; the case must start finite")
    if not loss.requires_grad:
        raise ValueError(f"{where}: the loss does not depend on any trainable parameter")
