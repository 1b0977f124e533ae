"""The padding check: padding the adapter declares zero (Padding.ZERO, harness/adapters/base.py)
is exactly zero in every rank's raw shard and its gradient, after every step. Its evidence: the
step record's "shard_summaries" (per raw shard key, each rank's ShardSummary: its padding
elements and the first non-zero one among them; harness/judge/shards.py), computed on the rank
that holds the shard ([Note: Shards judged where they live]) or from a snapshot's rows.
docs/error_model.md, "The checks", says why no tolerance is due: padding is never computed on."""

from __future__ import annotations

from harness.judge.checks.base import CheckStats
from harness.judge.result import Violation
from harness.judge.shards import ShardSummary


def violations(kind: str, step: int, shards: list[tuple[str, list[ShardSummary], bool]],
               stats: CheckStats) -> list[Violation]:
    """The padding check of one step: per (key, every rank's summary, whether the adapter declares
    its padding zero), each rank's first non-zero padding element, its value and how many."""
    out = []
    for key, summaries, declared_zero in shards:
        if not declared_zero:
            continue
        stats.add(sum(s.padding for s in summaries))
        for r, s in enumerate(summaries):
            if s.nonzero_padding is not None:
                f = s.nonzero_padding
                out.append(Violation(kind, step, "padding", key, float("inf"), abs(f.value), 0.0, f.value, 0.0,
                                     index=f.index, rank=r, in_padding=True, num_violating=f.count))
    return out
