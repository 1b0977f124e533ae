"""The one forward/backward of a training step that every rank runs, and the replay runs again
for each rank (harness/reference/shadow.py): micro-batches, the loss arithmetic, sync control."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from cases.data import call_model, micro_batches
from harness.adapters.features import floating_output


def forward_backward(model: nn.Module, loss_fn, inputs, targets, num_micro: int,
                     before_micro: Callable[[int], None] | None = None,
                     after_micro: Callable[[int], None] | None = None,
                     backward: Callable[[torch.Tensor, int], None] | None = None) -> torch.Tensor:
    """One step's forward and backward on this rank's batch (inputs and targets: pytrees of
    tensors, cases/data.py); returns the local loss. `backward(loss, i)`, when given, replaces
    `loss.backward()` of micro-batch i (the shadow's reordered replays run it several times).

    With num_micro > 1 the batch is chunked into micro-batches, each loss divided by num_micro,
    gradients accumulated by autograd, and the returned loss is 0 + l_1/M + l_2/M + ... in the
    loss dtype, so the caller and the shadow compute it with the same roundings."""
    if num_micro == 1:
        if before_micro is not None:
            before_micro(0)
        loss = _local_loss(model, loss_fn, inputs, targets)
        loss.backward() if backward is None else backward(loss, 0)
        if after_micro is not None:
            after_micro(0)
        return loss.detach()
    total = None
    for i, (x, y) in enumerate(micro_batches((inputs, targets), num_micro)):
        if before_micro is not None:
            before_micro(i)
        loss = _local_loss(model, loss_fn, x, y) / num_micro
        loss.backward() if backward is None else backward(loss, i)
        if after_micro is not None:
            after_micro(i)
        total = torch.zeros((), dtype=loss.dtype, device=loss.device) if total is None else total
        total += loss.detach()
    return total


def _local_loss(model: nn.Module, loss_fn, inputs, targets) -> torch.Tensor:
    loss = loss_fn(floating_output(call_model(model, inputs)), targets)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn returned {shape}, not a scalar tensor (the mean over the local batch)")
    return loss
