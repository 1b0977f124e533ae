"""The public Case API (cases/case.py, cases/data.py), fast and in-process: wrap resolution,
pytree batches, parameter groups, scheduled learning rates in the shadow's record."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.case import Case, OptimizerSpec, ParamGroup, resolve_wrap
from cases.data import batch_size, call_model, local_batch, micro_batches
from harness.adapters.features import floating_output
from harness.reference.shadow import Shadow


class Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x)


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Leaf()
        self.out = nn.Linear(3, 3)

    def forward(self, x):
        return self.out(self.inner(x))


class Tree(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = Branch(), Leaf(), nn.Linear(3, 2)

    def forward(self, x, scale=1.0):
        return {"y": self.head(self.b(self.a(x))) * scale}


def test_wrap_paths_keep_their_order_and_classes_and_policies_wrap_children_before_parents():
    model = Tree()
    assert resolve_wrap(("b", "a.inner"), model) == ("b", "a.inner")
    assert resolve_wrap((Leaf,), model) == ("a.inner", "b")
    assert resolve_wrap((Branch, Leaf), model) == ("a.inner", "a", "b")  # the nested unit first
    assert resolve_wrap(lambda fqn, m: isinstance(m, nn.Linear) and fqn.endswith("fc"), model) == ("a.inner.fc", "b.fc")
    with pytest.raises(ValueError, match="'c' is not a sub-module of Tree"):
        resolve_wrap(("c",), model)
    with pytest.raises(ValueError, match=r"wrap classes \['Conv2d'\] match no sub-module"):
        resolve_wrap((nn.Conv2d,), model)


def test_a_pytree_batch_splits_every_tensor_along_dim_0_and_keeps_other_leaves():
    x, mask, y = torch.arange(24.0).view(8, 3), torch.ones(8, 5), torch.arange(8)
    batch = ({"x": x, "mask": mask, "flag": True}, (y, None))
    assert batch_size(batch) == 8
    inputs, (targets, nothing) = local_batch(batch, "split", 2, 4)
    assert torch.equal(inputs["x"], x[4:6]) and torch.equal(inputs["mask"], mask[4:6]) and inputs["flag"] is True
    assert torch.equal(targets, y[4:6]) and nothing is None
    assert local_batch(batch, "identical", 3, 4) is batch
    parts = micro_batches(batch, 2)
    assert [torch.equal(p[0]["x"], x[4 * i : 4 * i + 4]) for i, p in enumerate(parts)] == [True, True]
    with pytest.raises(ValueError, match="do not share one dim 0"):
        batch_size(({"x": x, "other": torch.ones(7, 2)}, y))


def test_inputs_reach_the_model_as_one_argument_positional_or_keyword_and_outputs_keep_their_type():
    model = Tree()
    x = torch.randn(4, 3)
    expected = model(x, 2.0)["y"]
    assert torch.equal(call_model(model, {"x": x, "scale": 2.0})["y"], expected)
    assert torch.equal(call_model(model, (x, 2.0))["y"], expected)
    assert torch.equal(call_model(model, x)["y"], model(x)["y"])
    cast = floating_output({"y": expected.bfloat16(), "ids": torch.arange(3)})
    assert cast["y"].dtype == torch.float32 and cast["ids"].dtype == torch.int64


def test_param_groups_assign_each_name_to_its_first_matching_group_and_a_flat_parameter_must_hold_one():
    spec = OptimizerSpec("adamw", lr=1e-3, weight_decay=0.1,
                         param_groups=(ParamGroup(("*.bias",), weight_decay=0.0), ParamGroup(("a.*",), lr=1e-2)))
    assert [spec.group_index(n) for n in ("a.out.bias", "a.out.weight", "head.weight")] == [0, 1, 2]
    model = Tree()
    optim = spec.build_grouped(((n,), p) for n, p in model.named_parameters())
    hyper = [(g["lr"], g["weight_decay"], len(g["params"])) for g in optim.param_groups]
    assert hyper == [(1e-3, 0.0, 4), (1e-2, 0.1, 2), (1e-3, 0.1, 2)], hyper
    flat = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="several param groups .*a flat parameter has one learning rate"):
        spec.build_grouped([(("b.fc.weight", "b.fc.bias"), flat)])
    with pytest.raises(ValueError, match="has param_groups: build it with build_grouped"):
        spec.build(model.parameters())


def test_an_unsupported_optimizer_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match=r"kind='adam' has no error model; use OptimizerSpec\('sgd'"):
        OptimizerSpec("adam", lr=1e-3)
    with pytest.raises(ValueError, match="optimizers\\[0\\] is Adam, which has no error model"):
        Case(name="c", description="", build_model=Tree, wrap=(), make_batch=lambda s, t, b: None,
             loss_fn=F.mse_loss, optimizers=(torch.optim.Adam,))
    with pytest.raises(ValueError, match="param_groups\\[0\\] lr=-1"):
        OptimizerSpec("sgd", lr=0.1, param_groups=(ParamGroup(("*",), lr=-1.0),))


def test_the_shadow_records_each_steps_scheduled_lr_and_each_groups_hyperparameters():
    spec = OptimizerSpec("sgd", lr=0.1, momentum=0.5, param_groups=(ParamGroup(("head.*",), lr=0.3, momentum=0.0),),
                         lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))

    def make_batch(seed, step, global_batch):
        g = torch.Generator().manual_seed(step)
        return torch.randn(global_batch, 3, generator=g), torch.randn(global_batch, 2, generator=g)

    case = Case(name="c", description="", build_model=Tree, wrap=(Leaf,), make_batch=make_batch,
                loss_fn=lambda out, y: F.mse_loss(out["y"], y), optimizers=(spec,), global_batch=4,
                world_sizes=(1, 2))
    model = Tree()
    shadow = Shadow(case, spec, model.state_dict())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    lrs = []
    for step in (1, 2, 3):
        record = shadow.step(params, make_batch(0, step, 4), "split", 2)
        params = record["params"]
        lrs.append((record["hyper"]["a.out.weight"]["lr"], record["hyper"]["head.bias"]["lr"]))
        assert record["hyper"]["a.out.weight"]["momentum"] == 0.5 and record["hyper"]["head.bias"]["momentum"] == 0.0
    assert lrs == [(0.1, 0.3), (0.05, 0.15), (0.025, 0.075)], lrs
