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

from harness.judge.shards import GRAD_SUFFIX, first_bit_difference_count, row_differing


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
    found = first_bit_difference_count(actual.detach().reshape(-1), expected.detach().reshape(-1))
    return None if found is None else found[0]


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
    shards = _Shards(rec)
    mismatches: list[GatheredMismatch] = []
    claimed: dict[str, list[tuple[int, int, str]]] = {}  # flat key -> [start, end) of each parameter
    for name, layout in layouts.items():
        if layout["kind"] != "flat":
            continue
        key = layout["flat_key"]
        shard_numel = shards.numel(key)
        if shard_numel is None and not shards.keys:
            raise LayoutError(f"step {step}: {_describe(name, layout)} is a flat layout, but the adapter gives no "
                              f"raw_shards() to check it against; give raw_shards() with it, or a 'dim0' or "
                              f"'replicated' layout ([Note: Adapter protocol])")
        if shard_numel is None:
            raise LayoutError(f"step {step}: {_describe(name, layout)} names no raw shard; the shards are "
                              f"{sorted(shards.keys)[:4]}")
        if shard_numel != layout["shard_numel"]:
            raise LayoutError(f"step {step}: {_describe(name, layout)} but the raw shards hold {shard_numel} "
                              f"elements per rank")
        offset, numel, group = int(layout["offset"]), sizes[name].numel(), int(layout["world_size"])
        if offset < 0 or offset + numel > group * shard_numel:
            raise LayoutError(f"step {step}: {_describe(name, layout)} reaches past the padded buffer of "
                              f"{group * shard_numel} elements (numel={numel})")
        # Rank 0's full parameters are gathered from the first replica block; whether the other
        # replicas agree is the replicas check's question, not the layout's.
        full = rec["params"][aliases.get(name, name)]
        if full.shape != sizes[name]:
            raise LayoutError(f"step {step}: the full parameter '{name}' has shape {tuple(full.shape)}, the model's "
                              f"is {tuple(sizes[name])}")
        # Each rank's part of the slice, judged where the shard is ([Note: Shards judged where they
        # live]): the lowest rank's first differing element is the slice's first; counts add up.
        found = [d for d in shards.differing(key, name, offset, group, full) if d is not None]
        if found:
            first = found[0]
            mismatches.append(GatheredMismatch(step, name, first.index, first.full, first.shard,
                                               (offset + first.index) // shard_numel, sum(d.count for d in found)))
        claimed.setdefault(key, []).append((offset, offset + numel, name))
    for key, ranges in claimed.items():
        intervals = rec["padding_intervals"].get(key, [])
        shard_numel = shards.numel(key)
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


class _Shards:
    """A step's raw shards of parameter data as the layout check reads them: each rank's summary
    where the ranks summarised them (rec["shard_summaries"]), else a snapshot's (W, n) rows."""

    def __init__(self, rec: dict) -> None:
        self.step = rec["step"]
        self.summaries = rec.get("shard_summaries")
        if self.summaries is not None:
            self.keys = [k for k in self.summaries if not k.endswith(GRAD_SUFFIX)]
            digests = rec.get("layout_digests") or []
            for r, d in enumerate(digests):
                if d != digests[0]:
                    raise LayoutError(f"step {self.step}: rank {r} reports other layouts() than rank 0; every "
                                      f"rank's raw shard is read by one layout")
        else:
            self.keys = list(rec["shards"])
            self.rows = rec["shards"]

    def numel(self, key: str) -> int | None:
        """Elements of `key`'s shard on each rank (None: no such shard); ranks must agree."""
        if key not in self.keys:
            return None
        if self.summaries is None:
            return self.rows[key].shape[1]
        sizes = [s.numel for s in self.summaries[key]]
        for r, n in enumerate(sizes):
            if n != sizes[0]:
                raise LayoutError(f"step {self.step}: rank {r}'s raw shard '{key}' holds {n} elements, rank 0's "
                                  f"{sizes[0]}: a flat layout's shards are of one size")
        return sizes[0]

    def differing(self, key: str, name: str, offset: int, group: int, full: torch.Tensor) -> list:
        """Per rank of the first replica block, where its part of the flat layout's slice differs."""
        if self.summaries is not None:
            return [s.differing.get(name) for s in self.summaries[key][:group]]
        rows = self.rows[key]
        return [row_differing(rows[r], r, offset, full) for r in range(min(group, rows.shape[0]))]
