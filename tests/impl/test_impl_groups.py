"""fully_shard of a list of modules, one unit ([Note: Module groups] in impl/_unit.py), at W = 1 (no
process group): bitwise the plain model, the plain model's names, the lifecycle of a pass some
member of which runs outside the root's forward. W = 2 against torch FSDP2:
tests/impl/test_impl_multirank.py::test_module_groups_gather_as_fsdp2."""

from __future__ import annotations

import copy

import pytest
import torch

import impl
from cases.models import TransformerConfig, TransformerLM, lm_loss
from impl import fully_shard
from impl._unit import TrainingState

CFG = TransformerConfig(tie_weights=True)


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, CFG.vocab_size, (8, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def grouped(model: TransformerLM) -> TransformerLM:
    """Blocks, the tied embedding and head as one group (FSDP2's idiom), the root."""
    for block in model.blocks:
        fully_shard(block)
    fully_shard([model.tok_emb, model.head])
    return fully_shard(model)


def lm() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(CFG)


def head_outside(model: TransformerLM, idx: torch.Tensor) -> torch.Tensor:
    """A chunked loss's shape: the root's forward stops before the head, which runs after it."""
    forward = type(model).forward

    def hidden(self, idx):
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)
    type(model).forward = hidden
    try:
        h = model(idx)
    finally:
        type(model).forward = forward
    return torch.cat([model.head(chunk) for chunk in h.split(4, dim=0)])  # the head called twice


@pytest.mark.parametrize("run", [lambda m, x: m(x), head_outside], ids=["whole_forward", "head_after_the_root"])
def test_a_group_trains_bitwise_as_the_plain_model(run):
    """Three AdamW steps of a tied LM with [embedding, head] one unit: every loss and parameter is
    the plain model's, bit for bit, with the head inside the root's forward or after it; the units
    are IDLE after each backward."""
    ref = lm()
    ours = grouped(copy.deepcopy(ref))
    unit = ours.tok_emb.__dict__["_fsdp_unit"]
    assert ours.head.__dict__["_fsdp_unit"] is unit and len(unit.handles) == 1
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ref, ours)]
    for step in range(3):
        x, y = batch(step)
        losses = []
        for model, opt in zip((ref, ours), opts):
            loss = lm_loss(run(model, x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1], (step, losses)
        root = ours.__dict__["_fsdp_unit"]
        assert all(u.training_state is TrainingState.IDLE and not u._to_run for u in root.all_units)
        assert sum(u is unit for u in root.all_units) == 1
    theirs = dict(ref.named_parameters())
    for name, full in impl.full_state_dict(ours).items():
        if name in theirs:
            assert torch.equal(full, theirs[name]), name


def test_a_group_keeps_the_plain_models_names_and_round_trips_its_state():
    """named_parameters() and state_dict() of the grouped model give the plain model's names (the
    tied head's too); a full state dict loaded into a fresh grouped model gives the same tensors."""
    ref = lm()
    ours = grouped(copy.deepcopy(ref))
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    full = impl.full_state_dict(ours)
    assert set(full) == set(ref.state_dict())
    for name, t in ref.state_dict().items():
        assert torch.equal(full[name], t), name
    torch.manual_seed(1)
    fresh = grouped(TransformerLM(CFG))
    impl.load_full_state_dict(fresh, full)
    again = impl.full_state_dict(fresh)
    assert all(torch.equal(again[n], full[n]) for n in full)
    assert [n for n, _ in impl.units(ours)] == ["", "tok_emb", "blocks.0", "blocks.1"]  # the group once


def test_a_member_inside_another_is_dropped_and_bad_lists_are_refused():
    model = lm()
    fully_shard([model.blocks[0], model.blocks[0].attn, model.blocks[0]])
    unit = model.blocks[0].__dict__["_fsdp_unit"]
    assert unit.members == [model.blocks[0]] and "_fsdp_unit" not in model.blocks[0].attn.__dict__
    with pytest.raises(TypeError, match="non-empty list of modules"):
        fully_shard([])
    with pytest.raises(TypeError, match="non-empty list of modules"):
        fully_shard([model.blocks[1], "head"])
    with pytest.raises(ValueError, match="already wrapped"):
        fully_shard([model.blocks[0], model.blocks[1]])


def test_fsdp_module_methods_reach_a_group_once():
    """A group's unit is counted once by the FSDPModule methods that visit units."""
    model = grouped(lm())
    assert len(model._units(recurse=True)) == 4  # two blocks, the group, the root
    model.set_reshard_after_forward(False)
    assert all(u.reshard_after_forward is False for u in model._units(recurse=True))
