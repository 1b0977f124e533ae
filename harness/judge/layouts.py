"""An adapter's layouts, checked against its own raw shards before anything is judged by them.

[Note: Layout validation]
`layouts` say where each parameter's elements live: a "flat" layout puts parameter `name` at
[offset, offset + numel) of a padded flat buffer that is the raw shards of `world_size` ranks
concatenated in rank order (`shard_numel` elements each; with more ranks than `world_size`, as in
HSDP or NO_SHARD, every block of `world_size` consecutive ranks holds a replica). The judge names
owning ranks from them and the padding check trusts the padding intervals next to them, so a wrong
layout would name the wrong rank or let a parameter element pass as padding. Hence, at every step,
with that step's layouts (a resharding checkpoint changes them mid-run):
- the slice a flat layout names, in the first replica block, must equal the full parameter
  bitwise (the parameters after the step and the raw shards after the step are the same state;
  the replicas check compares the other replicas);
- no padding interval of any rank may cover an element a layout assigns to a parameter;
- "dim0" layouts must describe the parameter's rows; unknown kinds or names are refused.
A structural violation (a name, kind, size or padding interval that cannot be right) raises
LayoutError naming the parameter: the cell is an `error`, never judged. A structurally valid layout
whose slice differs from the full parameter is returned as a `GatheredMismatch` instead: the
implementation's gathered parameters and its own raw shards disagree, a self-inconsistent state the
cell fails for (a `replicas` violation naming the element, both values and the owning rank); only
the adapter could also have misplaced it in layouts(), and the message says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Callable

import torch


class LayoutError(ValueError):
    """An adapter's layouts contradict its raw shards or the model (the cell is an error)."""


@dataclass(frozen=True)
class GatheredMismatch:
    """A full parameter whose bits differ from the raw shards a valid flat layout names: at `step`,
    the first differing element `index` holds `full` gathered and `shard` in rank `rank`'s shard;
    `count` elements differ."""

    step: int
    name: str
    index: int
    full: float
    shard: float
    rank: int
    count: int


KINDS = ("flat", "dim0", "replicated")


def assemble_flat(layout: dict, rows: torch.Tensor, size: torch.Size) -> torch.Tensor:
    """The parameter a flat layout names, read from `rows` (num_ranks, shard_numel) of the first
    replica block (ranks 0 ... world_size - 1)."""
    flat = rows[: int(layout["world_size"])].reshape(-1)
    offset = int(layout["offset"])
    return flat[offset : offset + size.numel()].view(size)


def parameter_names(model) -> tuple[dict[str, torch.Size], dict[str, str]]:
    """(size of every parameter name, tied names included; tied name -> the name evidence uses)."""
    sizes, aliases, first = {}, {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        sizes[name] = p.shape
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return sizes, aliases


def first_bit_difference(actual: torch.Tensor, expected: torch.Tensor) -> int | None:
    """The first element whose bits differ (None: bitwise equal; a NaN equals the same NaN, -0.0
    differs from 0.0); a shape or dtype mismatch is element 0. 0-d tensors included."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return 0
    a = actual.detach().contiguous().reshape(-1)
    e = expected.detach().contiguous().reshape(-1)
    if a.numel() == 0:
        return None
    width = a.element_size()
    differs = (a.view(torch.uint8).view(-1, width) != e.view(torch.uint8).view(-1, width)).any(dim=1)
    return int(differs.nonzero()[0].item()) if bool(differs.any()) else None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return first_bit_difference(a, b) is None


def _describe(name: str, layout: dict) -> str:
    keys = ("flat_key", "offset", "shard_numel", "world_size") if layout.get("kind") == "flat" else tuple(layout)
    return f"layout of '{name}' (" + ", ".join(f"{k}={layout.get(k)!r}" for k in keys) + ")"


def check_layouts(snap: dict, sizes: dict[str, torch.Size], aliases: dict[str, str] | None = None,
                  unchecked: Callable[[dict], bool] | None = None) -> list[GatheredMismatch]:
    """Raise LayoutError unless every layout of the snapshot is structurally valid at every step
    (names, kinds, sizes, padding intervals); return where a valid flat layout's slice of the raw
    shards differs from the full parameter ([Note: Layout validation]). `sizes` include tied names;
    `aliases` maps each tied name to the name its evidence is recorded under. A step for which
    `unchecked(rec)` holds is not checked (it breaks a contract: [Note: Contracts])."""
    num_ranks = int(snap["world_size"])
    _check_names(snap.get("layouts"), sizes, num_ranks)
    mismatches: list[GatheredMismatch] = []
    for rec in snap["steps"]:
        if unchecked is None or not unchecked(rec):
            mismatches += check_step_layouts(rec, snap["layouts"], sizes, num_ranks, aliases)
    return mismatches


def check_step_layouts(rec: dict, layouts: dict, sizes: dict[str, torch.Size], num_ranks: int,
                       aliases: dict[str, str] | None = None) -> list[GatheredMismatch]:
    """`check_layouts` of one step's record; `layouts` the snapshot's, used where the step records
    none of its own (a resharding case changes them mid-run)."""
    layouts = rec.get("layouts", layouts)
    _check_names(layouts, sizes, num_ranks, rec["step"])
    return _check_step(rec, layouts, sizes, num_ranks, aliases or {})


def _check_names(layouts, sizes: dict[str, torch.Size], num_ranks: int, step: int = 0) -> None:
    if not isinstance(layouts, dict):
        raise LayoutError(f"step {step}: layouts is {type(layouts).__name__}, not a dict of parameter layouts")
    for name, layout in layouts.items():
        if name not in sizes:
            raise LayoutError(f"layouts name '{name}', which is not a parameter of the model")
        kind = layout.get("kind") if isinstance(layout, dict) else None
        if kind not in KINDS:
            raise LayoutError(f"layout of '{name}' has kind={kind!r}; known kinds: {list(KINDS)}")
        if kind == "dim0":
            rows = sizes[name][0] if len(sizes[name]) else 1
            if layout["rows"] != rows or layout["chunk_rows"] * layout["world_size"] < rows:
                raise LayoutError(f"{_describe(name, layout)} does not cover the parameter's {rows} rows")
        if kind == "flat":
            group = int(layout["world_size"])
            if group < 1 or num_ranks % group:
                raise LayoutError(f"{_describe(name, layout)}: world_size does not divide the {num_ranks} ranks")


def _check_step(rec: dict, layouts: dict, sizes: dict[str, torch.Size], num_ranks: int,
                aliases: dict[str, str]) -> list[GatheredMismatch]:
    step = rec["step"]
    mismatches: list[GatheredMismatch] = []
    claimed: dict[str, list[tuple[int, int, str]]] = {}  # flat key -> [start, end) of each parameter
    for name, layout in layouts.items():
        if layout["kind"] != "flat":
            continue
        key = layout["flat_key"]
        rows = rec["shards"].get(key)
        if rows is None and not rec["shards"]:
            raise LayoutError(f"step {step}: {_describe(name, layout)} is a flat layout, but the adapter gives no "
                              f"raw_shards() to check it against; give raw_shards() with it, or a 'dim0' or "
                              f"'replicated' layout ([Note: Adapter protocol])")
        if rows is None:
            raise LayoutError(f"step {step}: {_describe(name, layout)} names no raw shard; the shards are "
                              f"{sorted(rec['shards'])[:4]}")
        if rows.shape[1] != layout["shard_numel"]:
            raise LayoutError(f"step {step}: {_describe(name, layout)} but the raw shards hold {rows.shape[1]} "
                              f"elements per rank")
        offset, numel, group = int(layout["offset"]), sizes[name].numel(), int(layout["world_size"])
        if offset < 0 or offset + numel > group * rows.shape[1]:
            raise LayoutError(f"step {step}: {_describe(name, layout)} reaches past the padded buffer of "
                              f"{group * rows.shape[1]} elements (numel={numel})")
        # Rank 0's full parameters are gathered from the first replica block; whether the other
        # replicas agree is the replicas check's question, not the layout's.
        full = rec["params"][aliases.get(name, name)]
        piece = assemble_flat(layout, rows, sizes[name])
        if full.shape != sizes[name]:
            raise LayoutError(f"step {step}: the full parameter '{name}' has shape {tuple(full.shape)}, the model's "
                              f"is {tuple(sizes[name])}")
        if not same_bits(piece, full.to(piece.dtype)):
            a, b = piece.reshape(-1), full.reshape(-1).to(piece.dtype)
            a_bits, b_bits = (t.contiguous().view(torch.uint8).view(-1, t.element_size()) for t in (a, b))
            bad = (a_bits != b_bits).any(dim=1).nonzero()
            at = int(bad[0].item())
            mismatches.append(GatheredMismatch(step, name, at, b[at].item(), a[at].item(),
                                               (offset + at) // rows.shape[1], int(bad.numel())))
        claimed.setdefault(key, []).append((offset, offset + numel, name))
    for key, ranges in claimed.items():
        intervals = rec["padding_intervals"].get(key, [])
        shard_numel = rec["shards"][key].shape[1]
        group = int(layouts[ranges[0][2]]["world_size"])
        for rank, runs in enumerate(intervals):
            base = (rank % group) * shard_numel
            for start, end in runs:
                for lo, hi, name in ranges:
                    if base + start < hi and lo < base + end:
                        raise LayoutError(
                            f"step {step}: rank {rank}'s padding interval [{start}, {end}) of '{key}' covers "
                            f"elements of '{name}' (padded-buffer range [{lo}, {hi})); fix the adapter's "
                            f"layouts() or raw_shards() padding_intervals")
    return mismatches
