"""Snapshots on disk: one file per (cell, optimizer), written by rank 0, read by the parent.

Format (`FORMAT`), a `torch.save` of plain containers that `torch.load(weights_only=True)`
accepts: dicts, lists, str, int, float, bool, None and tensors; nothing else is ever unpickled.

    {"format": FORMAT, "run_id": the run's id (harness/run/plan.py), "cell": Cell.to_json(),
     "optimizer": "sgd" | "adamw", "world_size": W,
     "layouts": {param name: {"kind": "flat", "unit", "flat_key", "offset", "shard_numel",
                              "aligned_numel", "world_size"} | {"kind": "dim0", "rows", "chunk_rows", "world_size"}
                             | {"kind": "replicated"}},   # right after wrapping; validated: harness/judge/layouts.py
     "padding": {"params": "zero" | "unspecified", "grads": ...},  # the adapter's declared convention
     "init": {"params": {name: tensor}},             # full parameters right after wrapping
     "steps": [{"step": t (1-based),
                "loss": (W,) tensor,                   # each rank's local loss
                "grads": {name: tensor},               # full averaged gradients, before the step
                "params": {name: tensor},              # full parameters, after the step
                "shards": {key: (W, shard_numel)},     # raw local shards (padding included)
                "shard_grads": {key: (W, shard_numel)},
                "padding_intervals": {key: [[[start, end], ...] per rank]},  # shard-local
                "layouts": {...},                      # as above, this step's (resharding changes them)
                "replicas": {"names": [param names, then "<name> (grad)"],
                             "digests": (W, len(names)) int64},  # 52-bit digest per rank
                "shadow": {"loss": (W,) tensor,              # each rank's replayed local loss
                           "grads": {...} float64,           # exact mean of the local terms
                           "abs_grads": {...} float64,       # sum |local term| / W
                           "params": {...}, "state": {name: {state key: tensor}}}}],
     "perturbed": [[{name: tensor} per step] per run]}  # reference cells only

On disk, every dict whose values are tensors of one dtype is packed into
{"__packed_tensors__": True, "names", "sizes", "data": one flat tensor}; load_snapshot unpacks.

The shadow (harness/judge/shadow.py) replays, on rank 0 with the plain model, every rank's local
forward/backward from this cell's own parameters of the previous step: the per-step reference
of the error model (docs/error_model.md). The perturbed runs of a reference cell are its
trajectory envelope.
"""

from __future__ import annotations

import io
import math
import os
import tempfile
from pathlib import Path

import torch

FORMAT = "fsdp-equiv-snapshot/1"
INIT_FORMAT = "fsdp-equiv-init/1"  # {"format", "run_id", "state": {name: tensor}}


def snapshot_path(snapshot_dir: Path, cell_id: str, optimizer: str) -> Path:
    return Path(snapshot_dir) / cell_id / f"{optimizer}.pt"


def complete_path(snapshot_dir: Path, cell_id: str) -> Path:
    """Written by rank 0 once every rank has finished the cell (harness/run/orchestrate.py reads it)."""
    return Path(snapshot_dir) / cell_id / "complete.json"


def write_atomic_bytes(path: Path, write) -> None:
    """Write through a temporary file in the same directory, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_atomic_text(path: Path, text: str) -> None:
    write_atomic_bytes(path, lambda f: f.write(text.encode()))


PACKED = "__packed_tensors__"


def _pack(obj):
    """Every dict whose values are all same-dtype tensors becomes one flat tensor plus names and
    sizes: a few large tensors load much faster than thousands of small ones."""
    if isinstance(obj, dict):
        values = list(obj.values())
        if values and all(isinstance(v, torch.Tensor) for v in values) and len({v.dtype for v in values}) == 1:
            return {PACKED: True, "names": list(obj), "sizes": [list(v.shape) for v in values],
                    "data": torch.cat([v.detach().reshape(-1) for v in values])}
        return {k: _pack(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_pack(v) for v in obj]
    return obj


def _unpack(obj):
    if isinstance(obj, dict):
        if obj.get(PACKED) is True:
            numels = [math.prod(size) for size in obj["sizes"]]
            pieces = torch.split(obj["data"], numels)
            return {n: t.view(size) for n, t, size in zip(obj["names"], pieces, obj["sizes"])}
        return {k: _unpack(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v) for v in obj]
    return obj


def encode(obj) -> bytes:
    """torch.save of plain containers, each dict of same-dtype tensors packed into one tensor (a
    weights_only load of a few tensors is much faster than of hundreds)."""
    buf = io.BytesIO()
    torch.save(_pack(obj), buf)
    return buf.getvalue()


def decode(raw: bytes):
    return _unpack(torch.load(io.BytesIO(raw), weights_only=True))


def save_snapshot(path: Path, snapshot: dict) -> None:
    assert snapshot.get("format") == FORMAT
    packed = _pack(snapshot)
    write_atomic_bytes(path, lambda f: torch.save(packed, f))


def load_snapshot(path: Path) -> dict:
    snapshot = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(snapshot, dict) or snapshot.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} snapshot (format={snapshot.get('format') if isinstance(snapshot, dict) else type(snapshot).__name__})")
    return _unpack(snapshot)


def save_state(path: Path, state: dict[str, torch.Tensor], run_id: str) -> None:
    """The reference initial state of one case, stamped with the run that wrote it."""
    payload = {"format": INIT_FORMAT, "run_id": run_id, "state": {k: v.detach().clone() for k, v in state.items()}}
    write_atomic_bytes(path, lambda f: torch.save(payload, f))


def load_state(path: Path, run_id: str) -> dict[str, torch.Tensor]:
    """The state saved by `save_state` of run `run_id`; ValueError for anything else."""
    payload = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(payload, dict) or payload.get("format") != INIT_FORMAT:
        raise ValueError(f"{path}: not a {INIT_FORMAT} initial state")
    if payload.get("run_id") != run_id:
        raise ValueError(f"{path}: written by run {payload.get('run_id')!r}, not by this run {run_id!r}")
    state = payload.get("state")
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{path}: its state is not a dict of named tensors")
    return state
