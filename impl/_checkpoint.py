"""Sharded checkpoints: one file per rank plus metadata, loadable at any world size.

Layout of a checkpoint directory:
  metadata.json   {"world_size": W, "flat_params": {name: {"slots": [[fqns, size, offset], ...],
                   "aligned_numel": n}}, "optimizer": {...}}
  rank{r}.pt      {flat_param_name: local shard (padding included),
                   "optim/<flat_param_name>/<state key>": that shard of the optimizer state, its
                       parameters' pieces laid out as in the shard (zeros where a piece has none),
                   "optim_slots/<flat_param_name>": per parameter, whether it has optimizer state,
                   "optim_scalars/<flat_param_name>/<slot>/<key>": its scalars such as Adam's step}
The optimizer state is per parameter ([Note: Per-parameter shards] in _handle.py): a parameter
that never had a gradient has none, and its step count may differ from its neighbours'.
Files are written to a temporary name and renamed, and loaded with weights_only=True.
Resharding concatenates the old shards, drops the old uniform tail padding and slices with the new
layout: offsets and alignment padding do not depend on W ([Note: Alignment] in _flat_param.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from impl._flat_param import FlatLayout
from impl._unit import units_with_prefixes


def _flat_params(model: nn.Module):
    """(name, handle) of every flat parameter, in model.parameters() order."""
    out = []
    for unit, prefixes in units_with_prefixes(model):
        prefix = next((p for p in prefixes if p is not None), "")  # a group's first member's
        for handle in unit.handles:
            out.append((prefix + handle.param_name, handle))
    return out


def _describe(layout: FlatLayout) -> dict:
    return {"slots": [[list(s.fqns), list(s.size), s.offset] for s in layout.slots],
            "aligned_numel": layout.aligned_numel}


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_sharded_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Every rank writes its own shards; rank 0 writes the metadata. A collective (barrier)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flats = _flat_params(model)
    if not flats:
        raise ValueError("save_sharded_checkpoint: model has no fully_shard units")
    rank, world_size = flats[0][1].comm.groups.shard_rank, flats[0][1].comm.groups.shard_world_size
    payload: dict[str, torch.Tensor] = {}
    for name, handle in flats:
        payload[name] = handle.sharded.detach().clone()
        if optimizer is not None:
            payload.update(_optimizer_payload(name, handle, optimizer))
    # Under HSDP every replica holds the same shards: the first replica writes them.
    replicate_group = flats[0][1].comm.groups.replicate_group
    is_writer = replicate_group is None or dist.get_rank(replicate_group) == 0
    if is_writer:
        _atomic_save(payload, path / f"rank{rank}.pt")
    if rank == 0 and is_writer:
        meta = {"world_size": world_size, "flat_params": {n: _describe(h.layout) for n, h in flats}}
        tmp = path / "metadata.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, path / "metadata.json")
    if dist.is_initialized():
        dist.barrier()


def load_sharded_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Load a checkpoint saved at any world size into `model` (and `optimizer`) at this one."""
    path = Path(path)
    meta = json.loads((path / "metadata.json").read_text())
    flats = _flat_params(model)
    _check_compatible(meta, flats, path)
    old_world_size = meta["world_size"]
    shards = [torch.load(path / f"rank{r}.pt", weights_only=True) for r in range(old_world_size)]
    for name, handle in flats:
        aligned_numel = meta["flat_params"][name]["aligned_numel"]
        full = torch.cat([s[name] for s in shards])[:aligned_numel]
        with torch.no_grad():
            handle.sharded.copy_(_reshard(full, handle))
        handle.reshard()
        if optimizer is None or f"optim_slots/{name}" not in shards[0]:
            continue
        keys = {k.split("/", 2)[2] for k in shards[0] if k.startswith(f"optim/{name}/")}
        flat_state = {key: _reshard(torch.cat([s[f"optim/{name}/{key}"] for s in shards])[:aligned_numel], handle)
                      for key in keys}
        has_state = shards[0][f"optim_slots/{name}"].tolist()
        for i, (piece, (a, b)) in enumerate(zip(handle.pieces, handle.local_bounds)):
            if not has_state[i]:
                optimizer.state.pop(piece, None)
                continue
            state = {key: flat[a:b].clone() for key, flat in flat_state.items()}
            scalars = f"optim_scalars/{name}/{i}/"
            state.update({k[len(scalars):]: v.clone() for k, v in shards[0].items() if k.startswith(scalars)})
            optimizer.state[piece] = state


def _optimizer_payload(name: str, handle, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's optimizer state of one flat parameter's pieces: each elementwise state as one
    shard-shaped tensor, each scalar per slot, and which slots have state at all."""
    states = [optimizer.state.get(piece, {}) for piece in handle.pieces]
    out = {f"optim_slots/{name}": torch.tensor([bool(s) for s in states])}
    for i, (piece, state) in enumerate(zip(handle.pieces, states)):
        a, b = handle.local_bounds[i]
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == piece.shape:
                flat = out.setdefault(f"optim/{name}/{key}",
                                      torch.zeros(handle.layout.shard_numel, dtype=value.dtype, device=value.device))
                flat[a:b] = value.detach()
            else:
                out[f"optim_scalars/{name}/{i}/{key}"] = torch.as_tensor(value).clone()
    return out


def _reshard(full_aligned: torch.Tensor, handle) -> torch.Tensor:
    layout = handle.layout
    padded = torch.zeros(layout.padded_numel, dtype=full_aligned.dtype)
    padded[: layout.aligned_numel] = full_aligned
    start, end = layout.shard_bounds(handle.comm.groups.shard_rank)
    return padded[start:end].clone().to(handle.sharded.device)


def _check_compatible(meta: dict, flats, path: Path) -> None:
    saved = meta["flat_params"]
    ours = {name: _describe(h.layout) for name, h in flats}
    missing = sorted(set(ours) - set(saved))
    unexpected = sorted(set(saved) - set(ours))
    mismatched = [
        f"{name}: checkpoint {saved[name]['slots']} vs model {ours[name]['slots']}"
        for name in sorted(set(ours) & set(saved))
        if saved[name] != ours[name]
    ]
    if missing or unexpected or mismatched:
        raise ValueError(
            f"checkpoint {path} does not match the model: missing in checkpoint {missing}, "
            f"not in model {unexpected}, different names, shapes or offsets {mismatched}. Fix: load it "
            f"into the same model with the same wrapping (any world size works)."
        )
