"""The buffers check: every rank's module buffers (running statistics, step counters, masks)
after wrapping and after every step are the replay's, bit for bit: rank 0's by value (its first
differing element named), every other rank's by digest. Its evidence: the step record's
"buffers" ({"values": rank 0's, "digests": (W, buffers) every rank's}, harness/run/snapshot.py);
docs/error_model.md, "Buffers", says why no tolerance is due."""

from __future__ import annotations

import torch

from harness.judge.checks.base import CheckStats, coords
from harness.judge.layouts import first_bit_difference
from harness.judge.result import Violation
from harness.run.snapshot import digest


def violations(kind: str, step: int, evidence: dict, expected: dict[str, torch.Tensor],
                      every_rank: set[str] | None, stats: CheckStats) -> list[Violation]:
    """The buffers check of one step (step 0: after wrapping). `evidence`: {"values": rank 0's
    buffers, "digests": (W, buffers) every rank's}; `expected`: the reference's buffers; every
    rank is held to them for the names in `every_rank` (None: all), rank 0 for every name."""
    values, digests = evidence["values"], evidence["digests"]
    names = list(values)
    missing = sorted(set(expected) ^ set(names))
    if missing:
        raise ValueError(f"step {step}: buffers {missing[:4]} are in only one of cell and reference")
    if tuple(digests.shape[1:]) != (len(names),):
        raise ValueError(f"step {step}: {digests.shape[1] if digests.dim() == 2 else '?'} buffer digests per rank "
                         f"for {len(names)} buffers")
    out = []
    columns = digests.t().tolist()
    for j, name in enumerate(names):
        actual, want = values[name], expected[name]
        index = first_bit_difference(actual, want)
        stats.add(actual.numel(), 0.0 if index is None else float("inf"))
        if index is not None:
            num = (actual.numel() if actual.shape != want.shape or actual.dtype != want.dtype else
                   int((actual.reshape(-1).double() != want.reshape(-1).double()).sum().item()) or 1)
            a, e = _item(actual, index), _item(want, index)
            out.append(Violation(kind, step, "buffers", name, float("inf"), abs(a - e) if a == a and e == e else float("nan"),
                                 0.0, a, e, index, coords(actual.shape, index) if actual.dim() else None, 0,
                                 num_violating=num))
        if every_rank is not None and name not in every_rank:
            continue
        want_digest = digest(want)
        for r, d in enumerate(columns[j]):
            if r == 0:
                continue  # rank 0: its full buffer, compared above
            stats.add(1, 0.0 if d == want_digest else float("inf"))
            if d != want_digest:
                out.append(Violation(kind, step, "buffers", name, float("inf"), float("nan"), 0.0, float("nan"),
                                     float("nan"), rank=r))
    return out


def _item(t: torch.Tensor, index: int) -> float:
    value = t.reshape(-1)[index].item() if t.numel() > index else float("nan")
    return float(value)
