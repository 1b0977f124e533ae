"""Inside every rank: pin threads, then for each Cell of this launch and each optimizer of its
case build the model from the reference initial state, wrap it through the adapter, train,
and snapshot (rank 0 writes). Run as `python -m torch.distributed.run ... -m harness.worker PLAN`.

The only configuration a rank reads is the launch plan file (the Cells); the environment
variables it reads are torchrun's own (RANK, WORLD_SIZE, MASTER_*).
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from cases.catalog import Case, OptimizerSpec, get_case
from cases.data import Batch, local_batch
from harness.impls import Adapter, RankContext, RawShard, resolve_impl
from harness.plan import Cell
from harness.snapshot import FORMAT, load_state, save_snapshot, snapshot_path


class Shadow:
    """The plain model and optimizer, stepped each step from the cell's own previous parameters
    on the global batch: what the unsharded run would have done from exactly where the cell was.
    See docs/error_model.md."""

    def __init__(self, case: Case, spec: OptimizerSpec, init_state: dict[str, torch.Tensor]) -> None:
        self.case = case
        self.model = case.build_model()
        self.model.load_state_dict(init_state)
        self.params = dict(self.model.named_parameters())
        self.optim = spec.build(self.params.values())

    def step(self, params_before: dict[str, torch.Tensor], batch: Batch) -> dict:
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(params_before[name])
        inputs, targets = batch
        num_samples = inputs.size(0)
        abs_grads = {n: torch.zeros_like(p) for n, p in self.params.items()}
        for b in range(num_samples):  # per-sample gradients: the terms the batch mean sums
            self.model.zero_grad(set_to_none=True)
            self.case.loss_fn(self.model(inputs[b : b + 1]), targets[b : b + 1]).backward()
            for n, p in self.params.items():
                if p.grad is not None:
                    abs_grads[n] += p.grad.abs()
        self.optim.zero_grad(set_to_none=True)
        loss = self.case.loss_fn(self.model(inputs), targets)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in self.params.items() if p.grad is not None}
        self.optim.step()
        return {
            "loss": loss.detach().clone(),
            "grads": grads,
            "abs_grads": {n: a / num_samples for n, a in abs_grads.items()},
            "params": {n: p.detach().clone() for n, p in self.params.items()},
            "state": {
                n: {k: v.detach().clone() for k, v in self.optim.state[p].items() if isinstance(v, torch.Tensor)}
                for n, p in self.params.items()
            },
        }


def _pick(tensors: dict[str, torch.Tensor], names: list[str], what: str, ctx: RankContext, cell: Cell) -> dict:
    missing = [n for n in names if n not in tensors]
    if missing:
        raise RuntimeError(
            f"rank {ctx.rank}: impl={cell.impl} {what} lack parameters {missing[:4]} "
            f"(has {sorted(tensors)[:4]}...); the adapter must use the plain model's names"
        )
    return {n: tensors[n].detach().clone() for n in names}


def _all_gather_rows(t: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """(n,) on every rank -> (W, n) in rank order."""
    t = t.detach().reshape(-1).contiguous()
    if ctx.group is None:
        return t.unsqueeze(0).clone()
    out = t.new_empty(ctx.world_size * t.numel())
    dist.all_gather_into_tensor(out, t, group=ctx.group)
    return out.view(ctx.world_size, -1)


def _gather_step_evidence(loss: torch.Tensor, raws: list[RawShard], ctx: RankContext):
    """Every rank's loss and raw shards (data, grad, padding bounds) in ONE all-gather: with 8
    ranks on 2 cores each collective costs milliseconds, and a step has dozens of shards."""
    parts = [loss.detach().double().reshape(1)]
    for raw in raws:
        parts += [raw.data.double(), torch.tensor(raw.padding_bounds, dtype=torch.float64)]
        if raw.grad is not None:
            parts.append(raw.grad.double())
    rows = _all_gather_rows(torch.cat(parts), ctx)  # (W, n); fp32 values are exact in fp64
    losses = rows[:, 0].to(loss.dtype)
    shards, shard_grads, padding_bounds, at = {}, {}, {}, 1
    for raw in raws:
        n = raw.data.numel()
        shards[raw.key] = rows[:, at : at + n].to(raw.data.dtype)
        padding_bounds[raw.key] = rows[:, at + n : at + n + 2].long().tolist()
        at += n + 2
        if raw.grad is not None:
            shard_grads[raw.key] = rows[:, at : at + n].to(raw.grad.dtype)
            at += n
    return losses, shards, shard_grads, padding_bounds


def run_cell(cell: Cell, spec: OptimizerSpec, init_state: dict[str, torch.Tensor], world: RankContext) -> dict | None:
    case = get_case(cell.case)
    adapter: Adapter = resolve_impl(cell.impl)
    ctx = world if adapter.needs_process_group else RankContext(0, 1, None)
    model = case.build_model()
    model.load_state_dict(init_state)
    names = [n for n, _ in model.named_parameters()]
    wrapped: nn.Module = adapter.wrap(model, case.wrap, ctx, frozenset(cell.faults))
    optim = spec.build(wrapped.parameters())
    is_writer = world.rank == 0
    shadow = Shadow(case, spec, init_state) if is_writer else None

    init_params = _pick(adapter.full_params(wrapped), names, "full_params", ctx, cell)
    steps, params_before = [], init_params
    for step in range(1, cell.steps + 1):
        batch = case.make_batch(case.seed, step, case.global_batch)
        inputs, targets = local_batch(batch, cell.data_mode, ctx.rank, ctx.world_size)
        optim.zero_grad(set_to_none=True)
        loss = case.loss_fn(wrapped(inputs), targets)
        loss.backward()
        grads = _pick(adapter.full_grads(wrapped), names, "full_grads", ctx, cell)
        optim.step()
        params = _pick(adapter.full_params(wrapped), names, "full_params", ctx, cell)
        losses, shards, shard_grads, padding_bounds = _gather_step_evidence(loss, adapter.raw_shards(wrapped), ctx)
        record = {"step": step, "loss": losses, "grads": grads, "params": params, "shards": shards,
                  "shard_grads": shard_grads, "padding_bounds": padding_bounds}
        if shadow is not None:
            record["shadow"] = shadow.step(params_before, batch)
        steps.append(record)
        params_before = params
    if not is_writer:
        return None
    return {
        "format": FORMAT,
        "cell": cell.to_json(),
        "optimizer": spec.kind,
        "world_size": ctx.world_size,
        "layouts": adapter.layouts(wrapped),
        "init": {"params": init_params},
        "steps": steps,
    }


def main(argv: list[str]) -> int:
    faulthandler.enable()
    # On the parent's timeout a hung rank gets SIGUSR1 and dumps every thread's stack to stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    plan = json.loads(Path(argv[1]).read_text())
    torch.set_num_threads(plan["threads"])
    dist.init_process_group("gloo")
    world = RankContext(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
    if world.world_size != plan["world_size"]:
        raise RuntimeError(f"rank {world.rank}: WORLD_SIZE={world.world_size} but the plan is for {plan['world_size']}")
    cells = [Cell.from_json(c) for c in plan["cells"]]
    init_dir, snapshot_dir = Path(plan["init_dir"]), Path(plan["snapshot_dir"])
    for i, cell in enumerate(cells):
        case = get_case(cell.case)
        init_state = load_state(init_dir / f"{case.name}.pt")
        start = time.perf_counter()
        for spec in case.optimizers:
            if not resolve_impl(cell.impl).needs_process_group and world.rank != 0:
                continue  # a single-process cell (the reference) runs on rank 0 alone
            snapshot = run_cell(cell, spec, init_state, world)
            if snapshot is not None:
                save_snapshot(snapshot_path(snapshot_dir, cell.cell_id, spec.kind), snapshot)
        dist.barrier()
        if world.rank == 0:
            print(f"[harness] W={world.world_size} cell {i + 1}/{len(cells)} {cell.cell_id} "
                  f"{time.perf_counter() - start:.2f}s", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
