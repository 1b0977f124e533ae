"""Run under torchrun: a unit's unsharded parameters released before all its gradients are in
([Note: Releasing unsharded parameters] in impl/_handle.py). One JSON file per rank.

Each scenario trains a tied TransformerLM twice from the same weights, with early release and
with it switched off (`handle.release_early = False`); the reductions are the same, so gradients
and losses must be bitwise equal. A hook on the first block's output records, at the moment the
first block's backward is about to run (the root's head and final norm are done, its embeddings
not yet), how many bytes the root's unsharded buffer holds.

In `one_rank_holds`, rank 0 keeps a tensor on the embeddings' storage through backward, so only
rank 1 releases; the recomputation must still gather on both ranks alike. Collectives time out
after COLLECTIVE_TIMEOUT_S, so ranks out of step fail the scenario rather than hang the launch.

Planted faults (the test expects each to be caught):
  release_ignores_saved: the check for saved tensors always answers "nothing saved"
  no_regather_on_recompute: a recomputation inside backward does not re-gather
  regather_where_released: a recomputation re-gathers only on ranks that released (they fall
    out of step with a rank that kept its parameters)
"""

from __future__ import annotations

import sys
import traceback

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import impl
from cases.models import TransformerConfig, TransformerLM, lm_loss
from impl._handle import FlatParamHandle, HandleState
from impl._unit import FSDPUnit
from harness.run.rank import rank_prologue
from tests.support.torchrun_script import finish_rank

CFG = TransformerConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=18, tie_weights=True)
STEPS = 3
SCENARIOS = ("plain", "blocks_checkpointed", "embedding_recomputed", "head_recomputed", "one_rank_holds")
COLLECTIVE_TIMEOUT_S = 30


class CheckpointedEmbeddingLM(TransformerLM):
    """The embeddings recomputed in backward: after the root released its parameters."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = checkpoint(lambda i: self.tok_emb(i) + self.pos_emb(pos), idx, use_reentrant=False)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class CheckpointedHeadLM(TransformerLM):
    """The final norm and the head recomputed in backward: before any release could happen."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return checkpoint(lambda h: self.head(self.ln_f(h)), x, use_reentrant=False)


def build(scenario: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = {"embedding_recomputed": CheckpointedEmbeddingLM, "head_recomputed": CheckpointedHeadLM,
           "one_rank_holds": CheckpointedEmbeddingLM}.get(scenario, TransformerLM)
    model = cls(CFG)
    for block in model.blocks:
        if scenario == "blocks_checkpointed":
            block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(block.forward)
        impl.fully_shard(block)
    return impl.fully_shard(model)


def train(scenario: str, release_early: bool, rank: int) -> dict:
    model = build(scenario)
    for _, unit in impl.units(model):
        for handle in unit.handles:
            handle.release_early = handle.release_early and release_early
    root_bytes_at_first_block_backward: list[int] = []

    def record(grad: torch.Tensor) -> None:
        (root_handle,) = model.fsdp_unit().handles
        root_bytes_at_first_block_backward.append(root_handle.unsharded_buffer.untyped_storage().nbytes())

    def hook_first_block_output(module, args, out) -> None:
        out.register_hook(record)

    model.blocks[0].register_forward_hook(hook_first_block_output)
    held: list[torch.Tensor] = []  # rank 0's tensor on the root's buffer, one per step
    if scenario == "one_rank_holds" and rank == 0:
        model.blocks[0].register_forward_pre_hook(lambda m, a: held.append(model.pos_emb.weight.detach()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size + 1), generator=g)
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "root_bytes": root_bytes_at_first_block_backward}


def plant(fault: str | None) -> None:
    if fault == "release_ignores_saved":
        FlatParamHandle._params_still_saved = lambda self: False
    elif fault == "no_regather_on_recompute":
        FSDPUnit.owner_pre_forward = lambda self, module, args: None
    elif fault == "regather_where_released":
        def owner_pre_forward(self, module, args):
            if self.in_backward():
                for handle in self.handles:
                    handle.recomputing = True
                    if handle.state == HandleState.SHARDED:
                        handle.unshard()
        FSDPUnit.owner_pre_forward = owner_pre_forward


def main() -> int:
    out_dir, fault = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    rank_prologue(threads=1, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    rank = dist.get_rank()
    plant(fault)
    results = {}
    for scenario in SCENARIOS:  # one_rank_holds last: ranks out of step end the process group
        try:
            early, late = train(scenario, True, rank), train(scenario, False, rank)
        except Exception as e:  # a planted fault: report the scenario, keep the ranks in step
            results[scenario] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            continue
        results[scenario] = {
            "losses_equal": early["losses"] == late["losses"],
            "grads_equal": all(torch.equal(a, b) for ga, gb in zip(early["grads"], late["grads"]) for a, b in zip(ga, gb)),
            "root_bytes_early": early["root_bytes"],
            "root_bytes_late": late["root_bytes"],
        }
    return finish_rank(out_dir, results)


if __name__ == "__main__":
    sys.exit(main())
