"""A rank's raw shards, summarised where they live.

[Note: Shards judged where they live]
Three checks read an implementation's raw shards (every rank's local piece of each flat
parameter, padding included, and of its gradient): the non-finite check (a NaN or an infinity in a
shard, outside padding whose content is not promised), the padding check (padding the adapter
declares zero is zero) and the layout validation (the slice a flat layout names, in a rank's shard,
is the full parameter's bits: [Note: Layout validation] in harness/judge/layouts.py). Each of them
asks of one rank's shard alone: its first offending element, that element's value and how many
offend; the judge then reads the ranks in order. So each rank answers for its own shard
(`summarize_row`) and only the answers travel: a few numbers per shard and step, where gathering
the shards to one rank moved the model's size twice per step and held it there (a 124M-parameter
GPT-2 at W = 2: 1.5 GB on the judging rank). A snapshot judged in the parent holds the (W, n) rows,
and its judge summarises each row with the same function, so both ways judge the same numbers:
- non-finite: the first non-finite element of the row, padding zeroed first unless declared zero
  (as the row's copy was), its value and the count; the check counts the row's elements;
- padding: the elements in the row's padding intervals (counted), the first non-zero one among
  them in interval order, its value and the count;
- layouts: per flat layout whose slice falls in this rank's shard (ranks of the first replica
  block), the first element of that slice whose bits differ from the full parameter, as an index
  into the parameter, both values and the count; the judge names the lowest rank's element and
  adds the counts, which is the first differing element of the whole slice and its count.
On a rank the full parameter is the rank's own gathered copy; the parent's snapshot holds rank 0's.
The two are bitwise equal unless the ranks' gathered parameters differ, which the replicas check
fails on its own; only then can the layout check name another value than the parent's would.
A row that cannot be read (an interval past its end) gives an error, which the judge raises as a
LayoutError (the cell is an error), on the rank as in the parent.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

# A raw shard's gradient is judged under its key with this suffix (the report names it so).
GRAD_SUFFIX = " (grad)"


@dataclass(frozen=True)
class First:
    """The first offending element of a row (or of a layout's slice of it) and how many offend."""

    index: int
    value: float
    count: int


@dataclass(frozen=True)
class Differing:
    """A flat layout's slice in one rank's shard against the full parameter: the first element whose
    bits differ (an index into the parameter), the full parameter's value and the shard's there, and
    how many of the slice's elements differ."""

    index: int
    full: float
    shard: float
    count: int


@dataclass(frozen=True)
class ShardSummary:
    """One rank's raw shard (its data, or its gradient) of one flat key, as the judge reads it."""

    numel: int
    padding: int = 0  # elements in its padding intervals
    nonfinite: First | None = None
    nonzero_padding: First | None = None  # None where the padding is not judged, or all zero
    differing: dict[str, Differing] = field(default_factory=dict)  # per layout name, where a slice differs
    error: str | None = None  # why the row could not be read


def padding_positions(intervals, numel: int) -> torch.Tensor:
    """The row positions of `intervals` ([start, end) runs, in order), as a long tensor."""
    for start, end in intervals:
        if not 0 <= start <= end <= numel:
            raise ValueError(f"padding interval [{start}, {end}) lies outside the shard's {numel} elements")
    return torch.cat([torch.arange(start, end) for start, end in intervals] + [torch.arange(0)]).long()


def _first(bad: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None) -> First | None:
    if not bool(bad.any()):
        return None
    at = int(bad.nonzero()[0].item())
    index = at if positions is None else int(positions[at])
    return First(index, values[at].item(), int(bad.sum().item()))


def first_bit_difference_count(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int] | None:
    """(first element whose bits differ, how many do) of two 1-D tensors of one dtype and size; None:
    equal (a NaN equals the same NaN, -0.0 differs from 0.0). harness/judge/layouts.py
    `first_bit_difference` is its first part."""
    if a.numel() == 0:
        return None
    a_bits, b_bits = (t.contiguous().view(torch.uint8).view(-1, t.element_size()) for t in (a, b))
    bad = (a_bits != b_bits).any(dim=1)
    if not bool(bad.any()):
        return None
    return int(bad.nonzero()[0].item()), int(bad.sum().item())


def row_differing(row: torch.Tensor, rank: int, offset: int, full: torch.Tensor) -> Differing | None:
    """The flat layout's slice at `offset` of the padded buffer, as far as it lies in `rank`'s shard
    `row`, against the full parameter `full`: its first differing element ([Note: Shards judged
    where they live]), None where it agrees or does not reach this shard."""
    numel = row.numel()
    flat = full.detach().reshape(-1).to(row.dtype)
    lo, hi = max(offset, rank * numel), min(offset + flat.numel(), (rank + 1) * numel)
    if lo >= hi:
        return None
    shard = row.reshape(-1)[lo - rank * numel: hi - rank * numel]
    whole = flat[lo - offset: hi - offset]
    found = first_bit_difference_count(shard, whole)
    if found is None:
        return None
    at, count = found
    return Differing(lo - offset + at, whole[at].item(), shard[at].item(), count)


def summarize_row(row: torch.Tensor, rank: int, intervals, padding_judged: bool,
                  slices: list[tuple[str, int, int, torch.Tensor]] = ()) -> ShardSummary:
    """One rank's shard `row` judged where it is ([Note: Shards judged where they live]): its
    non-finite and padding answers, and per (layout name, offset, the layout's world size, full
    parameter) of `slices` whose first replica block holds `rank`, its differing elements."""
    row = row.detach().reshape(-1)
    numel = row.numel()
    try:
        at = padding_positions(intervals, numel)
    except ValueError as e:
        return ShardSummary(numel, error=str(e))
    if padding_judged or not at.numel():
        judged = row
    else:  # padding of an unspecified convention may hold anything: zeroed in a copy
        judged = row.clone()
        judged[at] = 0
    finite = torch.isfinite(judged)
    nonfinite = None if bool(finite.all()) else _first(~finite, judged)
    nonzero_padding = None
    if padding_judged and at.numel():
        pad = row[at]
        nonzero_padding = _first(pad != 0, pad, at)
    differing = {}
    for name, offset, group, full in slices:
        if rank < group:
            found = row_differing(row, rank, offset, full)
            if found is not None:
                differing[name] = found
    return ShardSummary(numel, int(at.numel()), nonfinite, nonzero_padding, differing)


def flat_slices(layouts: dict, key: str, params: dict[str, torch.Tensor],
                aliases: dict[str, str]) -> list[tuple[str, int, int, torch.Tensor]]:
    """(name, offset, world size, full parameter) of every flat layout in `key`, in layout order,
    whose full parameter is at hand (`aliases`: a tied name -> the name its evidence is under)."""
    out = []
    for name, layout in layouts.items():
        if not isinstance(layout, dict) or layout.get("kind") != "flat" or layout.get("flat_key") != key:
            continue
        full = params.get(aliases.get(name, name))
        try:
            out.append((name, int(layout["offset"]), int(layout["world_size"]), full))
        except (KeyError, TypeError, ValueError):
            continue  # structurally invalid: the judge raises on it (harness/judge/layouts.py)
    return [s for s in out if s[3] is not None]


def layouts_digest(layouts) -> str:
    """A digest of an adapter's layouts, for comparing ranks' (every rank summarises by its own)."""
    text = json.dumps(layouts, sort_keys=True, default=repr)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def summarize_rows(rows: torch.Tensor, intervals_per_row, padding_judged: bool,
                   slices: list[tuple[str, int, int, torch.Tensor]] = ()) -> list[ShardSummary]:
    """`summarize_row` of each rank's row of (W, n) `rows` (a snapshot's shards)."""
    intervals_per_row = list(intervals_per_row) + [[]] * (rows.shape[0] - len(intervals_per_row))
    return [summarize_row(rows[r], r, intervals_per_row[r], padding_judged, slices) for r in range(rows.shape[0])]
