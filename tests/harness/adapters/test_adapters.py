"""The adapter interface (harness/adapters/base.py): defaults, declared padding, validated layouts,
skip reasons, names (fast tier: torch FSDP1 in this process on a one-rank gloo group).

The planted adapters below are loaded by the harness as user implementations
(`tests/harness/adapters/test_adapters.py:NAME`); each breaks one declaration of the honest `fsdp1` adapter.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist

from cases.catalog import get_case
from harness.adapters import FSDP1, Adapter, Padding, RankContext, RawShard
from harness.adapters.ours import Ours
from harness.adapters.registry import resolve_impl
from harness.judge.diff import check_snapshot
from harness.judge.result import Violation
from harness.judge.layouts import LayoutError, check_layouts
from harness.run.evidence import model_parameters
from harness.run.orchestrate import write_init_states
from harness.run.plan import build_plan
from harness.run.snapshot import load_init
from harness.run.worker import run_cell

HERE = Path(__file__).resolve()
STEPS = 2


class DeclaresZeroPadding(FSDP1):
    """fsdp1 claiming zero padding: FSDP1 fills its alignment padding with 42."""

    name = "declares_zero_padding"
    param_padding = Padding.ZERO

    def __init__(self):
        super().__init__("FULL_SHARD", self.name)


class ShiftedLayout(FSDP1):
    """fsdp1 whose layout of one parameter is one element off."""

    name = "shifted_layout"
    SHIFTED = "layers.1.weight"

    def __init__(self):
        super().__init__("FULL_SHARD", self.name)

    def layouts(self, model):
        out = super().layouts(model)
        out[self.SHIFTED] = {**out[self.SHIFTED], "offset": out[self.SHIFTED]["offset"] + 1}
        return out


class PaddingOverParameter(FSDP1):
    """fsdp1 declaring the first element of every shard padding (a parameter's element)."""

    name = "padding_over_parameter"

    def __init__(self):
        super().__init__("FULL_SHARD", self.name)

    def raw_shards(self, model):
        return [RawShard(s.key, s.data, s.grad, ((0, 1),) + s.padding_intervals) for s in super().raw_shards(model)]


class MinimalFSDP2(Adapter):
    name = "minimal_fsdp2"

    def wrap(self, model, wrap_paths, ctx):
        from torch.distributed.fsdp import fully_shard

        for path in wrap_paths:
            fully_shard(model.get_submodule(path))
        return fully_shard(model)


class NotAnAdapter:
    name = "not_an_adapter"

    def wrap(self, model, wrap_paths, ctx):
        return model


class Nameless(Adapter):
    def wrap(self, model, wrap_paths, ctx):
        return model


class ClaimsABuiltinName(Adapter):
    name = "fsdp2"

    def wrap(self, model, wrap_paths, ctx):
        return model


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A one-rank gloo group in this process: FSDP1 wants torch.distributed initialised even at W = 1."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield RankContext(0, 1, dist.group.WORLD)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def evidence(tmp_path_factory, one_rank_group):
    """(snapshot per impl, reference, initial state): mlp with SGD at W = 1, run by the rank code."""
    out = tmp_path_factory.mktemp("adapters") / "out"
    impls = ("fsdp1",) + tuple(f"{HERE}:{cls.__name__}" for cls in (DeclaresZeroPadding, ShiftedLayout,
                                                                       PaddingOverParameter))
    plan = build_plan(cases=("mlp",), impls=impls, world_sizes=(1,), data_modes=("identical",), steps=STEPS,
                      out_dir=out)
    write_init_states(plan)
    init, _ = load_init(plan.init_dir / "mlp.pt", plan.run_id)
    spec = get_case("mlp").optimizer("sgd")
    (ref_cell,) = plan.references
    ref = run_cell(ref_cell, spec, init, RankContext(0, 1, None), out / "scratch")
    snaps = {cell.impl_label: run_cell(cell, spec, init, one_rank_group, out / "scratch") for cell in plan.cells}
    return snaps, ref, init


def _sizes():
    return model_parameters("mlp")[0]


def test_honest_fsdp1_exposes_its_raw_shards_and_passes_with_its_padding_declared(evidence):
    snaps, ref, init = evidence
    snap = snaps["fsdp1"]
    assert snap["padding"] == {"params": "unspecified", "grads": "zero"}
    check_layouts(snap, _sizes())  # raises on a contradiction
    assert set(snap["layouts"]) == set(_sizes()), "every parameter's layout is given"
    shards = snap["steps"][0]["shards"]
    intervals = snap["steps"][0]["padding_intervals"]
    # FSDP1's alignment padding holds 42: the convention the adapter declares UNSPECIFIED.
    fills = {rows[0, a:b].unique().tolist()[0] for key, rows in shards.items() for a, b in intervals[key][0]}
    assert 42.0 in fills, fills
    result = check_snapshot(snap, init, ref)
    assert result.violations == [] and result.error is None
    assert result.checks["padding"]["elements"] > 0, "the gradients' zero padding is compared"


def test_declaring_zero_padding_fails_the_padding_check_on_fsdp1s_42(evidence):
    snaps, ref, init = evidence
    snap = snaps["declares_zero_padding"]
    check_layouts(snap, _sizes())
    result = check_snapshot(snap, init, ref)
    first = min(result.violations, key=Violation.sort_key)
    assert (first.check, first.step, first.rank, first.in_padding, first.actual) == ("padding", 1, 0, True, 42.0), \
        first.describe("planted")


def test_a_valid_layout_whose_shards_differ_from_the_full_parameter_is_a_mismatch_the_cell_fails_for(evidence):
    """Structurally valid, but its slice of the raw shards is not the gathered parameter: the
    implementation's state contradicts itself (or the layout misplaces it), a fail, not an error."""
    snaps, _, _ = evidence
    snap = copy.deepcopy(snaps["fsdp1"])
    rec = snap["steps"][0]
    layout = snap["layouts"]["layers.1.weight"]
    rows = rec["shards"][layout["flat_key"]]
    at = int(layout["offset"]) + 3  # the parameter's element 3, in whichever rank's shard holds it
    rows.view(-1)[at] += 0.5  # the shard nudged, the gathered parameter left as it was
    found = check_layouts(snap, _sizes())
    assert [(m.step, m.name, m.index, m.count, m.rank) for m in found] == [
        (1, "layers.1.weight", 3, 1, at // rows.shape[1])], found
    m = found[0]
    assert m.shard == m.full + 0.5 or abs(m.shard - m.full - 0.5) < 1e-6, m
    from harness.judge.verdict import _add_gathered_mismatches
    from harness.judge.diff import OptimizerResult

    opt = OptimizerResult("sgd")
    _add_gathered_mismatches(opt, "sgd", found)
    text = opt.violations[0].describe("cell")
    assert opt.verdict.value == "fail" and "the gathered full parameter holds" in text and f"rank {m.rank}'s raw shard" in text
    assert check_layouts(snaps["fsdp1"], _sizes()) == []


def test_a_layout_one_element_off_reaches_the_padding_and_is_an_error_naming_the_parameter(evidence):
    snaps, _, _ = evidence
    with pytest.raises(LayoutError, match=r"padding interval .* covers elements of 'layers.1.weight'"):
        check_layouts(snaps["shifted_layout"], _sizes())


def test_a_padding_interval_over_a_parameter_is_an_error_naming_it(evidence):
    snaps, _, _ = evidence
    with pytest.raises(LayoutError, match=r"rank 0's padding interval \[0, 1\) of '.*' covers elements of '.*'"):
        check_layouts(snaps["padding_over_parameter"], _sizes())


def test_unknown_layout_kinds_and_names_are_errors(evidence):
    snap = copy.deepcopy(evidence[0]["fsdp1"])
    snap["layouts"]["layers.0.bias"] = {"kind": "rows"}
    with pytest.raises(LayoutError, match="layout of 'layers.0.bias' has kind='rows'"):
        check_layouts(snap, _sizes())
    snap = copy.deepcopy(evidence[0]["fsdp1"])
    snap["layouts"]["layers.9.weight"] = snap["layouts"]["layers.0.weight"]
    with pytest.raises(LayoutError, match="'layers.9.weight', which is not a parameter"):
        check_layouts(snap, _sizes())


def test_flat_layouts_need_raw_shards_and_raw_shards_need_no_layouts(evidence):
    """[Note: Adapter protocol]: a flat layout is checked against the raw shards it names, so
    without them it is an error saying so; raw shards alone keep their padding checked."""
    snaps, ref, init = evidence
    no_shards = copy.deepcopy(snaps["fsdp1"])
    for rec in no_shards["steps"]:
        rec["shards"], rec["shard_grads"], rec["padding_intervals"] = {}, {}, {}
    with pytest.raises(LayoutError, match="is a flat layout, but the adapter gives no raw_shards"):
        check_layouts(no_shards, _sizes())
    no_layouts = copy.deepcopy(snaps["fsdp1"])
    no_layouts["layouts"] = {}
    for rec in no_layouts["steps"]:
        rec.pop("layouts", None)
    check_layouts(no_layouts, _sizes())
    result = check_snapshot(no_layouts, init, ref)
    assert result.violations == [] and result.error is None
    assert result.checks["padding"]["elements"] > 0


def test_a_minimal_adapter_is_skipped_with_the_features_it_does_not_map(tmp_path):
    plan = build_plan(cases=("mlp", "grad_accumulation"), impls=(f"{HERE}:MinimalFSDP2",), world_sizes=(2,),
                      data_modes=("split",), out_dir=tmp_path / "out")
    assert [c.cell_id for c in plan.cells] == ["mlp.minimal_fsdp2.w2.split"]
    ((cell, reason),) = plan.skipped
    assert cell.case == "grad_accumulation"
    assert "adapter 'minimal_fsdp2' maps none of the case's features (grad_accum=2)" in reason, reason


@pytest.mark.parametrize("attr, message", [
    ("NotAnAdapter", "is not a subclass of harness.adapters.Adapter"),
    ("Nameless", "Nameless.name='' must be a non-empty name"),
    ("ClaimsABuiltinName", "name='fsdp2' is a built-in implementation's name"),
])
def test_adapters_the_registry_refuses(attr, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        resolve_impl(f"{HERE}:{attr}")


def test_every_builtin_impl_is_named_by_its_registry_key():
    from harness.adapters.registry import BUILTIN_IMPLS

    assert {key: factory().name for key, factory in BUILTIN_IMPLS.items()} == {key: key for key in BUILTIN_IMPLS}


def test_builtin_fsdp1_variants_are_named_by_their_strategy():
    for name, strategy in (("fsdp1", "FULL_SHARD"), ("fsdp1_grad_op", "SHARD_GRAD_OP"),
                           ("fsdp1_no_shard", "NO_SHARD"), ("fsdp1_hybrid", "HYBRID_SHARD")):
        adapter = resolve_impl(name)
        assert (adapter.name, adapter.strategy) == (name, strategy)


def test_the_deepspeed_config_states_clipping_and_precision_explicitly():
    from harness.adapters.deepspeed import deepspeed_config

    config = deepspeed_config(stage=3, world_size=4)
    assert config["gradient_clipping"] == 0.0  # DeepSpeed never clips unless a case asks for it
    assert config["fp16"] == {"enabled": False} and config["bf16"] == {"enabled": False}
    assert config["communication_data_type"] == "fp32" and config["prescale_gradients"] is False
    assert config["train_batch_size"] == 4 and config["zero_optimization"]["stage"] == 3
    reason = resolve_impl("deepspeed_zero3").unsupported(get_case("clip_grad_norm").features)
    assert "clip_norm_type=2.0" in reason and "clip_max_norm" in reason, reason


def test_deepspeed_missing_is_a_skip_reason_not_a_crash(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    assert resolve_impl("deepspeed_zero1").unsupported(get_case("mlp").features) == \
        "deepspeed is not installed (pip install -e .[deepspeed])"


class SkipsGroups(Ours):
    """Planted: wraps as ours does but leaves Features.wrap_groups out (the same numbers, one unit less)."""

    name = "skips_groups"

    def wrap(self, model, wrap_paths, ctx):
        return super().wrap(model, wrap_paths, replace(ctx, features=replace(ctx.features, wrap_groups=())))


@pytest.mark.parametrize("impl", ["ours", "fsdp2", f"{HERE}:SkipsGroups"])
def test_a_group_of_modules_is_one_unit_or_the_cell_is_an_error(tmp_path, one_rank_group, impl):
    """tied_embeddings_grouped at W = 1: ours and FSDP2 hold [tok_emb, head] in one unit of their own;
    an adapter that leaves the group out is stopped before training (its layouts show the head in
    the root's unit), not passed on values that cannot tell the difference."""
    plan = build_plan(cases=("tied_embeddings_grouped",), impls=(impl,), world_sizes=(1,), data_modes=("split",),
                      steps=1, out_dir=tmp_path / "out")
    write_init_states(plan)
    init, buffers = load_init(plan.init_dir / "tied_embeddings_grouped.pt", plan.run_id)
    case = get_case("tied_embeddings_grouped")
    (cell,) = plan.cells
    if impl.endswith("SkipsGroups"):
        with pytest.raises(RuntimeError, match=r"as one unit .* the group was not applied"):
            run_cell(cell, case.optimizers[0], init, one_rank_group, tmp_path / "scratch", buffers)
        return
    snap = run_cell(cell, case.optimizers[0], init, one_rank_group, tmp_path / "scratch", buffers)
    if impl == "ours":
        units = {name: layout["unit"] for name, layout in snap["layouts"].items()}
        assert units["tok_emb.weight"] == units["head.weight"] == "tok_emb", units
        assert {units["pos_emb.weight"], units["ln_f.weight"]} == {"<root>"}, units
    else:
        from torch.distributed.fsdp import fully_shard

        model = resolve_impl(impl).wrap(case.build_model(), case.wrap_paths(case.build_model()),
                                        replace(one_rank_group, features=case.features))
        assert fully_shard.state(model.tok_emb) is fully_shard.state(model.head) is not fully_shard.state(model)
