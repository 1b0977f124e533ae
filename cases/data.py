"""Deterministic global batches, how a data mode hands them to ranks, and how a batch meets a model.

Every rank regenerates the same global batch from (seed, step) with its own generator, so no
rank depends on another's random-number state and no process-global seed is touched.

A batch is `(inputs, targets)`, each any pytree of tensors (a tensor, tuple, list, dict) whose
tensors all have the sample along dim 0; leaves that are not tensors (None, flags) are handed to
every rank and micro-batch unchanged. The model is called with `inputs` as one argument (a
tensor), as positional arguments (a tuple or list) or as keyword arguments (a dict): see
`call_model`. The loss function receives the model's output (any pytree: a tensor, tuple, dict,
a Hugging Face ModelOutput) and `targets`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

DATA_MODES = ("identical", "split")

Batch = tuple[Any, Any]  # (inputs, targets): pytrees of tensors, dim 0 is the sample


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


def padded_sequence_batch(vocab_size: int, block_size: int, min_length: int,
                          classes: int) -> Callable[[int, int, int], Batch]:
    """Token windows padded at the end, with class labels: inputs {'input_ids': (B, T),
    'attention_mask': (B, T)} and labels (B,). Each sample keeps between `min_length` and T tokens
    (ids 1 .. vocab_size - 1), the rest are id 0 with mask 0."""
    if not 1 <= min_length <= block_size:
        raise ValueError(f"padded_sequence_batch min_length={min_length} must be in [1, block_size={block_size}]")

    def make(seed: int, step: int, global_batch: int) -> Batch:
        g = _generator(seed, step)
        input_ids = torch.randint(1, vocab_size, (global_batch, block_size), generator=g)
        lengths = torch.randint(min_length, block_size + 1, (global_batch,), generator=g)
        attention_mask = (torch.arange(block_size)[None, :] < lengths[:, None]).long()  # (B, T)
        labels = torch.randint(0, classes, (global_batch,), generator=g)
        return {"input_ids": input_ids * attention_mask, "attention_mask": attention_mask}, labels

    return make


def batch_size(batch: Batch) -> int:
    """The number of samples: dim 0 of every tensor of the batch, which must agree."""
    sizes = {t.size(0) if t.dim() else None for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)}
    if len(sizes) != 1 or None in sizes:
        shapes = [tuple(t.shape) for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
        raise ValueError(f"batch tensors of shapes {shapes[:6]} do not share one dim 0 (the sample); "
                         f"every tensor of (inputs, targets) must have the batch along dim 0")
    return sizes.pop()


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """`tree` with every tensor replaced by fn(tensor); other leaves kept."""
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Samples [start, stop) of every tensor of the batch."""
    return map_tensors(lambda t: t[start:stop], batch)


def micro_batches(batch: Batch, num_micro: int) -> list[Batch]:
    """`num_micro` equal consecutive chunks of a local batch (Features.batch_divisor checks they divide)."""
    size = batch_size(batch)
    if size % num_micro:
        raise ValueError(f"local batch of {size} samples does not split into {num_micro} micro-batches")
    per = size // num_micro
    return [slice_batch(batch, i * per, (i + 1) * per) for i in range(num_micro)]


def local_batch(batch: Batch, data_mode: str, rank: int, world_size: int) -> Batch:
    """This rank's part of the global batch.

    identical: every rank gets the whole batch (the averaged gradient is the full-batch gradient).
    split: rank r gets rows [r * B / W, (r + 1) * B / W) of every tensor; with equal local sizes
    the mean of the local mean losses is the global mean loss, so the averaged gradient is the
    full-batch one.
    """
    if data_mode == "identical":
        return batch
    if data_mode != "split":
        raise ValueError(f"data_mode={data_mode!r} is not one of {DATA_MODES}")
    global_batch = batch_size(batch)
    if global_batch % world_size:
        raise ValueError(
            f"global_batch={global_batch} does not divide by world_size={world_size} in split mode; "
            f"choose a world size that divides it"
        )
    local = global_batch // world_size
    return slice_batch(batch, rank * local, (rank + 1) * local)


def call_model(model: Callable, inputs: Any) -> Any:
    """The model applied to a batch's inputs: a dict as keyword arguments, a tuple or list as
    positional arguments, anything else (a tensor) as the one argument."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)
