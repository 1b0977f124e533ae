"""impl/ with no process group (W = 1): bitwise equality with the plain model, init, errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import impl
from cases.models import MLP, TransformerConfig, TransformerLM, lm_loss
from impl import fully_shard


def wrap_nested(model: nn.Module) -> nn.Module:
    for sub in model.blocks if hasattr(model, "blocks") else model.layers:
        fully_shard(sub)
    return fully_shard(model)


def mlp_batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 13, generator=g), torch.randn(8, 7, generator=g)


def lm_batch(step: int):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 37, (8, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def train_pair(factory, batch, loss_fn, steps=5):
    torch.manual_seed(0)
    ref = factory()
    ours = wrap_nested(copy.deepcopy(ref))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        pair = []
        for model, opt in ((ref, opt_ref), (ours, opt_ours)):
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    return ref, ours, losses


@pytest.mark.parametrize(
    "factory,batch,loss_fn",
    [
        (MLP, mlp_batch, nn.functional.mse_loss),
        (lambda: TransformerLM(TransformerConfig()), lm_batch, lm_loss),
    ],
    ids=["mlp", "transformer"],
)
def test_bitwise_equal_to_plain_model(factory, batch, loss_fn):
    ref, ours, losses = train_pair(factory, batch, loss_fn)
    for loss_ref, loss_ours in losses:
        assert loss_ref == loss_ours
    full = impl.full_state_dict(ours)
    assert full.keys() == ref.state_dict().keys()
    for name, tensor in ref.state_dict().items():
        assert torch.equal(full[name], tensor), name


def test_parameters_are_local_pieces_of_one_flat_shard_per_unit():
    # [Note: Per-parameter shards]: the plain model's names, each a 1-D slice of its unit's shard.
    plain = MLP()
    model = wrap_nested(copy.deepcopy(plain))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert all(p.dim() == 1 for p in model.parameters())
    handles = [h for _, unit in impl.units(model) for h in unit.handles]
    assert len(handles) == 3
    for handle in handles:
        for piece, (start, end) in zip(handle.pieces, handle.local_bounds):
            assert piece.data_ptr() == handle.sharded.data_ptr() + start * piece.element_size()
            assert piece.numel() == end - start


def test_load_full_state_dict_roundtrip():
    torch.manual_seed(0)
    source = MLP()
    torch.manual_seed(1)
    model = wrap_nested(MLP())
    impl.load_full_state_dict(model, source.state_dict())
    x, _ = mlp_batch(0)
    assert torch.equal(model(x), source(x))


def test_meta_init_matches_eager_after_loading_reference_state():
    torch.manual_seed(0)
    eager = TransformerLM(TransformerConfig())
    with torch.device("meta"):
        meta = TransformerLM(TransformerConfig())
    wrap_nested(meta)
    impl.init_meta_module(meta, "cpu")
    impl.load_full_state_dict(meta, eager.state_dict())
    x, _ = lm_batch(0)
    assert torch.equal(meta(x), eager(x))
    for name, tensor in eager.state_dict().items():
        assert torch.equal(impl.full_state_dict(meta)[name], tensor), name


def test_meta_init_runs_each_modules_reset_parameters():
    torch.manual_seed(0)
    eager = MLP()
    with torch.device("meta"):
        meta = MLP()
    wrap_nested(meta)
    torch.manual_seed(0)
    impl.init_meta_module(meta, "cpu")
    # Same RNG order as construction: reset_parameters runs module by module.
    for name, tensor in eager.state_dict().items():
        assert torch.equal(impl.full_state_dict(meta)[name], tensor), name


def test_forward_on_meta_names_the_parameters():
    with torch.device("meta"):
        model = MLP()
    wrap_nested(model)
    with pytest.raises(RuntimeError, match=r"still on meta device: \['layers\.0\.weight', 'layers\.0\.bias'\] \(unit 'layers\.0'"):
        model(torch.randn(2, 13))


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_meta_init_reports_parameters_no_reset_parameters_wrote():
    with torch.device("meta"):
        model = NoReset()
    fully_shard(model)
    with pytest.raises(RuntimeError, match=r"never materialised.*\['scale'\]"):
        impl.init_meta_module(model, "cpu")


def test_wrapping_child_after_parent_is_refused():
    model = MLP()
    fully_shard(model)
    with pytest.raises(ValueError, match=r"already belong to an enclosing unit.*sub-modules first"):
        fully_shard(model.layers[0])


def test_parameter_shared_across_units_is_refused_at_the_first_forward():
    """As FSDP2: wrapping the second use is allowed, the root's first forward raises."""
    model = TransformerLM(TransformerConfig(tie_weights=True))
    fully_shard(model.tok_emb)
    fully_shard(model.head)
    fully_shard(model)
    x, _ = lm_batch(0)
    with pytest.raises(ValueError, match=r"'weight' is already managed by another unit \(Embedding\)"):
        model(x)


def test_frozen_parameters_of_another_dtype_have_their_own_flat_parameter():
    """As FSDP2 accepts: the trainable and the frozen parameters are two flat parameters, each of
    one dtype (a frozen float64 weight beside float32 trainable ones); forward works."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].weight.requires_grad_(False)
    model[1].weight.data = model[1].weight.data.double()
    ref = copy.deepcopy(model)
    fully_shard(model)
    dtypes = {h.param_name: h.sharded.dtype for h in model.fsdp_unit().handles}
    assert dtypes == {"_flat_param": torch.float32, "_flat_param_frozen": torch.float64}, dtypes
    got = impl.full_state_dict(model)
    for n, t in ref.state_dict().items():
        assert torch.equal(got[n], t) and got[n].dtype == t.dtype, n


def test_tied_parameter_inside_one_unit_is_one_slot():
    torch.manual_seed(0)
    ref = TransformerLM(TransformerConfig(tie_weights=True))
    ours = fully_shard(copy.deepcopy(ref))
    slots = impl.local_shards(ours)[0].layout.slots
    assert ("tok_emb.weight", "head.weight") in [s.fqns for s in slots]
    x, y = lm_batch(0)
    lm_loss(ref(x), y).backward()
    lm_loss(ours(x), y).backward()
    grads = impl.full_grad_dict(ours)
    torch.testing.assert_close(grads["head.weight"], ref.head.weight.grad, rtol=0, atol=1e-6)


def test_integer_parameter_is_refused():
    model = nn.Linear(2, 2)
    model.register_parameter("count", nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
    with pytest.raises(ValueError, match=r"'count' has dtype torch.int64.*make it a buffer"):
        fully_shard(model)


def test_mixed_dtypes_in_one_unit_are_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(ValueError, match=r"trainable parameters of several dtypes in one unit"):
        fully_shard(model)


def test_frozen_parameters_get_their_own_flat_parameter():
    torch.manual_seed(0)
    ref = MLP()
    ref.layers[0].weight.requires_grad_(False)
    ours = wrap_nested(copy.deepcopy(ref))
    assert [h.param_name for h in ours.layers[0].fsdp_unit().handles] == ["_flat_param", "_flat_param_frozen"]
    assert [n for n, p in ours.named_parameters() if not p.requires_grad] == ["layers.0.weight"]
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    opt_ours = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=0.1)
    for step in range(3):
        x, y = mlp_batch(step)
        for model, opt in ((ref, opt_ref), (ours, opt_ours)):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for name, tensor in ref.state_dict().items():
        assert torch.equal(impl.full_state_dict(ours)[name], tensor), name


def test_gradient_accumulation_without_sync_equals_plain_accumulation():
    torch.manual_seed(0)
    ref = MLP()
    ours = wrap_nested(copy.deepcopy(ref))
    x, y = mlp_batch(0)
    for i, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
        ours.set_requires_gradient_sync(i == 1)
        nn.functional.mse_loss(ours(xs), ys).backward()
        nn.functional.mse_loss(ref(xs), ys).backward()
    grads = impl.full_grad_dict(ours)
    for name, param in ref.named_parameters():
        assert torch.equal(grads[name], param.grad), name


def test_an_all_reduce_hook_on_a_unit_without_reduction_is_refused():
    """One rank, no group: gradients are autograd's own and a hook would never run, silently."""
    model = fully_shard(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="set_all_reduce_hook: this unit has no data-parallel reduction"):
        model.set_all_reduce_hook(lambda grad: None)
