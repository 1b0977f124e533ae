"""Run under torchrun: communication overlapped with compute ([Note: Implicit prefetch] in
impl/_unit.py, [Note: Overlapped gradient reduction] in impl/_handle.py). One JSON file per rank.

A tied TransformerLM (blocks and root wrapped) trains with the defaults and again with prefetch
turned off ([] for every unit) and every reduce-scatter waited on at once; the collectives and
their inputs are the same, so losses and gradients must be bitwise equal. Hooks observe, from
the second step on (the forward order is known from the first):
  forward:  when blocks[0] runs, the all-gather of blocks[1] has started;
  backward: when blocks[1]'s backward is about to run, blocks[0]'s all-gather has started and
            the reduce-scatter of blocks[2] is still in flight.

Planted faults (the test expects each to be caught):
  no_implicit_prefetch: no unit prefetches unless told to
  blocking_reduce: every reduce-scatter is waited on as soon as it starts
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import impl
import impl._unit
from cases.models import TransformerConfig, TransformerLM, lm_loss
from impl._handle import GradReducer
from harness.run.rank import rank_prologue
from tests.support.torchrun_script import finish_rank

CFG = TransformerConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=18, tie_weights=True)
STEPS = 3


def build(overlap: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TransformerLM(CFG)
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard(model)
    if not overlap:
        for module in (*model.blocks, model):
            module.set_modules_to_forward_prefetch([])
            module.set_modules_to_backward_prefetch([])
        reducer = model.fsdp_unit().reducer  # every unit's, from the first forward on

        def start_and_wait(handle, padded_grad) -> None:
            GradReducer.start(reducer, handle, padded_grad)
            reducer.wait()

        reducer.start = start_and_wait
    return model


def train(overlap: bool, rank: int) -> dict:
    model = build(overlap)
    (block0, block1, block2) = [b.fsdp_unit() for b in model.blocks]
    seen: dict[str, list] = {"forward_prefetched": [], "backward_prefetched": [], "reduce_in_flight": []}

    def before_block0_forward(module, args) -> None:
        seen["forward_prefetched"].append(all(h.gather_started for h in block1.handles))

    def before_block1_backward(grad) -> None:
        seen["backward_prefetched"].append(all(h.gather_started for h in block0.handles))
        in_flight = model.fsdp_unit().reducer.in_flight
        seen["reduce_in_flight"].append(in_flight is not None and in_flight in block2.handles)

    # Registered after fully_shard's own hooks, so they run after them.
    def hook_block1_output(module, args, out) -> None:
        out.register_hook(before_block1_backward)

    model.blocks[0].register_forward_pre_hook(before_block0_forward)
    model.blocks[1].register_forward_hook(hook_block1_output)
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
    return {"losses": losses, "grads": grads, **seen}


def main() -> int:
    out_dir, fault = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    rank_prologue(threads=1)
    rank = dist.get_rank()
    if fault == "no_implicit_prefetch":
        chosen_only = impl._unit._prefetch
        impl._unit._prefetch = lambda chosen, implicit: chosen_only(chosen, None)
    elif fault == "blocking_reduce":
        original = GradReducer.start

        def start_and_wait(self, handle, padded_grad) -> None:
            original(self, handle, padded_grad)
            self.wait()

        GradReducer.start = start_and_wait
    overlapped, blocking = train(True, rank), train(False, rank)
    result = {
        "losses_equal": overlapped["losses"] == blocking["losses"],
        "grads_equal": all(torch.equal(a, b) for ga, gb in zip(overlapped["grads"], blocking["grads"])
                           for a, b in zip(ga, gb)),
        "overlapped": {k: overlapped[k] for k in ("forward_prefetched", "backward_prefetched", "reduce_in_flight")},
        "blocking": {k: blocking[k] for k in ("forward_prefetched", "backward_prefetched", "reduce_in_flight")},
    }
    return finish_rank(out_dir, result)


if __name__ == "__main__":
    sys.exit(main())
