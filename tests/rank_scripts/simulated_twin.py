"""impl trained at W ranks, the same function for real gloo ranks (run under torchrun, one JSON file
per rank) and for simulated ones (tests/harness/run/test_simulated.py calls `train` on the threads
of harness/run/simulated.py): the two must give the same bits on identical data.

An MLP of odd widths (every flat parameter padded at W = 4 and 8, most ranks' shards empty at
W > 64), its layers and root wrapped, AdamW, every rank on the same batch. Weights and data come
from explicit generators: simulated ranks share one process's global generator.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cases.models import MLP
from impl import full_state_dict, fully_shard

STEPS = 3
MAX_WORLD_SIZE = 1024


def train(split: bool = False) -> dict:
    rank = dist.get_rank()
    model = MLP()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        # one draw of the same size at every W (torch's CPU normal draws blocks of 16 values)
        x = torch.randn(8 * MAX_WORLD_SIZE, 13, generator=torch.Generator().manual_seed(100 + step))
        y = torch.randn(8 * MAX_WORLD_SIZE, 7, generator=torch.Generator().manual_seed(200 + step))
        if split:
            x, y = x[8 * rank:8 * (rank + 1)], y[8 * rank:8 * (rank + 1)]
        else:
            x, y = x[:8], y[:8]
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    full = full_state_dict(model)
    return {"losses": losses, "params": {k: [v.hex() for v in t.reshape(-1).tolist()] for k, t in full.items()}}


if __name__ == "__main__":
    from harness.run.rank import rank_epilogue, rank_prologue

    rank_prologue(1)
    result = train(split=len(sys.argv) > 2 and sys.argv[2] == "split")
    (Path(sys.argv[1]) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    rank_epilogue()
