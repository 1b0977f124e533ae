"""impl's unit lifecycle ([Note: Unit lifecycle] in impl/_unit.py) at W = 1: the states a unit
moves through, recomputation told from them (activation checkpointing around whole units, both
autograd flavours, bitwise equal to the plain model), and a move the lifecycle does not allow
raised with the rank and the unit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import impl
from cases.models import TransformerConfig, TransformerLM, lm_loss
from impl import fully_shard
from impl._unit import FSDPUnit, TrainingState
from tests.impl.test_impl_features import lm_batch, nested, train

IDLE, FORWARD, PRE_BACKWARD = TrainingState.IDLE, TrainingState.FORWARD, TrainingState.PRE_BACKWARD


class Checkpointed(nn.Module):
    """A wrapped block called through activation checkpointing: its FSDP hooks run inside the
    checkpoint, so backward runs its forward again."""

    def __init__(self, block: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=self.reentrant)


def _moves(monkeypatch) -> list[tuple[str, TrainingState, TrainingState]]:
    moves = []
    enter = FSDPUnit._enter

    def recording(self, state):
        moves.append((self.name, self.training_state, state))
        enter(self, state)
    monkeypatch.setattr(FSDPUnit, "_enter", recording)
    return moves


def test_one_iteration_moves_every_unit_through_its_states(monkeypatch):
    torch.manual_seed(0)
    model = nested(TransformerLM(TransformerConfig(n_layer=2)))
    moves = _moves(monkeypatch)
    x, y = lm_batch(0)
    out = model(x)
    assert moves == [("<root>", IDLE, FORWARD), ("blocks.0", IDLE, FORWARD), ("blocks.0", FORWARD, IDLE),
                     ("blocks.1", IDLE, FORWARD), ("blocks.1", FORWARD, IDLE), ("<root>", FORWARD, IDLE)]
    moves.clear()
    lm_loss(out, y).backward()
    assert moves[:3] == [("<root>", IDLE, PRE_BACKWARD), ("blocks.1", IDLE, PRE_BACKWARD),
                         ("blocks.0", IDLE, PRE_BACKWARD)]
    assert sorted(moves[3:]) == sorted((n, PRE_BACKWARD, IDLE) for n in ("<root>", "blocks.0", "blocks.1"))


@pytest.mark.parametrize("reentrant", [False, True])
def test_units_checkpointed_whole_recompute_inside_backward(reentrant, monkeypatch):
    """The recomputed forward neither moves the unit nor ends its unsharded parameters early: the
    run is the plain model's, bit for bit, and every unit ends the iteration IDLE."""
    torch.manual_seed(0)
    ref = TransformerLM(TransformerConfig(n_layer=2))
    ours = copy.deepcopy(ref)
    for block in ours.blocks:
        fully_shard(block)
    fully_shard(ours)
    ours.blocks = nn.ModuleList(Checkpointed(b, reentrant) for b in ours.blocks)
    moves = _moves(monkeypatch)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    assert train(ours, opt_ours) == train(ref, opt_ref)
    full = {n.replace(".block.", "."): t for n, t in impl.full_state_dict(ours).items()}
    assert full.keys() == ref.state_dict().keys()
    for name, tensor in ref.state_dict().items():
        assert torch.equal(full[name], tensor), name
    forwards = [m for m in moves if m[2] is FORWARD]
    assert len(forwards) == 3 * 3  # three steps of root + two blocks: the recomputations are not forwards
    assert all(unit.training_state is IDLE for unit in ours.__dict__["_fsdp_unit"].all_units)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_backward_from_an_inner_unit_only_recomputes_it_inside_backward(reentrant):
    """The loss reads one inner unit's output, never the root's: the backward begins below the
    root, which it moves to PRE_BACKWARD all the same ([Note: Unit lifecycle])."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 2))
    ours = copy.deepcopy(ref)
    fully_shard(ours[1])
    fully_shard(ours)
    inner = {}
    ours[1].register_forward_hook(lambda m, i, o: inner.__setitem__("ours", o))
    ref[1].register_forward_hook(lambda m, i, o: inner.__setitem__("ref", o))
    ours[1] = Checkpointed(ours[1], reentrant)
    x = torch.randn(4, 6)
    for model, key in ((ours, "ours"), (ref, "ref")):
        model(x)
        inner[key].square().sum().backward()
    grads = {n.replace(".block.", "."): p.grad for n, p in ours.named_parameters()}
    for name, p in ref.named_parameters():  # a W = 1 shard holds the whole parameter, flat
        assert (grads[name] is None) == (p.grad is None), name
        assert p.grad is None or torch.equal(grads[name].reshape(-1), p.grad.reshape(-1)), name
    assert all(u.training_state is IDLE for u in ours.__dict__["_fsdp_unit"].all_units)


class Raising(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fail = True

    def forward(self, x):
        if self.fail:
            raise ValueError("planted")
        return self.lin(x)


def test_a_move_the_lifecycle_forbids_is_raised_with_rank_and_unit():
    model = fully_shard(Raising())
    with pytest.raises(ValueError, match="planted"):
        model(torch.ones(2, 4))  # stops half-way: the unit stays in FORWARD
    model.fail = False
    with pytest.raises(RuntimeError, match=r"rank 0: FSDP unit '<root>' moved from FORWARD to FORWARD"):
        model(torch.ones(2, 4))


@pytest.mark.parametrize("configured, root_after_forward", [(None, "UNSHARDED"), (True, "SHARDED"),
                                                            (False, "UNSHARDED")])
def test_the_root_reshards_after_forward_by_fsdp2s_rule(configured, root_after_forward):
    """None: every unit but the root; True: the root too (backward gathers it again); False: none.
    The gradients are the plain model's either way."""
    from impl._handle import HandleState

    torch.manual_seed(0)
    ref = TransformerLM(TransformerConfig(n_layer=2))
    ours = copy.deepcopy(ref)
    for block in ours.blocks:
        fully_shard(block, reshard_after_forward=configured)
    fully_shard(ours, reshard_after_forward=configured)
    x, y = lm_batch(0)
    out = ours(x)
    root = ours.__dict__["_fsdp_unit"]
    assert {h.state.name for h in root.handles} == {root_after_forward}
    blocks = {h.state for b in ours.blocks for h in b.__dict__["_fsdp_unit"].handles}
    assert blocks == {HandleState.UNSHARDED if configured is False else HandleState.SHARDED}
    lm_loss(out, y).backward()
    lm_loss(ref(x), y).backward()
    grads = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.equal(grads[name].grad.reshape(-1), p.grad.reshape(-1)), name


def test_an_int_reshard_after_forward_must_divide_the_shard_group():
    """W = 1: 2 divides no group of one rank (refused, naming the size); 1 keeps the parameters (False);
    a float is refused. At W = 4: tests/impl/test_impl_multirank.py::test_resharding_to_a_smaller_group_after_forward."""
    with pytest.raises(ValueError, match=r"reshard_after_forward=2: an int is the group size .* size 1"):
        fully_shard(nn.Linear(4, 4), reshard_after_forward=2)
    assert fully_shard(nn.Linear(4, 4), reshard_after_forward=1).fsdp_unit().reshard_after_forward is False
    with pytest.raises(ValueError, match="pass None, a bool, or an int"):
        fully_shard(nn.Linear(4, 4), reshard_after_forward=0.5)


def test_offload_policies_mean_what_fsdp2s_do():
    """OffloadPolicy() is no offload; CPUOffloadPolicy() keeps the shards on the CPU and computes
    on its device (the CPU where there is no GPU)."""
    from impl import CPUOffloadPolicy, OffloadPolicy

    plain = fully_shard(nn.Linear(4, 4), offload_policy=OffloadPolicy())
    assert plain.__dict__["_fsdp_unit"].handles[0].comm.compute_device is None
    offloaded = fully_shard(nn.Linear(4, 4), offload_policy=CPUOffloadPolicy())
    assert offloaded.__dict__["_fsdp_unit"].handles[0].comm.compute_device == (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    assert all(p.device.type == "cpu" for p in offloaded.parameters())


def test_output_dtype_casts_the_units_floating_outputs():
    from impl import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 4), mp_policy=MixedPrecisionPolicy(output_dtype=torch.bfloat16))
    out = model(torch.ones(2, 4))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())



def test_fsdp2s_unit_methods_act():
    """unshard(async_op=True) returns a handle whose wait() leaves the parameters unsharded under
    their names; set_reshard_after_forward(True) makes the root reshard from the next forward;
    set_gradient_divide_factor refuses a unit with no reduction to divide."""
    from impl import UnshardHandle
    from impl._handle import HandleState

    torch.manual_seed(0)
    model = nested(TransformerLM(TransformerConfig(n_layer=2)))
    root = model.__dict__["_fsdp_unit"]
    done = model.unshard(async_op=True)
    assert isinstance(done, UnshardHandle)
    done.wait()
    assert {h.state for h in root.handles} == {HandleState.UNSHARDED}
    assert model.head.weight.shape == (37, 18)  # the name is the unsharded view
    model.reshard()
    assert {h.state for h in root.handles} == {HandleState.SHARDED}
    x, _ = lm_batch(0)
    model(x)
    assert {h.state for h in root.handles} == {HandleState.UNSHARDED}  # the default: the root stays gathered
    model.set_reshard_after_forward(True)
    model(x)
    assert {h.state for h in root.handles} == {HandleState.SHARDED}
    assert all(b.__dict__["_fsdp_unit"].reshard_after_forward is True for b in model.blocks)
    with pytest.raises(ValueError, match="no data-parallel reduction"):
        model.set_gradient_divide_factor(2.0)


def test_a_registered_forward_method_runs_between_the_units_hooks():
    """A `generate`-like method reads the parameters outside forward: registered, it sees them
    unsharded (and the unit reshards after it); the plain model's result, bit for bit."""
    from impl import register_fsdp_forward_method

    class Scorer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(6, 3)

        def forward(self, x):
            return self.proj(x)

        def score(self, x):
            return (x @ self.proj.weight.t() + self.proj.bias).softmax(-1)

    torch.manual_seed(0)
    ref = Scorer()
    ours = copy.deepcopy(ref)
    fully_shard(ours, reshard_after_forward=True)
    register_fsdp_forward_method(ours, "score")
    x = torch.randn(5, 6)
    assert torch.equal(ours.score(x), ref.score(x))
    assert {h.state.name for h in ours.__dict__["_fsdp_unit"].handles} == {"SHARDED"}  # resharded after it
    with pytest.raises(ValueError, match="has no method 'sample'"):
        register_fsdp_forward_method(ours, "sample")


def test_ignored_params_stay_as_they_are_and_train_as_the_plain_model():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    ours = copy.deepcopy(ref)
    ignored = {ours[2].bias}
    fully_shard(ours[0], ignored_params=ignored)
    fully_shard(ours, ignored_params=ignored)
    assert ours[2].bias is next(iter(ignored)) and ours[2].bias.shape == (2,)  # not a flat piece of a unit
    managed = {id(p) for _, u in impl.units(ours) for h in u.handles for p in h.pieces}
    assert id(ours[2].bias) not in managed and id(ours[2].weight) in managed
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for model, opt in zip((ref, ours), opts):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    full = impl.full_state_dict(ours)
    assert full.keys() == ref.state_dict().keys()
    for name, tensor in ref.state_dict().items():
        assert torch.equal(full[name], tensor), name


def test_shard_placement_fn_is_validated_as_fsdp2_and_computes_as_the_flat_layout():
    """Shard(d) for a dimension of the parameter is accepted (a warning says the local piece is
    flat) and lays the unit out exactly as None or Shard(0) do, so it trains the same; a dimension
    the parameter lacks, a placement that is not Shard, a dimension d != 0 that the shard group
    does not split evenly, are refused as FSDP2 refuses them."""
    from torch.distributed.tensor import Replicate, Shard

    from impl.api import _check_placements

    def layout(fn):
        torch.manual_seed(0)
        model = fully_shard(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)), shard_placement_fn=fn)
        return [(s.fqn, s.offset, s.end) for s in impl.local_shards(model)[0].layout.slots]

    flat = layout(None)
    assert layout(lambda p: Shard(0)) == flat
    with pytest.warns(UserWarning, match=r"Shard\(1\) for '0.weight'.*1-D slice of the flat parameter"):
        assert layout(lambda p: Shard(p.dim() - 1)) == flat
    with pytest.raises(AssertionError, match=r"Shard dim 1 is invalid for 1D tensor.*'0.bias'"):
        fully_shard(nn.Sequential(nn.Linear(4, 4)), shard_placement_fn=lambda p: Shard(1))
    with pytest.raises(NotImplementedError, match=r"gave Replicate\(\) for '0.weight'"):
        fully_shard(nn.Sequential(nn.Linear(4, 4)), shard_placement_fn=lambda p: Replicate())
    odd = nn.Sequential(nn.Linear(3, 4))  # weight (4, 3): dim 1 over 2 ranks is uneven, dim 0 is not
    _check_placements(odd, lambda p: Shard(0), 2, "odd")
    with pytest.raises(NotImplementedError, match=r"FSDP does not support uneven sharding on dim 1.*over 2 ranks"):
        _check_placements(odd, lambda p: Shard(p.dim() - 1), 2, "odd")


def test_a_non_contiguous_parameter_is_refused_and_a_0d_one_is_sharded():
    """channels_last would come back contiguous from the flat buffer: refused, as FSDP2 does. A 0-d
    parameter is one element of the flat parameter: impl shards it (FSDP2 refuses it), bitwise."""
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    with pytest.raises(NotImplementedError, match="parameter 'weight' is not contiguous"):
        fully_shard(conv)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.scale = nn.Linear(3, 3), nn.Parameter(torch.tensor(0.5))

        def forward(self, x):
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    ref = Scaled()
    ours = fully_shard(copy.deepcopy(ref))
    x = torch.randn(2, 3)
    ref(x).sum().backward()
    ours(x).sum().backward()
    grads = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.equal(grads[name].grad.reshape(-1), p.grad.reshape(-1)), name


class FailsOnce(nn.Module):
    """A block that raises in forward, or in backward (a hook on its output's gradient), once."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block, self.fail = block, None

    def forward(self, x):
        if self.fail == "forward":
            raise ValueError("planted in forward")
        out = self.block(x)
        if self.fail == "backward" and out.requires_grad:
            def raise_(grad):
                raise ValueError("planted in backward")
            out.register_hook(raise_)
        return out


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_reset_iter_state_after_an_exception_trains_on_as_the_plain_model(where):
    """A forward or backward that raises half-way leaves units FORWARD or PRE_BACKWARD, unsharded, with
    gradients half-reduced; reset_iter_state() on the root forgets that iteration, and the next three
    AdamW steps give the plain model's losses and parameters bit for bit (the plain model skipping the
    failed iteration too). Called on a non-root it raises."""
    torch.manual_seed(0)
    ref = TransformerLM(TransformerConfig())
    ref.blocks[1] = FailsOnce(ref.blocks[1])
    ours = copy.deepcopy(ref)
    for block in ours.blocks:
        fully_shard(block)
    fully_shard(ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    x, y = lm_batch(0)
    lm_loss(ours(x), y).backward()  # one whole iteration first: the root is initialised
    lm_loss(ref(x), y).backward()
    for m, o in zip((ref, ours), opts):
        o.step()
        o.zero_grad()
    ours.blocks[1].fail = where
    with pytest.raises(ValueError, match=f"planted in {where}"):
        lm_loss(ours(x), y).backward()
    ours.blocks[1].fail = None
    for o in opts:
        o.zero_grad()
    with pytest.raises(RuntimeError, match="reset_iter_state: .* is not the root"):
        ours.blocks[0].reset_iter_state()
    ours.reset_iter_state()
    root = ours.__dict__["_fsdp_unit"]
    assert all(u.training_state is IDLE for u in root.all_units)
    assert {h.state.name for u in root.all_units for h in u.handles} == {"SHARDED"}
    for step in range(1, 4):
        x, y = lm_batch(step)
        losses = []
        for model, opt in zip((ref, ours), opts):
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1], (step, losses)
    full = impl.full_state_dict(ours)
    assert all(torch.equal(full[n], p) for n, p in ref.named_parameters())

