"""Snapshots on disk: one file per (cell, optimizer), written by rank 0, read by the parent.

Format (`FORMAT`), a `torch.save` of plain containers that `torch.load(weights_only=True)`
accepts: dicts, lists, str, int, float, bool, None and tensors; nothing else is ever unpickled.

    {"format": FORMAT, "run_id": the run's id (harness/run/plan.py), "cell": Cell.to_json(),
     "optimizer": "sgd" | "adamw", "world_size": W,
     "layouts": {param name: {"kind": "flat", "unit", "flat_key", "offset", "shard_numel",
                              "aligned_numel", "world_size"} | {"kind": "dim0", "rows", "chunk_rows", "world_size"}
                             | {"kind": "replicated"}},   # right after wrapping; validated: harness/judge/layouts.py
     "padding": {"params": "zero" | "unspecified", "grads": ...},  # the adapter's declared convention
     "init": {"params": {name: tensor},              # full parameters right after wrapping
              "buffers": {"values": {name: tensor},   # rank 0's module buffers right after wrapping
                          "digests": (W, len(values)) int64}},  # every rank's, 52-bit digest each
     "steps": [{"step": t (1-based),
                "loss": (W,) tensor,                   # each rank's local loss
                "grads": {name: tensor},               # full averaged gradients, before the step
                "params": {name: tensor},              # full parameters, after the step
                "shards": {key: (W, shard_numel)},     # raw local shards (padding included)
                "shard_grads": {key: (W, shard_numel)},
                "padding_intervals": {key: [[[start, end], ...] per rank]},  # shard-local
                "layouts": {...},                      # as above, this step's (resharding changes them)
                "clip_norm": (W,) float64,             # clipping cases: each rank's clip norm (NaN: none)
                "clipped_grads": {name: tensor},       # clipping cases: full gradients after clipping
                "replicas": {"names": [param names, then "<name> (grad)"],
                             "digests": (W, len(names)) int64},  # 52-bit digest per rank
                "buffers": {"values": {...}, "digests": (W, ...)},  # as in init, after the step
                "shadow": {"loss": (W,) tensor,              # each rank's replayed local loss
                           "grads": {...} float64,           # exact mean of the local terms (float32: one term, exact)
                           "abs_grads": {...} float32,       # sum |local term| / W, rounded up
                           "params": {...}, "state": {name: {state key: tensor}},
                           "buffers": {...}}}],                # rank 0's buffers after the replay
     "perturbed": [[{name: tensor} per step] per run]}  # reference cells only

Producers build it through the typed records below (`Snapshot`, `StepRecord`, `Buffers`): the
matrix worker (harness/run/worker.py) from the ranks' evidence, the fuzzer (harness/fuzz/check.py)
from the pool's replies; `Snapshot.to_dict()` is the format above, the one the judge reads.

On disk ([Note: Snapshot encoding]) the containers are one JSON text and the tensors a few flat
tensors, one per dtype; `load_snapshot` rebuilds the containers above.

The shadow (harness/reference/shadow.py) replays, on rank 0 with the plain model, every rank's local
forward/backward from this cell's own parameters of the previous step: the per-step reference
of the error model (docs/error_model.md). The perturbed runs of a reference cell are its
trajectory envelope.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = "fsdp-equiv-snapshot/3"  # /2: [Note: Snapshot encoding]; /3: buffers


@dataclass(frozen=True)
class Buffers:
    """Module buffers of one moment: rank 0's values and every rank's digests (W, len(values))."""

    values: dict[str, torch.Tensor]
    digests: torch.Tensor

    @staticmethod
    def none(world_size: int) -> Buffers:
        """The evidence of a model without buffers."""
        return Buffers({}, torch.zeros(world_size, 0, dtype=torch.long))

    def to_dict(self) -> dict:
        return {"values": self.values, "digests": self.digests}


@dataclass(frozen=True)
class StepRecord:
    """One training step's evidence (the "steps" entries of the format)."""

    step: int
    loss: torch.Tensor  # (W,) each rank's local loss
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    buffers: Buffers
    shadow: dict  # the replay (harness/reference/shadow.py Shadow.step)
    shards: dict[str, torch.Tensor] = field(default_factory=dict)  # raw (W, shard_numel) rows, if any
    shard_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    padding_intervals: dict[str, list] = field(default_factory=dict)
    replicas: dict | None = None  # None: full tensors assembled from one set of shards, no replicas
    layouts: dict | None = None  # this step's, when the implementation reports them per step
    clip_norm: torch.Tensor | None = None  # (W,) float64: each rank's clip norm (NaN: none reported)
    clipped_grads: dict[str, torch.Tensor] | None = None  # the full gradients after clipping, before the step
    # (W, fields of LedgerStep) every rank's collectives of the step, where contracts apply ([Note: Contracts])
    collectives: torch.Tensor | None = None
    # Judged on the ranks: each rank's summary of its raw shards instead of the shards, key -> per
    # rank, and each rank's layouts digest ([Note: Shards judged where they live], harness/judge/shards.py)
    shard_summaries: dict | None = None
    layout_digests: list[str] | None = None

    def to_dict(self) -> dict:
        out = {"step": self.step, "loss": self.loss, "grads": self.grads, "params": self.params,
               "shards": self.shards, "shard_grads": self.shard_grads, "padding_intervals": self.padding_intervals,
               "replicas": self.replicas, "buffers": self.buffers.to_dict(), "shadow": self.shadow}
        if self.layouts is not None:
            out["layouts"] = self.layouts
        if self.clip_norm is not None:
            out["clip_norm"] = self.clip_norm
        if self.clipped_grads is not None:
            out["clipped_grads"] = self.clipped_grads
        if self.collectives is not None:
            out["collectives"] = self.collectives
        if self.shard_summaries is not None:
            out["shard_summaries"] = self.shard_summaries
            out["layout_digests"] = self.layout_digests
        return out


@dataclass(frozen=True)
class Snapshot:
    """One (cell, optimizer)'s evidence; `to_dict()` is the format of this module's docstring."""

    cell: dict  # Cell.to_json()
    optimizer: str
    world_size: int
    layouts: dict
    padding: dict[str, str]  # {"params": Padding value, "grads": ...}
    init_params: dict[str, torch.Tensor]
    init_buffers: Buffers
    steps: list[StepRecord]
    perturbed: list | None = None  # reference cells: the perturbed runs' parameters per step
    run_id: str | None = None
    contracts: tuple[str, ...] = ()  # the contracts the cell is held to ([Note: Contracts])

    def to_dict(self) -> dict:
        out = {"format": FORMAT, "cell": self.cell, "optimizer": self.optimizer, "world_size": self.world_size,
               "layouts": self.layouts, "padding": self.padding,
               "init": {"params": self.init_params, "buffers": self.init_buffers.to_dict()},
               "steps": [rec.to_dict() for rec in self.steps]}
        if self.perturbed is not None:
            out["perturbed"] = self.perturbed
        if self.run_id is not None:
            out["run_id"] = self.run_id
        if self.contracts:
            out["contracts"] = list(self.contracts)
        return out
INIT_FORMAT = "fsdp-equiv-init/1"  # {"format", "run_id", "state": {name: tensor}}


def snapshot_path(snapshot_dir: Path, cell_id: str, optimizer: str) -> Path:
    return Path(snapshot_dir) / cell_id / f"{optimizer}.pt"


# A (cell, optimizer) judged by its own rank 0 ([Note: Judged where the evidence lives] in
# harness/run/judged.py): its result and the few numbers per step the parent still needs, in the
# snapshot encoding, no full tensor of the model.
JUDGED_FORMAT = "fsdp-equiv-judged/1"


def judged_path(snapshot_dir: Path, cell_id: str, optimizer: str) -> Path:
    return Path(snapshot_dir) / cell_id / f"{optimizer}.judged.pt"


def save_judged(path: Path, record: dict) -> None:
    save_snapshot(path, record, JUDGED_FORMAT)


def load_judged(path: Path) -> dict:
    return load_snapshot(path, JUDGED_FORMAT)


def started_path(snapshot_dir: Path, cell_id: str) -> Path:
    """Written by the cell's rank 0 before the cell starts: the launch ranks that run it (cells of
    one world size run side by side in disjoint ranks; harness/run/orchestrate.py names the cell a
    failing rank was running from it)."""
    return Path(snapshot_dir) / cell_id / "started.json"


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


# [Note: Snapshot encoding]
# torch.load(weights_only=True) unpickles in Python, one opcode at a time: a snapshot of nested
# dicts (per-parameter shadow state and hyperparameters, layouts, padding intervals) took about
# half a second to load, most of the judge's reading time. So a snapshot is stored as
#     {"format", "skeleton": JSON text, "data": {dtype name: one flat tensor}}
# where the skeleton is the snapshot with every tensor replaced by {"__tensor__": [dtype name,
# offset, size]} into that dtype's flat tensor. json parses in C, and only a few tensors are
# unpickled. Tuples, dicts with keys that are not strings, torch.Size and torch.dtype have
# markers of their own, so what loads equals what was saved; any other object is refused at save
# (torch.load(weights_only=True) would refuse it at load). Floats round-trip exactly (repr), NaN
# and infinities included.
_TENSOR, _TUPLE, _ITEMS, _SIZE, _DTYPE = "__tensor__", "__tuple__", "__items__", "__size__", "__dtype__"
_MARKERS = frozenset((_TENSOR, _TUPLE, _ITEMS, _SIZE, _DTYPE))


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _skeleton(obj, pieces: dict[str, list[torch.Tensor]], offsets: dict[str, int]):
    """`obj` as JSON-ready containers; every tensor's values appended to `pieces` of its dtype."""
    if isinstance(obj, torch.Tensor):  # the cheapest calls: a snapshot holds hundreds of small tensors
        t = obj.detach() if obj.requires_grad else obj
        if t.device.type != "cpu":
            t = t.cpu()
        name = _dtype_name(t.dtype)
        at = offsets.get(name, 0)
        pieces.setdefault(name, []).append(t.reshape(-1))  # torch.cat copies: a view is enough here
        offsets[name] = at + t.numel()
        return {_TENSOR: [name, at, list(t.shape)]}
    if isinstance(obj, (str, bool, int, float)) or obj is None:
        return obj
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not _MARKERS.intersection(obj):
            return {k: _skeleton(v, pieces, offsets) for k, v in obj.items()}
        return {_ITEMS: [[_skeleton(k, pieces, offsets), _skeleton(v, pieces, offsets)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return [_skeleton(v, pieces, offsets) for v in obj]
    if isinstance(obj, torch.Size):
        return {_SIZE: list(obj)}
    if isinstance(obj, tuple):
        return {_TUPLE: [_skeleton(v, pieces, offsets) for v in obj]}
    if isinstance(obj, torch.dtype):
        return {_DTYPE: _dtype_name(obj)}
    raise TypeError(f"a snapshot holds only containers, numbers, strings and tensors, not {type(obj).__name__}")


def _pack(obj) -> dict:
    pieces: dict[str, list[torch.Tensor]] = {}
    skeleton = json.dumps(_skeleton(obj, pieces, {}), allow_nan=True)
    return {"skeleton": skeleton, "data": {name: torch.cat(ts) for name, ts in pieces.items()}}


def _unpack(packed) -> object:
    if not isinstance(packed, dict) or not isinstance(packed.get("skeleton"), str) or not isinstance(packed.get("data"), dict):
        raise ValueError("not an encoded snapshot (skeleton and data missing)")
    data = packed["data"]

    def hook(d: dict):
        if len(d) != 1:
            return d
        (key, value), = d.items()
        if key == _TENSOR:
            name, at, size = value
            return data[name][at : at + math.prod(size)].view(size)
        if key == _TUPLE:
            return tuple(value)
        if key == _ITEMS:
            return {k: v for k, v in value}
        if key == _SIZE:
            return torch.Size(value)
        if key == _DTYPE:
            return getattr(torch, value)
        return d

    return json.loads(packed["skeleton"], object_hook=hook)


def encode(obj) -> bytes:
    """The bytes of `obj` (containers, numbers, strings, tensors): [Note: Snapshot encoding]."""
    buf = io.BytesIO()
    torch.save(_pack(obj), buf)
    return buf.getvalue()


def decode(raw: bytes):
    return _unpack(torch.load(io.BytesIO(raw), weights_only=True))


def save_snapshot(path: Path, snapshot: dict, fmt: str = FORMAT) -> None:
    """Write `snapshot` (its "format" is `fmt`: a snapshot, or a judged record) in the encoding above."""
    assert snapshot.get("format") == fmt
    packed = {"format": fmt, **_pack(snapshot)}
    write_atomic_bytes(path, lambda f: torch.save(packed, f))


def load_snapshot(path: Path, fmt: str = FORMAT) -> dict:
    packed = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(packed, dict) or packed.get("format") != fmt:
        raise ValueError(f"{path}: not a {fmt} snapshot (format={packed.get('format') if isinstance(packed, dict) else type(packed).__name__})")
    snapshot = _unpack(packed)
    if not isinstance(snapshot, dict) or snapshot.get("format") != fmt:
        raise ValueError(f"{path}: not a {fmt} snapshot (its contents say format="
                         f"{snapshot.get('format') if isinstance(snapshot, dict) else type(snapshot).__name__})")
    return snapshot


def save_state(path: Path, state: dict[str, torch.Tensor], run_id: str,
               buffers: dict[str, torch.Tensor] | None = None) -> None:
    """The reference initial state of one case (its state_dict), and every buffer of the model,
    non-persistent ones included (a state_dict leaves those out), stamped with the run that wrote it."""
    payload = {"format": INIT_FORMAT, "run_id": run_id, "state": {k: v.detach().clone() for k, v in state.items()},
               "buffers": {k: v.detach().clone() for k, v in (buffers or {}).items()}}
    write_atomic_bytes(path, lambda f: torch.save(payload, f))


def build_init(case) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The reference initial state of a case (cases/case.py Case) and every buffer of its model as
    built: `case.build_model()` under the case's seed, the global RNG left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case.seed)
        model = case.build_model()
    return model.state_dict(), dict(model.named_buffers())


def state_digest(state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> str:
    """A digest of an initial state's names, dtypes, shapes and bits (equal digests, equal states)."""
    h = hashlib.blake2b(digest_size=16)
    for part in (state, buffers):
        for name in sorted(part):
            t = part[name]
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(row_major_bytes(t))
    return h.hexdigest()


def load_init(path: Path, run_id: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(state, buffers) saved by `save_state` of run `run_id`, from one read of the file;
    ValueError for anything else."""
    payload = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(payload, dict) or payload.get("format") != INIT_FORMAT:
        raise ValueError(f"{path}: not a {INIT_FORMAT} initial state")
    if payload.get("run_id") != run_id:
        raise ValueError(f"{path}: written by run {payload.get('run_id')!r}, not by this run {run_id!r}")
    parts = []
    for key in ("state", "buffers"):
        part = payload.get(key)
        if not isinstance(part, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in part.items()):
            raise ValueError(f"{path}: its {key} is not a dict of named tensors")
        parts.append(part)
    return parts[0], parts[1]


def row_major_bytes(t: torch.Tensor):
    """A tensor's bytes in row-major order, as a buffer a hash reads: in place where the tensor is
    laid out so (no copy of a model-sized tensor); else a copy in row-major strides (contiguous()
    keeps a one-element tensor's odd stride, which view(torch.uint8) refuses)."""
    flat = t.detach().cpu().reshape(-1)
    if flat.numel() and flat.stride() != (1,):
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def digest(t: torch.Tensor) -> int:
    """A 52-bit digest of a tensor's bytes (exact in float64): equal digests, equal bits."""
    return int.from_bytes(hashlib.blake2b(row_major_bytes(t), digest_size=8).digest(), "little") & ((1 << 52) - 1)
