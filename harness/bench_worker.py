"""Runs inside every torchrun rank for `python -m harness bench`; rank 0 writes one JSON file.

  speed:  ours vs torch FSDP2 on the same model, data and world size, steps interleaved
          (ours, fsdp2, ours, ...) so machine noise hits both; collective bytes per step counted
          at the c10d ops for both with one dispatch-mode counter.
  memory: a GPT-2-small-shaped model built on meta and materialised per unit; per-rank sharded
          state bytes, activation bytes (tensors saved for backward) and peak RSS growth.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import impl
from cases.models import TransformerConfig, TransformerLM, lm_loss

SPEED_CONFIG = TransformerConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
# GPT-2 small: 124M parameters with the output head tied to the token embedding.
GPT2_SMALL = TransformerConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, tie_weights=True)
SMOKE_CONFIG = TransformerConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=16, tie_weights=True)
COLLECTIVE_OPS = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
                  "allreduce_": "all_reduce"}


class CollectiveBytes(TorchDispatchMode):
    """Bytes of the unsharded side of every all-gather / reduce-scatter (and all-reduce) call."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            kind = COLLECTIVE_OPS.get(func._opname)
            if kind is not None:
                # _allgather_base_(output, input): the output is unsharded;
                # _reduce_scatter_base_(output, input): the input is; allreduce_([tensors]).
                tensor = {"all_gather": args[0], "reduce_scatter": args[1]}.get(kind) if kind != "all_reduce" else args[0][0]
                self.bytes[kind] += tensor.numel() * tensor.element_size()
                self.calls[kind] += 1
        return out


def wrap_ours(model: torch.nn.Module) -> torch.nn.Module:
    for block in model.blocks:
        impl.fully_shard(block)
    return impl.fully_shard(model)


def wrap_fsdp2(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def lm_batch(cfg: TransformerConfig, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def theory_bytes(model: torch.nn.Module) -> dict[str, int]:
    """FULL_SHARD per step: every non-root unit all-gathers twice (forward, backward), the root
    once (it is not resharded after forward); every unit reduce-scatters its gradient once."""
    ag = rs = 0
    for _, unit in impl.units(model):
        for handle in unit.handles:
            nbytes = handle.layout.padded_numel * handle.sharded.element_size()
            ag += nbytes * (1 if unit.is_root else 2)
            rs += nbytes if handle.requires_grad else 0
    return {"all_gather": ag, "reduce_scatter": rs}


def run_speed(args, rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    base = TransformerLM(SMOKE_CONFIG if args.smoke else SPEED_CONFIG)
    models = {"ours": wrap_ours(_clone(base)), "fsdp2": wrap_fsdp2(_clone(base), world_size)}
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    cfg = SMOKE_CONFIG if args.smoke else SPEED_CONFIG
    x, y = lm_batch(cfg, args.batch, cfg.block_size, seed=rank)
    times: dict[str, list[float]] = {k: [] for k in models}
    comm: dict[str, dict] = {}

    def step(name: str) -> None:
        lm_loss(models[name](x), y).backward()
        optims[name].step()
        optims[name].zero_grad()

    for i in range(args.warmup + args.iters):
        for name in models:
            dist.barrier()
            start = time.perf_counter()
            step(name)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    for name in models:  # counted apart: the dispatch mode slows every op
        with CollectiveBytes() as counter:
            step(name)
        comm[name] = {"bytes": dict(counter.bytes), "calls": dict(counter.calls)}
    median = {k: statistics.median(v) for k, v in times.items()}
    # every rank's median; the step is as slow as the slowest rank
    med = torch.tensor([median["ours"], median["fsdp2"]], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    theory = theory_bytes(models["ours"])
    ours_total = sum(comm["ours"]["bytes"].values())
    return {
        "world_size": world_size,
        "model": f"TransformerLM {_describe(cfg)}, batch {args.batch} x {cfg.block_size} tokens per rank",
        "step_time_s": {"ours": med[0].item(), "fsdp2": med[1].item()},
        "step_time_ratio_vs_fsdp2": med[0].item() / med[1].item(),
        "comm": comm,
        "theory_bytes": theory,
        "comm_bytes_ratio_vs_theory": ours_total / sum(theory.values()),
        "comm_bytes_ratio_vs_fsdp2": ours_total / sum(comm["fsdp2"]["bytes"].values()),
        "iters": args.iters,
    }


def run_memory(args, rank: int, world_size: int) -> dict:
    rss_before = _peak_rss_bytes()
    cfg = SMOKE_CONFIG if args.smoke else GPT2_SMALL
    with torch.device("meta"):
        model = TransformerLM(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    wrap_ours(model)
    torch.manual_seed(0)
    impl.init_meta_module(model, "cpu")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if args.global_batch % world_size:
        raise ValueError(f"global_batch={args.global_batch} does not divide by world_size={world_size}")
    seq = min(args.seq, cfg.block_size)
    x, y = lm_batch(cfg, args.global_batch // world_size, seq, seed=rank)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):  # parameters (and views of them) are not activations
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=False)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(nbytes(v) for s in optim.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step")
    largest_unit = max(h.layout.padded_numel * 4 for _, u in impl.units(model) for h in u.handles)
    padded_numel = sum(h.layout.padded_numel for _, u in impl.units(model) for h in u.handles)
    activations = sum(saved.values())
    sharded = params + grads + state
    # ideal peak: sharded state + one unsharded unit and its unsharded gradient + activations
    ideal = sharded + 2 * largest_unit + activations
    peak = _peak_rss_bytes() - rss_before
    return {
        "world_size": world_size,
        "model": f"GPT-2-small-shaped TransformerLM {_describe(cfg)}, global batch {args.global_batch} x {seq} tokens",
        "num_params": num_params,
        "sharded_param_bytes": params,
        "sharded_state_bytes": sharded,
        "total_state_bytes": 16 * num_params,
        "padded_numel": padded_numel,  # every flat parameter, alignment and tail padding included
        "sharded_state_ratio_vs_total_over_w": sharded / (16 * num_params / world_size),
        "largest_unit_bytes": largest_unit,
        "activation_bytes": activations,
        "ideal_peak_bytes": ideal,
        "peak_rss_growth_bytes": peak,
        "peak_ratio_vs_ideal": peak / ideal,
    }


def _clone(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


def _describe(cfg: TransformerConfig) -> str:
    return f"(layers={cfg.n_layer}, d={cfg.n_embd}, heads={cfg.n_head}, vocab={cfg.vocab_size})"


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("speed", "memory", "bare"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="a tiny model: checks that bench runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    modes = {"speed": run_speed, "memory": run_memory, "bare": lambda *_: {"world_size": world_size}}
    result = modes[args.mode](args, rank, world_size)
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, result)
    if rank == 0:
        out = Path(args.out)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"ranks": per_rank}, indent=1))
        os.replace(tmp, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
