"""Deterministic global batches, and how a data mode hands them to ranks.

Every rank regenerates the same global batch from (seed, step) with its own generator, so no
rank depends on another's random-number state and no process-global seed is touched.
"""

from __future__ import annotations

from typing import Callable

import torch

DATA_MODES = ("identical", "split")

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), dim 0 is the sample


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def regression_batch(in_features: int, out_features: int) -> Callable[[int, int, int], Batch]:
    """Gaussian inputs and targets: (B, in_features), (B, out_features)."""

    def make(seed: int, step: int, global_batch: int) -> Batch:
        g = _generator(seed, step)
        x = torch.randn(global_batch, in_features, generator=g)
        y = torch.randn(global_batch, out_features, generator=g)
        return x, y

    return make


def token_batch(vocab_size: int, block_size: int) -> Callable[[int, int, int], Batch]:
    """Random token windows: inputs (B, T) and next-token targets (B, T)."""

    def make(seed: int, step: int, global_batch: int) -> Batch:
        g = _generator(seed, step)
        tokens = torch.randint(0, vocab_size, (global_batch, block_size + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return make


def image_batch(channels: int, size: int, classes: int) -> Callable[[int, int, int], Batch]:
    """Gaussian images (B, channels, size, size) and class labels (B,)."""

    def make(seed: int, step: int, global_batch: int) -> Batch:
        g = _generator(seed, step)
        images = torch.randn(global_batch, channels, size, size, generator=g)
        return images, torch.randint(0, classes, (global_batch,), generator=g)

    return make


def local_batch(batch: Batch, data_mode: str, rank: int, world_size: int) -> Batch:
    """This rank's part of the global batch.

    identical: every rank gets the whole batch (the averaged gradient is the full-batch gradient).
    split: rank r gets rows [r * B / W, (r + 1) * B / W); with equal local sizes the mean of the
    local mean losses is the global mean loss, so the averaged gradient is the full-batch one.
    """
    if data_mode == "identical":
        return batch
    if data_mode != "split":
        raise ValueError(f"data_mode={data_mode!r} is not one of {DATA_MODES}")
    global_batch = batch[0].size(0)
    if global_batch % world_size:
        raise ValueError(
            f"global_batch={global_batch} does not divide by world_size={world_size} in split mode; "
            f"choose a world size that divides it"
        )
    local = global_batch // world_size
    return tuple(t[rank * local : (rank + 1) * local] for t in batch)  # type: ignore[return-value]
