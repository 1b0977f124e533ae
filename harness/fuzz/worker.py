"""Inside every rank of the fuzzer's persistent pool: serve examples until told to stop.

Run as `python -m harness.run.prefork ... -m harness.fuzz.worker CONFIG` (torchrun's arguments; the
ranks forked from a fork server that imported this module: [Note: Forked ranks]). The config file names
the orchestrator's TCPStore; request i is the key `req/<i>` (a torch.save of the spec as JSON,
the faults and the reference initial state), and every rank answers under `rep/<i>/<rank>` with
its own raw shards per step (no collective is spent on evidence: the orchestrator stacks the
ranks' shards itself). A rank that raises answers with its traceback; the orchestrator then
restarts the pool, since the other ranks may be stuck in a collective.
"""

from __future__ import annotations

import functools
import json
import sys
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from cases.data import local_batch
from harness.fuzz.spec import ModelSpec, as_case
from harness.adapters.base import RankContext
from harness.adapters.ours import Ours
from harness.adapters.registry import resolve_impl
from harness.run import dist_faults, simulated
from harness.run.rank import pick_evidence, pick_grads, rank_epilogue, rank_prologue, replica_digests, train_step
from harness.run.snapshot import decode, encode


def _shards(model) -> tuple[dict, dict]:
    data, grads = {}, {}
    for raw in Ours().raw_shards(model):
        data[raw.key] = raw.data
        if raw.grad is not None:
            grads[raw.key] = raw.grad
    return data, grads


def _layouts(model) -> dict:
    """The adapter's own layout data: per parameter name (offsets in the padded buffer) and, per
    flat parameter, this rank's padding intervals; the orchestrator recomputes none of it."""
    return {"names": Ours().layouts(model),
            "padding_intervals": {raw.key: [list(iv) for iv in raw.padding_intervals]
                                  for raw in Ours().raw_shards(model)}}


def run_example(spec: ModelSpec, faults: frozenset[str], init: dict[str, torch.Tensor], ctx: RankContext) -> dict:
    """Train the spec through impl=ours; this rank's raw shards after init and at every step."""
    case = as_case(spec)
    model = case.build_model()
    model.load_state_dict(init)
    adapter = dist_faults.planted(Ours(), faults)  # collective faults, if any
    wrapped = adapter.wrap(model, case.wrap, replace(ctx, faults=faults))
    optim = adapter.make_optimizer(wrapped, spec.optimizer, case.features)
    init_data, _ = _shards(wrapped)
    losses, step_grads, step_data = [], [], []
    for step in range(1, spec.steps + 1):
        batch = case.make_batch(case.seed, step, case.global_batch)
        inputs, targets = local_batch(batch, spec.data_mode, ctx.rank, ctx.world_size)
        loss, (_, grads), *_ = train_step(adapter, wrapped, optim, case.loss_fn, inputs, targets, spec.accumulation,
                                      case.features, lambda: _shards(wrapped), spec.sync_every_micro)
        data, _ = _shards(wrapped)
        losses.append(loss)
        step_grads.append(grads)
        step_data.append(data)
    return {"layouts": json.dumps(_layouts(wrapped)), "init": init_data, "loss": torch.stack(losses),
            "grads": step_grads, "data": step_data}


def run_adapter_example(spec: ModelSpec, faults: frozenset[str], init: dict[str, torch.Tensor], ctx: RankContext,
                        impl: str) -> dict:
    """Train the spec through any adapter; its full parameters after init and every step, its full
    gradients before every step (the adapter's own collectives: every rank calls them); rank 0's
    tensors, and every rank's digests of its own (replicas must agree bitwise: the replicas check)."""
    adapter = dist_faults.planted(resolve_impl(impl), faults)  # collective faults, if any
    case = as_case(spec)
    model = case.build_model()
    model.load_state_dict(init)
    # The plain model's names, as the matrix worker picks them: a full state dict also names every
    # alias of a tied parameter, which the reference does not.
    names = [n for n, _ in model.named_parameters()]
    grad_names = [n for n, p in model.named_parameters() if p.requires_grad]
    known_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    who = f"rank {ctx.rank}: impl={impl}"
    try:
        wrapped = adapter.wrap(model, case.wrap, replace(ctx, faults=faults))
    except ValueError as e:  # a clear refusal of this model (FSDP2: 0-d parameters), before any collective
        return {"refused": f"{impl}: {e}"}
    optim = adapter.make_optimizer(wrapped, spec.optimizer, case.features)
    init_params = pick_evidence(adapter.full_params(wrapped), names, f"{who} full_params")
    losses, step_grads, step_params, replicas = [], [], [], []
    for step in range(1, spec.steps + 1):
        batch = case.make_batch(case.seed, step, case.global_batch)
        inputs, targets = local_batch(batch, spec.data_mode, ctx.rank, ctx.world_size)
        # An adapter that owns its step (an engine's backward) maps a single micro-batch only
        # (fuzz/main.py `specs_for`), so it never meets sync_every_micro.
        loss, grads, *_ = train_step(adapter, wrapped, optim, case.loss_fn, inputs, targets, spec.accumulation,
                                 case.features,
                                 lambda: pick_grads(adapter.full_grads(wrapped), grad_names, known_names,
                                                    f"{who} full_grads"),
                                 spec.sync_every_micro)
        params = pick_evidence(adapter.full_params(wrapped), names, f"{who} full_params")
        step_grads.append(grads)
        step_params.append(params)
        losses.append(loss)
        replicas.append(replica_digests(params, grads, grad_names))
    if ctx.rank != 0:  # rank 0 carries the full tensors; every rank its loss and digests
        init_params, step_grads, step_params = {}, [{} for _ in step_grads], [{} for _ in step_params]
    return {"full": True, "init": init_params, "loss": torch.stack(losses), "grads": step_grads, "data": step_params,
            "replicas": replicas}



def serve(request: dict, ctx: RankContext, cpu_clock=time.process_time) -> dict:
    """This rank's reply to one request (a traceback under "error" when it raised). `cpu_clock`:
    the rank's CPU time (a process's, gloo's threads included; a simulated rank's own thread's:
    harness/fuzz/simulation_server.py)."""
    try:
        spec = ModelSpec.from_json(request["spec"])
        if spec.world_size != ctx.world_size:
            raise ValueError(f"spec world_size={spec.world_size} but the pool has {ctx.world_size} ranks")
        start, start_cpu = time.perf_counter(), cpu_clock()
        impl = request.get("impl", "ours")
        run = run_example if impl == "ours" else functools.partial(run_adapter_example, impl=impl)
        reply = run(spec, frozenset(request["faults"]), request["init"], ctx)
        reply["rank_s"] = time.perf_counter() - start
        reply["rank_cpu_s"] = cpu_clock() - start_cpu
    except Exception:
        reply = {"error": f"rank {ctx.rank}: " + traceback.format_exc()}
    return reply


def run_simulated(request: dict) -> dict:
    """The reply of a simulated pool's one rank ([Note: Fuzzing on simulated ranks] in
    harness/fuzz/simulated.py): every simulated rank's `serve` reply under "replies", in rank
    order, or the example's error: that of the rank that raised first (the others were only
    stopped at their next collective)."""
    world_size = ModelSpec.from_json(request["spec"]).world_size
    sim = simulated.Simulation(world_size)
    replies: list[dict | None] = [None] * world_size
    stopped = [False] * world_size  # its error came after another rank's had stopped the simulation

    def rank_main(rank: int) -> None:
        ctx = RankContext(rank, world_size, dist.group.WORLD, torch.device("cpu"))
        replies[rank] = reply = serve(request, ctx, time.thread_time)  # a rank's CPU is its thread's
        if "error" in reply:
            stopped[rank] = sim.abort.is_set()
            sim.cancel()  # the others would wait for this rank at their next collective

    try:
        sim.run(rank_main)
    except RuntimeError as e:  # a rank failed outside `serve` (joining its group)
        return {"error": f"simulated W={world_size}: {e}"}
    failed = [r for r in range(world_size) if "error" in replies[r]]
    own = [r for r in failed if not stopped[r]]
    return {"error": "\n".join(replies[r]["error"] for r in (own or failed)[:3])} if failed else {"replies": replies}


def main(argv: list[str]) -> int:
    cfg = json.loads(Path(argv[1]).read_text())
    on_threads = cfg.get("simulated", False)
    # A simulated pool's one rank joins no process group: each example's simulated ranks join theirs.
    ctx = rank_prologue(cfg["threads"], None if on_threads else "gloo", collective_timeout_s=cfg["collective_timeout_s"])
    store = dist.TCPStore(cfg["host"], cfg["port"], is_master=False,
                          timeout=timedelta(seconds=cfg["idle_timeout_s"]))
    store.set(f"ready/{ctx.rank}", "1")
    i = 0
    while True:
        request = decode(store.get(f"req/{i}"))
        if request.get("stop"):
            break
        reply = run_simulated(request) if on_threads else serve(request, ctx)
        store.set(f"rep/{i}/{ctx.rank}", encode(reply))
        if "error" in reply:
            break  # the pool is restarted: other ranks may be stuck in a collective
        i += 1
    rank_epilogue()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
