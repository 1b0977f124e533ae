"""A user's own case, loaded without editing the package: `--cases my_pkg.mod:make_case` or
`--cases path/to/file.py:make_case`, where the attribute is a `Case` or a zero-argument callable
returning one. The parent and every rank load it the same way (from the same spec string).

`validate_case` runs the case once on the CPU before any rank starts (a model with parameters, a
wrap that names its modules, a batch whose tensors split along dim 0, a scalar finite loss with a
gradient, buffers the forward leaves at their built shapes, optimizers whose groups match
parameters), so a mistake in it is one line naming the fix instead of a traceback in W ranks.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from cases.catalog import Case
from cases.data import call_model, map_tensors


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
    """One forward/backward of the plain model on the case's first global batch, on the CPU, and
    each optimizer built on its parameters: a mistake is one line naming the fix."""
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
        case.wrap_paths(model)
    except Exception as e:
        raise ValueError(f"{where}: wrap: {_one_line(e)}") from None
    inputs, targets = check_batch(case, where)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}

    def forward_loss():
        out = map_tensors(lambda t: t.float() if t.is_floating_point() else t, call_model(model, inputs))
        return case.loss_fn(out, targets)

    try:
        loss = forward_loss()
    except Exception as e:
        raise ValueError(f"{where}: the forward or loss_fn raised {type(e).__name__}: {_one_line(e)}") from None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"{where}: loss_fn must return a floating scalar (a mean over the batch), got {shape}")
    if not math.isfinite(loss.item()):
        raise ValueError(f"{where}: the loss of the first batch is {loss.item()}; the case must start finite")
    if not loss.requires_grad:
        raise ValueError(f"{where}: the loss does not depend on any trainable parameter")
    _check_buffers_keep_their_shape(where, buffers, dict(model.named_buffers()))
    # The judge replays each rank's forward and asks for its loss bit for bit (docs/error_model.md):
    # a forward that draws random numbers (dropout) cannot be replayed. Same model, same buffers,
    # same batch, the random generator moved on: the loss must not change.
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    again = forward_loss().detach()  # with autograd on, as the first: kernels may depend on it
    if not torch.equal(loss.detach().reshape(1).view(torch.uint8), again.reshape(1).view(torch.uint8)):
        raise ValueError(f"{where}: two forward passes of the same model on the same batch gave losses "
                         f"{loss.item()!r} and {again.item()!r}: the forward draws random numbers (dropout?), which "
                         f"no replay reproduces; set every dropout probability to 0 in build_model")
    named = list(model.named_parameters())
    for opt in case.optimizers:
        for i, group in enumerate(opt.param_groups):
            if not any(group.matches(n) for n, _ in named):
                raise ValueError(f"{where}: optimizer {opt.kind} param_groups[{i}] params={list(group.params)} "
                                 f"matches no parameter; names look like {[n for n, _ in named][:3]}")
        try:
            optimizer = opt.build_grouped(((n,), p) for n, p in named)
            scheduler = opt.build_scheduler(optimizer)
        except Exception as e:
            raise ValueError(f"{where}: optimizer {opt.kind}: {type(e).__name__}: {_one_line(e)}") from None
        if scheduler is not None and not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ValueError(f"{where}: optimizer {opt.kind} lr_scheduler returned a {type(scheduler).__name__}, "
                             f"not a torch.optim.lr_scheduler.LRScheduler")


def check_batch(case: Case, where: str) -> tuple:
    """Step 1's (inputs, targets) of `case`, every tensor of them with the global batch along dim 0."""
    try:
        batch = case.make_batch(case.seed, 1, case.global_batch)
    except Exception as e:
        raise ValueError(f"{where}: make_batch(seed, 1, {case.global_batch}) raised {type(e).__name__}: {e}") from None
    if not (isinstance(batch, tuple) and len(batch) == 2):
        raise ValueError(f"{where}: make_batch must return a pair (inputs, targets) of tensors or pytrees of "
                         f"tensors, got {type(batch).__name__}")
    tensors = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ValueError(f"{where}: make_batch returned no tensor; (inputs, targets) must hold the batch's tensors")
    for t in tensors:
        if t.dim() == 0 or t.size(0) != case.global_batch:
            raise ValueError(f"{where}: a batch tensor has shape {tuple(t.shape)}; dim 0 must be the batch "
                             f"(global_batch={case.global_batch}) so that split data can divide it")
    return batch


def _check_buffers_keep_their_shape(where: str, built: dict[str, torch.Tensor],
                                    after: dict[str, torch.Tensor]) -> None:
    """Every rank starts from the buffers of the model as built (the reference initial state) and
    the buffers check compares them by name and shape at every step: a buffer the forward
    registers, replaces with another shape or dtype, or removes (a RoPE table grown to the sequence
    length on first use) has no reference to be judged against."""
    for name in sorted(set(built) | set(after)):
        before, now = built.get(name), after.get(name)
        if before is not None and now is not None and (before.shape, before.dtype) == (now.shape, now.dtype):
            continue
        raise ValueError(f"{where}: the forward changed buffer '{name}' from {_describe(before)} as built to "
                         f"{_describe(now)}; buffers are judged against the model as built, so build it at its "
                         f"full size in __init__ (a RoPE table for the longest sequence, as "
                         f"max_position_embeddings does)")


def _describe(t: torch.Tensor | None) -> str:
    return "absent" if t is None else f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
