"""What every check shares: its statistics (CheckStats: what it compared) and the coordinates of
an element it names."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.judge.segments import Segments


@dataclass
class CheckStats:
    """What one check compared: elements, the unit roundoff behind its tolerance, tol / |value|."""

    u: float = 0.0
    count: int = 0
    rel_tol_samples: list[torch.Tensor] = field(default_factory=list)
    max_ratio: float = 0.0

    def add(self, count: int, ratio: float = 0.0, tol: torch.Tensor | None = None,
            value: torch.Tensor | None = None) -> None:
        self.count += count
        self.max_ratio = max(self.max_ratio, ratio) if ratio == ratio else float("inf")
        if tol is not None and value is not None and value.numel():
            mask = value != 0
            rel = tol.double().expand_as(value)[mask] / value.double().abs()[mask]
            if rel.numel() > 4096:  # a deterministic sample keeps big models cheap
                rel = rel[:: rel.numel() // 4096 + 1]
            self.rel_tol_samples.append(rel)

    def add_samples(self, seg: Segments, tol: torch.Tensor, value: torch.Tensor) -> None:
        """`add`'s tol / |value| samples of every segment at once (flat float64 tol and value):
        the same elements, each segment sampled as `add` samples one tensor (its non-zero values,
        every (count // 4096 + 1)-th of them where it has more than 4096), found before dividing."""
        picked = []
        for start, end in zip(seg.offsets[:-1], seg.offsets[1:]):
            at = (value[start:end] != 0).nonzero().reshape(-1)
            if at.numel() > 4096:
                at = at[:: at.numel() // 4096 + 1]
            picked.append(at + start)
        at = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long)
        if at.numel():
            self.rel_tol_samples.append(tol[at] / value[at].abs())

    def add_slice_samples(self, tol: torch.Tensor, value: torch.Tensor, seen: int, nonzero: int) -> int:
        """`add_samples` of one tensor judged in slices ([Note: The judge by pieces]), for one slice
        (flat float64 tol and value): `seen` of the tensor's `nonzero` values were in the slices
        before it; the same elements as one segment of the whole tensor gives. Returns `seen` after."""
        at = (value != 0).nonzero().reshape(-1)
        n = at.numel()
        if nonzero > 4096:  # the tensor's nonzero values seen + k with (seen + k) % every == 0
            every = nonzero // 4096 + 1
            at = at[(-seen) % every::every]
        if at.numel():
            self.rel_tol_samples.append(tol[at] / value[at].abs())
        return seen + n

    def summary(self) -> dict:
        rel = torch.cat(self.rel_tol_samples) if self.rel_tol_samples else torch.zeros(0, dtype=torch.float64)
        return {"u": self.u, "elements": self.count, "margin": self.max_ratio,
                "tol_over_value_median": rel.median().item() if rel.numel() else None,
                "tol_over_value_max": rel.max().item() if rel.numel() else None}


def coords(size: torch.Size, index: int) -> tuple[int, ...]:
    """The coordinates of flat element `index` in a tensor of `size`."""
    coords = []
    for dim in reversed(size):
        coords.append(index % dim)
        index //= dim
    return tuple(reversed(coords))
