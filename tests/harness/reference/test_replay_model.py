"""Replay models built on the meta device ([Note: Replay models from the meta device] in
harness/reference/shadow.py): the same modules, parameters (ties kept), buffers and bits as a real build
followed by the load of the initial state; built for real wherever the meta build would leave
anything behind or cannot know a value."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from cases.catalog import get_case
from harness.reference import shadow
from harness.run.snapshot import build_init


def _real(case, state, buffers) -> nn.Module:
    model = case.build_model()
    model.load_state_dict(state)
    shadow.load_nonpersistent_buffers(model, buffers)
    return model


def _ties(model: nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(groups.values())


def _assert_same_model(got: nn.Module, want: nn.Module) -> None:
    assert [type(m) for m in got.modules()] == [type(m) for m in want.modules()]
    assert _ties(got) == _ties(want)
    got_p = dict(got.named_parameters(remove_duplicate=False))
    for name, p in want.named_parameters(remove_duplicate=False):
        q = got_p[name]
        assert isinstance(q, nn.Parameter) and q.requires_grad == p.requires_grad, name
        assert q.dtype == p.dtype and q.shape == p.shape and q.stride() == p.stride(), name
        assert torch.equal(q.view(torch.uint8) if q.numel() else q, p.view(torch.uint8) if p.numel() else p), name
    got_b = dict(got.named_buffers())
    assert set(got_b) == {n for n, _ in want.named_buffers()}
    for name, b in want.named_buffers():
        assert got_b[name].dtype == b.dtype and torch.equal(got_b[name], b), name


CASES = ["mlp", "transformer", "tied_embeddings", "mixed_precision"]
if importlib.util.find_spec("transformers") is not None:
    CASES += ["gpt2", "llama", "moe", "t5"]


@pytest.mark.parametrize("name", CASES)
def test_a_replay_model_from_meta_is_the_real_build_with_its_state_loaded(name):
    case = get_case(name)
    state, buffers = build_init(case)
    assert shadow._meta_built(case, torch.device("cpu"), set(buffers)) is not None  # the meta path is taken
    _assert_same_model(shadow.replay_model(case, state, buffers, torch.device("cpu")), _real(case, state, buffers))


def test_a_buffer_model_keeps_every_buffer_value():
    case = get_case(f"{Path(__file__).resolve().parents[2]}/data/user_case_buffers.py:make_case")
    state, buffers = build_init(case)
    _assert_same_model(shadow.replay_model(case, state, buffers, torch.device("cpu")), _real(case, state, buffers))


class _TableAttribute(nn.Module):
    """A tensor that is neither parameter nor buffer: a meta build would leave it without values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.table = torch.arange(4.0)

    def forward(self, x):
        return self.fc(x) * self.table


class _DeviceAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.where = self.fc.weight.device


class _NonPersistent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(4), persistent=False)


class _ValueInInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = float(self.fc.weight.abs().max())  # needs a value: raises on meta


class _LazyParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.LazyLinear(4)


def _case_of(cls):
    return replace(get_case("mlp"), name=cls.__name__, build_model=cls)


@pytest.mark.parametrize("cls", [_TableAttribute, _DeviceAttribute, _ValueInInit, _LazyParameter])
def test_a_model_the_meta_build_cannot_give_whole_is_built_for_real(cls):
    case = _case_of(cls)
    assert shadow._meta_built(case, torch.device("cpu"), set()) is None
    if cls is _LazyParameter:
        return
    torch.manual_seed(0)
    model = cls()
    state, buffers = model.state_dict(), dict(model.named_buffers())
    replay = shadow.replay_model(case, state, buffers, torch.device("cpu"))
    _assert_same_model(replay, _real(case, state, buffers))
    if cls is _TableAttribute:
        assert not replay.table.is_meta and torch.equal(replay.table, torch.arange(4.0))
    if cls is _DeviceAttribute:
        assert replay.where.type == "cpu"


def test_a_non_persistent_buffer_without_a_given_value_is_built_for_real():
    case = _case_of(_NonPersistent)
    assert shadow._meta_built(case, torch.device("cpu"), set()) is None  # "mask" not given
    assert shadow._meta_built(case, torch.device("cpu"), {"mask"}) is not None
    replay = shadow.replay_model(case, _NonPersistent().state_dict(), None, torch.device("cpu"))
    assert torch.equal(replay.mask, torch.ones(4))
