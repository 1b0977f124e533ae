"""Run under torchrun at W = 2: fully_shard of a list of modules ([Note: Module groups] in
impl/_unit.py) against torch FSDP2 itself. One JSON file per rank.

A tied TransformerLM with its blocks wrapped, [tok_emb, head] one group and the root, trained two
AdamW steps on this rank's batch, with the head inside the root's forward and after it (a chunked
loss's shape, the head called once per chunk): impl issues as many all-gathers as FSDP2 and ends
with the same parameters to float32 rounding; a full state dict of the grouped model loaded into a
fresh grouped model gives the same tensors and the same next step, bitwise; a chunked loss whose
chunks each backpropagate through the grouped head alone, then the hidden state through the rest,
gives the gradients of one backward of the summed loss.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import impl
from cases.models import TransformerConfig, TransformerLM, lm_loss
from harness.run.rank import rank_prologue
from tests.support.torchrun_script import finish_rank

CFG = TransformerConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=18, tie_weights=True)


def batch(i: int):
    g = torch.Generator().manual_seed(100 + i + 10 * dist.get_rank())
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def build(fully_shard, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(CFG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard([model.tok_emb, model.head])
    fully_shard(model)
    return model


def whole(model, idx):
    return model(idx)


def head_after_the_root(model, idx):
    forward = type(model).forward

    def hidden(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)
    type(model).forward = hidden
    try:
        h = model(idx)
    finally:
        type(model).forward = forward
    return torch.cat([model.head(chunk) for chunk in h.split(2, dim=0)])


def train(model, run, steps: int = 2) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for i in range(steps):
        x, y = batch(i)
        loss = lm_loss(run(model, x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def counted(where, name: str, fn):
    count = [0]
    real = getattr(where, name)

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)
    setattr(where, name, counting)
    try:
        out = fn()
    finally:
        setattr(where, name, real)
    return count[0], out


def full_params(model, ours: bool) -> dict[str, torch.Tensor]:
    if ours:
        return impl.full_state_dict(model)
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


class ChunkedHead(torch.nn.Module):
    """embed -> body -> norm -> head, the head skipped by forward when a chunked loss calls it."""

    def __init__(self, dim: int = 16, vocab: int = 37) -> None:
        super().__init__()
        self.embed, self.body = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, dim, bias=False)
        self.norm, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, skip_head: bool = False):
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def chunked_loss_grads(per_chunk_backward: bool, grouped: bool) -> dict[str, torch.Tensor]:
    """A chunked loss: the root's forward stops before the head, which each chunk calls; with
    `per_chunk_backward` each chunk's loss is backpropagated through the head alone (FSDP2's
    pattern), then the hidden state's gradient through the rest; else one backward of the sum."""
    torch.manual_seed(0)
    model = ChunkedHead()
    for name in ("embed", "body"):
        impl.fully_shard(getattr(model, name))
    if grouped:
        impl.fully_shard([model.norm, model.head])
    else:
        impl.fully_shard(model.norm)
        impl.fully_shard(model.head)
    impl.fully_shard(model)
    tokens, _ = batch(3)
    h = model(tokens, skip_head=True)
    if per_chunk_backward:
        grads = []
        for chunk in h.detach().chunk(4, dim=1):
            chunk = chunk.contiguous().requires_grad_(True)
            model.head(chunk).sum().backward()
            grads.append(chunk.grad)
        h.backward(torch.cat(grads, dim=1))
    else:
        sum(model.head(chunk).sum() for chunk in h.chunk(4, dim=1)).backward()
    return impl.full_grad_dict(model)


def main() -> int:
    out_dir = sys.argv[1]
    rank_prologue(threads=1)
    import impl._handle
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    result = {}
    for run in (whole, head_after_the_root):
        models = {"impl": build(impl.fully_shard), "fsdp2": build(torch_fully_shard)}
        gathers, losses, params = {}, {}, {}
        for label, where, name in (("impl", impl._handle, "all_gather_into"),
                                   ("fsdp2", _fsdp_param_group, "foreach_all_gather")):
            gathers[label], losses[label] = counted(where, name, lambda m=models[label]: train(m, run))
            params[label] = full_params(models[label], label == "impl")
        common = sorted(set(params["impl"]) & set(params["fsdp2"]))
        worst = max(float((params["impl"][n] - params["fsdp2"][n]).abs().max()
                          / params["fsdp2"][n].abs().max().clamp(min=1e-30)) for n in common)
        result[run.__name__] = {"gathers": gathers, "losses": losses, "worst_relative": worst, "names": common}
    # A full state dict round trip between grouped models, and the step after it.
    ours = build(impl.fully_shard)
    train(ours, whole, steps=1)
    full = impl.full_state_dict(ours)
    fresh = build(impl.fully_shard, seed=1)
    impl.load_full_state_dict(fresh, full)
    again = impl.full_state_dict(fresh)
    result["round_trip_bitwise"] = set(again) == set(full) and all(torch.equal(again[n], full[n]) for n in full)
    x, y = batch(7)
    grads = []
    for model in (ours, fresh):
        lm_loss(model(x), y).backward()
        grads.append(impl.full_grad_dict(model))
    result["next_grads_bitwise"] = set(grads[0]) == set(grads[1]) and all(
        torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    # A backward through the head alone per chunk (grouped with the norm, or a unit of its own),
    # then the rest: the gradients of one backward.
    for grouped in (True, False):
        one, per_chunk = chunked_loss_grads(False, grouped), chunked_loss_grads(True, grouped)
        result[f"chunked_{'grouped' if grouped else 'separate'}"] = {
            "names": sorted(per_chunk) == sorted(one) and len(one) == 5,
            "worst_relative": max(float((per_chunk[n] - one[n]).abs().max() / one[n].abs().max().clamp(min=1e-30))
                                  for n in one)}
    return finish_rank(out_dir, result)


if __name__ == "__main__":
    sys.exit(main())
