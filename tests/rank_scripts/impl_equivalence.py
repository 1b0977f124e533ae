"""Run under torchrun: ours vs the plain single-process model, printed as one JSON line per rank.

Every rank also trains the plain model itself on the full batch (it is tiny), so the reference
lives in the same process with the same thread count.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

from cases.models import MLP, TransformerConfig, TransformerLM, lm_loss
from impl import full_state_dict, fully_shard, local_shards, units
from harness.run.rank import rank_epilogue, rank_prologue

STEPS = 5


def build(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP()
    return TransformerLM(TransformerConfig())


def wrap(model: torch.nn.Module) -> torch.nn.Module:
    for sub in model.blocks if hasattr(model, "blocks") else model.layers:
        fully_shard(sub)
    return fully_shard(model)


def batch(kind: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        x = torch.randn(8, 13, generator=g)
        return x, torch.randn(8, 7, generator=g)
    idx = torch.randint(0, 37, (8, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def loss_fn(kind: str, model, x, y):
    out = model(x)
    return torch.nn.functional.mse_loss(out, y) if kind == "mlp" else lm_loss(out, y)


def make_optim(name: str, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def run(kind: str, optim_name: str, split: bool, rank: int, world_size: int) -> dict:
    ref = build(kind)
    ours = wrap(copy.deepcopy(ref))
    opt_ref, opt_ours = make_optim(optim_name, ref.parameters()), make_optim(optim_name, ours.parameters())
    max_param_diff, max_loss_diff, padding_nonzero, max_ratio = 0.0, 0.0, 0, 0.0
    tol: dict[str, float] = {}
    for step in range(STEPS):
        x, y = batch(kind, step)
        xs, ys = (x.chunk(world_size)[rank], y.chunk(world_size)[rank]) if split else (x, y)
        loss_ours = loss_fn(kind, ours, xs, ys)
        loss_ours.backward()
        opt_ours.step()
        opt_ours.zero_grad()
        loss_ref = loss_fn(kind, ref, x, y)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        if not split:
            max_loss_diff = max(max_loss_diff, abs(loss_ours.item() - loss_ref.item()))
        padding_nonzero += sum(int(s.padding.count_nonzero()) for s in local_shards(ours))
        full = full_state_dict(ours)
        ref_sd = ref.state_dict()
        assert full.keys() == ref_sd.keys(), sorted(set(full) ^ set(ref_sd))
        for k in ref_sd:
            diff = (full[k] - ref_sd[k]).abs().max().item()
            max_param_diff = max(max_param_diff, diff)
            tol[k] = tol.get(k, 0.0) + step_tolerance(ref_sd[k], update_of(opt_ref, ref, k))
            max_ratio = max(max_ratio, diff / tol[k])
    return {
        "case": f"{kind}/{optim_name}/{'split' if split else 'identical'}",
        "max_param_diff": max_param_diff,
        "max_loss_diff": max_loss_diff,
        "padding_nonzero": padding_nonzero,
        "max_diff_over_tol": max_ratio,
    }


U = torch.finfo(torch.float32).eps / 2  # unit roundoff of fp32
REDUCTION_TERMS = 16  # summands whose order may differ: batch rows (8) and ranks (<= 8)


def update_of(opt: torch.optim.Optimizer, model: torch.nn.Module, name: str) -> float:
    """max |step direction| of a parameter: SGD's momentum buffer (what lr multiplies)."""
    param = dict(model.named_parameters())[name]
    buf = opt.state[param].get("momentum_buffer")
    return 0.0 if buf is None else buf.abs().max().item()


def step_tolerance(ref: torch.Tensor, max_abs_update: float, lr: float = 0.1) -> float:
    """Error model for SGD+momentum (tests/README.md): a different reduction order changes each
    gradient element by at most (n-1) u sum|terms| (n summands; sum|terms| is bounded here by the
    step direction's max, a first-order model), which lr carries into the parameter; and the
    parameter update itself may round the other way, one ulp of the tensor's largest element.
    The bound adds up over steps."""
    max_abs = ref.abs().max().item()
    ulp = 2 * U * 2.0 ** torch.tensor(max(max_abs, 1e-30)).log2().floor().item()
    return ulp + lr * (REDUCTION_TERMS - 1) * U * max_abs_update


def sharded_state_bytes(rank: int, world_size: int) -> dict:
    ref = build("transformer")
    total_param_numel = sum(p.numel() for p in ref.parameters())
    ours = wrap(copy.deepcopy(ref))
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    x, y = batch("transformer", 0)
    loss_fn("transformer", ours, x, y).backward()
    opt.step()
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    # The storage: each unit's padded shard and shard gradient, which the parameters' pieces and
    # their gradients slice; the optimizer's moments per piece, padding excluded ([Note:
    # Per-parameter shards] in impl/_handle.py).
    handles = [h for _, unit in units(ours) for h in unit.handles]
    params = sum(nbytes(h.sharded) for h in handles)
    grads = sum(nbytes(h.sharded_grad) for h in handles)
    state = sum(nbytes(v) for s in opt.state.values() for k, v in s.items() if k != "step")
    padding_numel = sum(s.layout.padding_numel for s in local_shards(ours))
    ideal = 2 * 4 * (total_param_numel + padding_numel) / world_size  # shard + shard gradient
    ideal += 2 * 4 * total_param_numel / world_size  # 2 Adam moments
    measured = params + grads + state
    # This rank's own share: the padded shards twice, the moments over the shard's parameter elements.
    exact = sum(2 * 4 * h.layout.shard_numel + 2 * 4 * sum(b - a for a, b in h.local_bounds) for h in handles)
    return {"measured_bytes": measured, "exact_bytes": exact, "ideal_bytes": ideal, "ratio": measured / ideal,
            "unsharded_state_bytes": 4 * 4 * total_param_numel, "padding_numel": padding_numel}


def full_gathers(world_size: int) -> dict:
    """full_state_dict and full_grad_dict of a multi-unit model: how many all-gathers each issues,
    and whether their tensors are bitwise those of one all-gather per flat parameter (the
    reference here: each rank's shard gathered on its own, unflattened)."""
    import impl._handle as handle_module
    from impl import full_grad_dict, units
    from impl._flat_param import unflatten_views

    model = wrap(build("transformer"))
    x, y = batch("transformer", 0)
    loss_fn("transformer", model, x, y).backward()
    handles = [(f"{fqn}." if fqn else "", h) for fqn, unit in units(model) for h in unit.handles]
    expected_params, expected_grads = {}, {}
    for prefix, h in handles:
        for local, out in ((h.sharded.detach(), expected_params), (h.sharded_grad, expected_grads)):
            padded = local.new_empty(world_size * local.numel())
            dist.all_gather_into_tensor(padded, local.contiguous())
            for slot, full in zip(h.layout.slots, unflatten_views(padded, h.layout)):
                for fqn in slot.fqns:
                    out[prefix + fqn] = full.clone()
    calls = []
    real = handle_module.all_gather_into
    handle_module.all_gather_into = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        params = full_state_dict(model)
        num_param_gathers = len(calls)
        grads = full_grad_dict(model)
        num_grad_gathers = len(calls) - num_param_gathers
    finally:
        handle_module.all_gather_into = real
    return {"flat_params": len(handles), "param_gathers": num_param_gathers, "grad_gathers": num_grad_gathers,
            "params_bitwise": params.keys() == expected_params.keys()
            and all(torch.equal(params[n], expected_params[n]) for n in params),
            "grads_bitwise": grads.keys() == expected_grads.keys()
            and all(torch.equal(grads[n], expected_grads[n]) for n in grads)}


def main() -> None:
    rank_prologue(threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = []
    for kind in ("mlp", "transformer"):
        for optim_name in ("adamw", "sgd"):
            for split in (False, True):
                results.append(run(kind, optim_name, split, rank, world_size))
    memory = sharded_state_bytes(rank, world_size)
    record = {"rank": rank, "world_size": world_size, "threads": torch.get_num_threads(),
              "results": results, "memory": memory, "gathers": full_gathers(world_size)}
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    rank_epilogue()


if __name__ == "__main__":
    sys.exit(main())
