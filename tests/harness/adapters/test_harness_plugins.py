"""Adapters that plant failures the fault seam of impl/ does not have, loaded by the harness as
user implementations (`--impls tests/harness/adapters/test_harness_plugins.py:NAME`), which also exercises the
user-registration path. They run inside the ranks, so they are plain classes, not fixtures."""

from __future__ import annotations

import atexit
import os
import time

import torch
import torch.distributed as dist

from harness.adapters import Adapter, Ours

CORRUPT_RANK = 1
CORRUPT_PATH_INDEX = 0  # the first wrapped sub-module of the case
CORRUPT_INDEX = 5  # element of that module's first parameter
CORRUPT_DELTA = 0.05


class CorruptGatheredElement(Ours):
    """ours, except that after every all-gather of the first wrapped unit, rank CORRUPT_RANK adds
    CORRUPT_DELTA to one element of its gathered (unsharded) copy; the shards stay intact."""

    name = "corrupt_gathered_element"

    def wrap(self, model, wrap_paths, ctx):
        sub = model.get_submodule(wrap_paths[CORRUPT_PATH_INDEX])
        param_name = next(n for n, _ in sub.named_parameters())
        owner_path, _, attr = param_name.rpartition(".")
        wrapped = super().wrap(model, wrap_paths, ctx)
        if ctx.world_size > 1 and ctx.rank == CORRUPT_RANK:

            def corrupt(module, args):
                # Runs after the unit's own pre-forward hook: `attr` is a view of the gathered buffer.
                view = getattr(module.get_submodule(owner_path) if owner_path else module, attr)
                view.data.view(-1)[CORRUPT_INDEX] += CORRUPT_DELTA  # storage only, not autograd

            sub.register_forward_pre_hook(corrupt)
        return wrapped


class RaiseOnRank1(Ours):
    name = "raise_on_rank1"

    def wrap(self, model, wrap_paths, ctx):
        if ctx.rank == 1:
            raise RuntimeError("planted failure: rank 1 raises while wrapping")
        return super().wrap(model, wrap_paths, ctx)


class RaiseAtWorldSize1(Ours):
    """Raises while wrapping at W = 1 only: cells of one world size run side by side, so another
    cell is running in other ranks when it does (tests/harness/run/test_concurrent_cells.py)."""

    name = "raise_at_w1"

    def wrap(self, model, wrap_paths, ctx):
        if ctx.world_size == 1:
            raise RuntimeError("planted failure: raises while wrapping at W = 1")
        return super().wrap(model, wrap_paths, ctx)


class HangOnRank1(Ours):
    name = "hang_on_rank1"

    def wrap(self, model, wrap_paths, ctx):
        if ctx.rank == 1:
            dist.recv(torch.zeros(1), src=0, group=ctx.group)  # never sent: blocks forever
        return super().wrap(model, wrap_paths, ctx)


class HangOnRank1AtWorldSize2(Ours):
    """HangOnRank1 at W = 2 only: a run of several world sizes must still run the others."""

    name = "hang_on_rank1_at_w2"

    def wrap(self, model, wrap_paths, ctx):
        if ctx.rank == 1 and ctx.world_size == 2:
            dist.recv(torch.zeros(1), src=0, group=ctx.group)  # never sent: blocks forever
        return super().wrap(model, wrap_paths, ctx)


# Failures after the last snapshot: every cell's evidence is on disk, yet the launch did not end
# cleanly, so no cell of it may pass (harness/run/orchestrate.py).

class RaiseInDestroyOnRank1(Ours):
    name = "raise_in_destroy_on_rank1"

    def wrap(self, model, wrap_paths, ctx):
        if ctx.rank == 1:
            def destroy_process_group(*args, **kwargs):
                raise RuntimeError("planted failure: rank 1 raises in destroy_process_group")

            dist.destroy_process_group = destroy_process_group  # what the worker calls after its last cell
        return super().wrap(model, wrap_paths, ctx)


class ExitNonZeroAtExitOnRank1(Ours):
    name = "exit_non_zero_at_exit_on_rank1"

    def wrap(self, model, wrap_paths, ctx):
        if ctx.rank == 1:
            atexit.register(os._exit, 3)  # after main() returned 0: no traceback, only the exit status
        return super().wrap(model, wrap_paths, ctx)


def _hang_at_exit() -> None:
    time.sleep(10**6)


class HangAtExitOnRank1(Ours):
    name = "hang_at_exit_on_rank1"

    def wrap(self, model, wrap_paths, ctx):
        if ctx.rank == 1:
            atexit.register(_hang_at_exit)
        return super().wrap(model, wrap_paths, ctx)



class DriftOneUlpPerStep(Ours):
    """ours, except that every optimizer step also moves every non-zero parameter element one ulp,
    each element always the same way (up or down by a coin drawn once per element). That stays
    within each step's tolerance (two ulps of the final rounding), the signs of a step's
    differences are fair coins (the bias check sees no tilt), and the next step starts from the
    drifted parameters, so only the trajectory check can see it."""

    name = "drift_one_ulp_per_step"

    def make_optimizer(self, model, spec, features):
        optim = super().make_optimizer(model, spec, features)
        directions: dict[int, torch.Tensor] = {}  # per local parameter: +inf or -inf per element
        coins = torch.Generator().manual_seed(1000 + (dist.get_rank() if dist.is_initialized() else 0))

        def nudge(opt, args, kwargs):
            with torch.no_grad():
                for group in opt.param_groups:
                    for p in group["params"]:
                        if id(p) not in directions:
                            heads = torch.rand(p.shape, generator=coins) < 0.5
                            directions[id(p)] = torch.where(heads, float("inf"), float("-inf")).to(p.dtype)
                        moved = torch.nextafter(p, directions[id(p)])
                        p.copy_(torch.where(p != 0, moved, p))  # padding stays zero

        optim.register_step_post_hook(nudge)
        return optim


class ScaleStepOnLastRank(Ours):
    """ours, except that the last rank scales its local gradient shards by (1 + 3e-7) inside the
    optimizer step, after the gradients were taken as evidence: only the parameters carry it, and
    each moves by 3e-7 of its update, a fraction of an ulp, so every per-element bound holds. Its
    differences from the replayed step all point along the update: the bias check's update counts
    see it."""

    name = "scale_step_on_last_rank"

    def optimizer_step(self, model, optim, features):
        if dist.get_rank() == dist.get_world_size() - 1:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1 + 3e-7)
        return super().optimizer_step(model, optim, features)


class _PassThrough(torch.autograd.Function):
    """An identity on a module input, as FSDP2 and DeepSpeed put on theirs: the input's gradient
    contributions from inside the module are summed before they join the others (a reordering).
    `scale` != 1 multiplies the module's contribution instead: not a reordering."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.scale == 1 else grad * ctx.scale), None


class _InputsThroughIdentity(Ours):
    scale = 1.0

    def wrap(self, model, wrap_paths, ctx):
        wrapped = super().wrap(model, wrap_paths, ctx)
        for path in wrap_paths:
            def through(module, args, kwargs):
                def one(x):
                    return _PassThrough.apply(x, self.scale) if isinstance(x, torch.Tensor) and x.requires_grad else x
                return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}

            model.get_submodule(path).register_forward_pre_hook(through, with_kwargs=True)
        return wrapped


class IdentityOnUnitInputs(_InputsThroughIdentity):
    """ours with an identity autograd function on every wrapped unit's tensor inputs: an honest
    reordering of the backward's accumulation ([Note: Reordered accumulation])."""

    name = "identity_on_unit_inputs"


class DoubleUnitInputGradient(_InputsThroughIdentity):
    """The same identity, whose backward doubles the units' contribution to their inputs' gradient:
    one contribution counted twice, not a reordering; must fail."""

    name = "double_unit_input_gradient"
    scale = 2.0


def test_plugins_satisfy_the_adapter_protocol():
    for cls in (CorruptGatheredElement, RaiseOnRank1, HangOnRank1, RaiseInDestroyOnRank1, ExitNonZeroAtExitOnRank1,
                HangAtExitOnRank1, DriftOneUlpPerStep, ScaleStepOnLastRank, IdentityOnUnitInputs,
                DoubleUnitInputGradient):
        assert isinstance(cls(), Adapter), cls


class OursProcessPerWorld(Ours):
    """ours, declared to keep process-wide state (as DeepSpeed does): its cells run in a launch per
    world size, and each rank checks that it never ran a cell of another world size before."""

    name = "ours_process_per_world"
    process_per_world = True
    _worlds: set[int] = set()

    def wrap(self, model, wrap_paths, ctx):
        seen = OursProcessPerWorld._worlds
        if seen - {ctx.world_size}:
            raise RuntimeError(f"rank {ctx.rank}: W={ctx.world_size} in a process that ran W={sorted(seen)}")
        seen.add(ctx.world_size)
        return super().wrap(model, wrap_paths, ctx)
