"""impl/ features at W = 1 (no process group): each equals the plain model doing the same thing.

The multi-rank verification of the same features runs through the harness cases.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import impl
from cases.models import Block, TransformerConfig, TransformerLM, lm_loss
from impl import fully_shard


def lm_batch(step: int):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 37, (8, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def nested(model: nn.Module, **kwargs) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def train(model, opt, steps=3, before_step=None):
    losses = []
    for step in range(steps):
        x, y = lm_batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        if before_step:
            before_step(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_same_params(ours: nn.Module, ref: nn.Module) -> None:
    full = impl.full_state_dict(ours)
    for name, tensor in ref.state_dict().items():
        assert torch.equal(full[name], tensor), name


def pair():
    torch.manual_seed(0)
    ref = TransformerLM(TransformerConfig())
    return ref, copy.deepcopy(ref)


def test_activation_checkpointing_inside_units_is_bitwise_equal():
    ref, ours = pair()
    nested(ours)
    for block in ours.blocks:
        block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(block.forward)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    assert train(ours, opt_ours) == train(ref, opt_ref)
    assert_same_params(ours, ref)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_matches_torch(norm_type):
    ref, ours = pair()
    nested(ours)
    norms = {}
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    train(ref, opt_ref, before_step=lambda m: norms.setdefault("ref", []).append(
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, norm_type).item()))
    train(ours, opt_ours, before_step=lambda m: norms.setdefault("ours", []).append(
        impl.clip_grad_norm_(m, 0.05, norm_type).item()))
    torch.testing.assert_close(norms["ours"], norms["ref"], rtol=1e-6, atol=0)
    assert min(norms["ref"]) > 0.05  # the clip was active
    full = impl.full_state_dict(ours)
    for name, tensor in ref.state_dict().items():
        torch.testing.assert_close(full[name], tensor, rtol=0, atol=1e-6)


def test_prefetch_and_reshard_after_forward_false_are_bitwise_equal():
    ref, ours = pair()
    nested(ours, reshard_after_forward=False)
    ours.blocks[0].set_modules_to_forward_prefetch([ours.blocks[1]])
    ours.blocks[1].set_modules_to_backward_prefetch([ours.blocks[0]])
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    assert train(ours, opt_ours) == train(ref, opt_ref)
    assert_same_params(ours, ref)


def test_prefetch_of_an_unwrapped_module_is_refused():
    _, ours = pair()
    nested(ours)
    with pytest.raises(ValueError, match="not wrapped by fully_shard"):
        ours.blocks[0].set_modules_to_forward_prefetch([ours.ln_f])


def test_zero1_optimizer_at_w1_is_bitwise_equal():
    ref, ours = pair()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_ours = impl.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.AdamW, lr=1e-2)
    assert train(ours, opt_ours) == train(ref, opt_ref)
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name


def test_mixed_precision_equals_a_plain_model_that_casts_the_same_way():
    ref, ours = pair()
    policy = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    nested(ours, mp_policy=policy)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = lm_batch(step)
        lm_loss(ours(x).float(), y).backward()
        low = copy.deepcopy(ref).to(torch.bfloat16)  # compute copy of the fp32 master weights
        lm_loss(low(x).float(), y).backward()
        for master, p in zip(ref.parameters(), low.parameters()):
            master.grad = p.grad.to(torch.float32)
        opt_ours.step()
        opt_ref.step()
        opt_ours.zero_grad()
        opt_ref.zero_grad()
    assert ours.blocks[0].fsdp_unit().handles[0].sharded.dtype == torch.float32  # master weights stay fp32
    assert_same_params(ours, ref)


def test_auto_wrap_by_layer_class_and_by_size():
    _, model = pair()
    assert impl.auto_wrap(model, impl.ModuleClassPolicy((Block,))) == ["blocks.0", "blocks.1", ""]
    _, model = pair()
    wrapped = impl.auto_wrap(model, impl.SizePolicy(min_num_params=1000))
    # fc and out hold 18*72+72 and 72*18+18 parameters, the attention 18*54+18*18+18 = 1314.
    assert wrapped == ["blocks.0.attn", "blocks.0.fc", "blocks.0.out",
                       "blocks.1.attn", "blocks.1.fc", "blocks.1.out", ""]
    with pytest.raises(ValueError, match="min_num_params=0"):
        impl.SizePolicy(0)


def test_sharded_checkpoint_roundtrip_and_mismatch(tmp_path):
    ref, ours = pair()
    nested(ours)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    train(ours, opt, steps=2)
    impl.save_sharded_checkpoint(ours, opt, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["metadata.json", "rank0.pt"]
    expected = train(ours, opt, steps=2)

    _, resumed = pair()
    nested(resumed)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    impl.load_sharded_checkpoint(resumed, opt2, tmp_path / "ckpt")
    assert train(resumed, opt2, steps=2) == expected

    other = nested(TransformerLM(TransformerConfig(n_embd=20)))
    with pytest.raises(ValueError, match=r"does not match the model.*different names, shapes or offsets"):
        impl.load_sharded_checkpoint(other, None, tmp_path / "ckpt")
