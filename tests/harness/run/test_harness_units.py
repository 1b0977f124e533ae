"""Fast tier: the harness's pure pieces (no torchrun)."""

from __future__ import annotations

import pytest
import torch

from cases.catalog import CASES, Case, OptimizerSpec, get_case
from cases.data import local_batch
from cases.features import Features
from harness import cli
from harness.judge.diff import DiffStats, compare, owner_of, ulp_distance
from harness.errors import PlanError
from harness.run.plan import Cell, build_plan
from harness.run.snapshot import FORMAT, load_snapshot, save_snapshot
from harness.reference.tolerance import ReductionModel, unit_roundoff


def test_ulp_distance_counts_representable_steps_across_zero():
    one = torch.tensor([1.0])
    up = torch.nextafter(one, torch.tensor([2.0]))
    assert ulp_distance(up, one).item() == 1
    tiny_pos = torch.nextafter(torch.tensor([0.0]), torch.tensor([1.0]))
    tiny_neg = torch.nextafter(torch.tensor([0.0]), torch.tensor([-1.0]))
    assert ulp_distance(tiny_pos, tiny_neg).item() == 2
    assert ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0])).item() == 0


def test_compare_reports_zero_only_when_bitwise_equal():
    a = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    same = compare(a, a.clone())
    assert same == DiffStats(0.0, 0.0, 0, 0, 15) and same.bitwise_equal
    b = a.clone()
    b[2, 1] = torch.nextafter(b[2, 1], torch.tensor(10.0))
    diff = compare(b, a)
    assert diff.num_diff == 1 and diff.max_ulp == 1 and diff.max_abs > 0 and not diff.bitwise_equal


# The reduction and parameter bounds are pinned from both sides in test_tolerance_bounds.py.


def test_a_precision_too_low_to_judge_is_refused_not_passed():
    from harness.judge.checks.base import CheckStats
    from harness.judge.diff import precision_refusal
    from harness.reference.tolerance import MAX_MEDIAN_RELATIVE_TOLERANCE

    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for w, dtype, refused in ((8, torch.float32, False), (8, torch.bfloat16, False), (64, torch.bfloat16, True)):
        model = ReductionModel(w, unit_roundoff(dtype))
        stats = CheckStats(u=model.u)
        stats.add(g.numel(), 0.0, model.grad_bound(g.abs() * 2), g)  # sum |term| / W = 2 |g|
        reason = precision_refusal(stats.summary(), model)
        assert (reason is not None) == refused, (w, dtype, reason)
        if refused:
            assert "cannot verify at this precision" in reason and str(MAX_MEDIAN_RELATIVE_TOLERANCE) in reason


def test_mixed_precision_reduction_uses_the_reduce_dtype_and_counts_the_cast():
    fp32, bf16 = torch.float32, torch.bfloat16
    assert ReductionModel.for_cell(4, 1, bf16, fp32).u == unit_roundoff(fp32)
    assert ReductionModel.for_cell(4, 1, bf16, bf16).u == unit_roundoff(bf16)
    assert ReductionModel.for_cell(4, 2, bf16, fp32).u == unit_roundoff(bf16)  # local accumulation in bf16
    assert ReductionModel.for_cell(4, 1, fp32, bf16).casts == 1
    assert ReductionModel.for_cell(4, 1, fp32, None).casts == 0


def test_local_batch_split_partitions_the_global_batch():
    batch = CASES["mlp"].make_batch(0, 1, 8)
    parts = [local_batch(batch, "split", r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), batch[0])
    assert local_batch(batch, "identical", 3, 4) is batch
    with pytest.raises(ValueError, match="global_batch=8 does not divide by world_size=3"):
        local_batch(batch, "split", 0, 3)


def test_case_validation_names_the_field():
    base = CASES["mlp"]
    with pytest.raises(ValueError, match="global_batch=8 does not divide into grad_accum=3 micro-batches"):
        Case(**{**base.__dict__, "features": Features(grad_accum=3)})
    with pytest.raises(ValueError, match="kind='lion'"):
        OptimizerSpec("lion", lr=1.0)
    with pytest.raises(ValueError, match="unknown case 'nope'"):
        get_case("nope")


def test_standard_plan_has_32_cells_and_references_in_the_first_launch(tmp_path):
    plan = build_plan(out_dir=tmp_path)
    assert len(plan.cells) == 32 and len({c.cell_id for c in plan.cells}) == 32
    assert plan.world_sizes == (1, 2, 4, 8)
    assert [c.is_reference for c in plan.cells_for(1)][:2] == [True, True]
    assert not any(c.is_reference for c in plan.cells_for(2))
    only_two = build_plan(world_sizes=(2,), out_dir=tmp_path)
    assert {c.cell_id for c in only_two.cells_for(2) if c.is_reference} == {"ref.mlp", "ref.transformer"}
    cell = plan.cells[5]
    assert Cell.from_json(cell.to_json()) == cell


def test_fault_copies_add_one_copy_per_fault_where_it_can_act(tmp_path):
    plan = build_plan(cases=("mlp",), impls=("ours", "fsdp2"), world_sizes=(1, 2), data_modes=("split",),
                      fault_copies=("no_grad_average", "dist_scale_1e-5"), out_dir=tmp_path)
    ids = [c.cell_id for c in plan.cells]
    assert len(set(ids)) == len(ids)
    honest = {"mlp.ours.w1.split", "mlp.fsdp2.w1.split", "mlp.ours.w2.split", "mlp.fsdp2.w2.split"}
    # impl/'s fault on impl=ours only; the collective fault only where there are collectives (W > 1)
    assert set(ids) == honest | {"mlp.ours.w1.split.no_grad_average", "mlp.ours.w2.split.no_grad_average",
                                 "mlp.ours.w2.split.dist_scale_1e-5", "mlp.fsdp2.w2.split.dist_scale_1e-5"}
    assert {c.faults for c in plan.cells if c.cell_id in honest} == {()}
    assert [r.cell_id for r in plan.references] == ["ref.mlp"]  # one reference judges every copy
    with pytest.raises(PlanError, match="unknown fault"):
        build_plan(cases=("mlp",), fault_copies=("no_such_fault",), out_dir=tmp_path)


def test_an_adapter_with_process_wide_state_gets_a_launch_per_world_size(tmp_path):
    from harness.run.orchestrate import _launch_groups

    apart = "tests/harness/adapters/test_harness_plugins.py:OursProcessPerWorld"
    plan = build_plan(cases=("mlp",), impls=("ours", apart), world_sizes=(1, 2, 4), data_modes=("split",),
                      out_dir=tmp_path)
    groups = [[c.cell_id for c in g] for g in _launch_groups(plan)]
    assert groups == [["ref.mlp", "mlp.ours.w1.split", "mlp.ours.w2.split", "mlp.ours.w4.split"],
                      ["mlp.ours_process_per_world.w1.split"], ["mlp.ours_process_per_world.w2.split"],
                      ["mlp.ours_process_per_world.w4.split"]]
    alone = build_plan(cases=("mlp",), impls=(apart,), world_sizes=(2, 4), data_modes=("split",), out_dir=tmp_path)
    assert [[c.cell_id for c in g] for g in _launch_groups(alone)] == [
        ["ref.mlp", "mlp.ours_process_per_world.w2.split"], ["mlp.ours_process_per_world.w4.split"]]


@pytest.mark.parametrize("kwargs, message", [
    ({"cases": ("nope",)}, "unknown case 'nope'"),
    ({"impls": ("nope",)}, "unknown impl 'nope'"),
    ({"world_sizes": (0,)}, "world_size=0 must be >= 1"),
    ({"cases": ("tests/data/user_case_no_decay.py:make_case",), "world_sizes": (3,)}, "does not run at world_size=3"),
    ({"impls": ("single",)}, "only at world_size=1"),
    ({"faults": ("no_such_fault",)}, "unknown fault"),
])
def test_plan_rejects_bad_input(tmp_path, kwargs, message):
    with pytest.raises(PlanError, match=message):
        build_plan(out_dir=tmp_path, **kwargs)


@pytest.mark.parametrize("argv", [
    ["run", "--cases", "nope"],
    ["run", "--impls", "ours,nope"],
    ["run", "--world-sizes", "0"],
    ["run", "--cases", "tests/data/user_case_no_decay.py:make_case", "--world-sizes", "3"],
    ["run", "--out", "/proc/harness-cannot-write-here"],
    ["run", "--world-sizes", "two"],
    ["run", "--bogus-flag"],
])
def test_cli_bad_input_exits_2_with_one_line_before_any_rank(argv, monkeypatch, capsys):
    import harness.run.orchestrate

    def no_launch(*args, **kwargs):
        raise AssertionError("a rank was launched for bad input")

    monkeypatch.setattr(harness.run.orchestrate, "launch", no_launch)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err, err


def test_snapshot_round_trip_and_refusals(tmp_path):
    snap = {"format": FORMAT, "cell": {"case": "mlp"}, "steps": [{"loss": torch.ones(2), "grads": {"w": torch.zeros(3)}}]}
    save_snapshot(tmp_path / "a.pt", snap)
    back = load_snapshot(tmp_path / "a.pt")
    assert torch.equal(back["steps"][0]["loss"], torch.ones(2))
    torch.save({"format": "other"}, tmp_path / "b.pt")
    with pytest.raises(ValueError, match="not a fsdp-equiv-snapshot"):
        load_snapshot(tmp_path / "b.pt")
    torch.save({"format": FORMAT, "obj": OptimizerSpec("sgd", lr=1.0)}, tmp_path / "c.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported"):
        load_snapshot(tmp_path / "c.pt")  # never unpickles an arbitrary object


def test_owner_of_maps_elements_to_the_rank_holding_them():
    flat = {"kind": "flat", "offset": 10, "shard_numel": 7, "unpadded_numel": 30, "world_size": 5}
    assert owner_of(flat, torch.Size([4, 5]), 0) == 1  # flat index 10 -> rank 1
    assert owner_of(flat, torch.Size([4, 5]), 19) == 4  # flat index 29 -> rank 4
    dim0 = {"kind": "dim0", "rows": 5, "chunk_rows": 2, "world_size": 3}
    assert owner_of(dim0, torch.Size([5, 3]), 3 * 3) == 1  # row 3
    assert owner_of({"kind": "replicated"}, torch.Size([2]), 1) is None


def test_progress_counts_cells_marked_complete_and_reads_records_once_at_the_end(tmp_path, monkeypatch):
    import io
    import json

    import harness.run.orchestrate as orchestrate
    from harness.run.plan import build_plan
    from harness.run.snapshot import complete_path

    plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(1, 2), data_modes=("identical",), steps=2,
                      out_dir=tmp_path / "run")
    cells = [c for w in plan.world_sizes for c in plan.cells_for(w)]
    reads = []
    real = orchestrate.cell_done
    monkeypatch.setattr(orchestrate, "cell_done", lambda p, c: reads.append(c.cell_id) or real(p, c))
    stream = io.StringIO()
    progress = orchestrate.Progress(plan, stream)
    for cell in cells:  # every record on disk, one cell marked by the poller
        path = complete_path(plan.snapshot_dir, cell.cell_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"run_id": plan.run_id, "cell_id": cell.cell_id}))
    progress.mark(cells[0])
    for _ in range(5):
        progress.update(1)
    assert reads == [] and f"1/{len(progress.all_cells)} cells done" in stream.getvalue()
    progress.update(2, recount=True)
    assert sorted(reads) == sorted(c.cell_id for c in progress.all_cells)
    assert stream.getvalue().splitlines()[-1].startswith(f"[harness] {len(cells)}/{len(progress.all_cells)} cells done")


def test_split_batch_grows_to_a_multiple_every_world_size_divides(tmp_path):
    """--world-sizes 3 splits the standard cases evenly: the case runs, reference included, on the
    least multiple of its global batch that every split world size (times grad_accum) divides."""
    plan = build_plan(cases=("mlp", "grad_accumulation"), impls=("ours",), world_sizes=(1, 2, 3), out_dir=tmp_path)
    assert {c.case for c in plan.cells} == {"mlp@batch=24", "grad_accumulation@batch=24"}  # lcm(8, 3, 2 x 3 M=2)
    assert {c.case for c in plan.references} == {"mlp@batch=24", "grad_accumulation@batch=24"}
    assert any("global batch 8 -> 24" in n for n in plan.notes)
    case = get_case("mlp@batch=24")
    assert (case.global_batch, case.name) == (24, "mlp_batch24")
    assert case.make_batch(case.seed, 1, case.global_batch)[0].shape[0] == 24
    five = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(5, 7), data_modes=("split",), out_dir=tmp_path)
    assert {c.case for c in five.cells} == {"mlp@batch=280"}
    # Identical data, or world sizes the batch divides: the case as declared.
    same = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(1, 2, 4, 8), out_dir=tmp_path)
    assert {c.case for c in same.cells} == {"mlp"} and not any("global batch" in n for n in same.notes)
    identical = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(3,), data_modes=("identical",),
                           out_dir=tmp_path)
    assert {c.case for c in identical.cells} == {"mlp"}


def test_a_case_whose_batch_cannot_grow_is_refused(tmp_path):
    """A make_batch that ignores the global batch it is asked for is refused before any rank starts."""
    fixed = tmp_path / "fixed_batch.py"
    fixed.write_text(
        "import torch\n"
        "from cases.catalog import CASES\n"
        "import dataclasses\n"
        "def make_case():\n"
        "    base = CASES['mlp']\n"
        "    def eight(seed, step, global_batch):\n"
        "        return base.make_batch(seed, step, 8)\n"
        "    return dataclasses.replace(base, name='fixed_batch', make_batch=eight)\n")
    with pytest.raises(PlanError, match="shape \\(8, 13\\); dim 0 must be the batch \\(global_batch=24\\)"):
        build_plan(cases=(f"{fixed}:make_case",), impls=("ours",), world_sizes=(1, 3), out_dir=tmp_path)


def test_the_timeout_grows_with_the_models_unless_given(tmp_path):
    """[Note: Timeout by size]: per world size, 600 s plus 5 us per parameter x step of each of its
    cells (the references with the smallest); --timeout as given."""
    from harness.run.plan import DEFAULT_TIMEOUT_S, SECONDS_PER_PARAMETER_STEP, num_parameters

    plan = build_plan(cases=("mlp", "transformer"), impls=("ours", "fsdp2"), world_sizes=(1, 2), data_modes=("split",),
                      steps=3, out_dir=tmp_path)
    params = {c: num_parameters(c) for c in ("mlp", "transformer")}
    # W = 1: the two references and ours, fsdp2 of each case; W = 2: ours, fsdp2 of each
    assert plan.timeout_for(1) == pytest.approx(DEFAULT_TIMEOUT_S + SECONDS_PER_PARAMETER_STEP * 3 * 3 * sum(params.values()))
    assert plan.timeout_for(2) == pytest.approx(DEFAULT_TIMEOUT_S + SECONDS_PER_PARAMETER_STEP * 3 * 2 * sum(params.values()))
    given = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(1, 2), steps=3, out_dir=tmp_path, timeout_s=42.0)
    assert (given.timeout_for(1), given.timeout_for(2)) == (42.0, 42.0)
    # GPT-2 small, 2 steps, its reference and one cell at W = 2: over an hour, where 600 s ran out
    assert DEFAULT_TIMEOUT_S + SECONDS_PER_PARAMETER_STEP * 2 * 2 * 123.7e6 > 3000


def test_a_case_asking_for_offload_is_refused_where_the_shards_are_not_on_the_cpu():
    from types import SimpleNamespace

    import torch

    from harness.adapters.base import RawShard
    from harness.run.worker import _check_offloaded

    def adapter(device):
        return SimpleNamespace(name="stub", raw_shards=lambda model: [
            RawShard(key="w", data=torch.empty(4, device=device), grad=None, padding_intervals=())])
    _check_offloaded(adapter("cpu"), None, SimpleNamespace(rank=0))
    with pytest.raises(RuntimeError, match="asked for CPU offload .* on \\['meta'\\]: the policy was not applied"):
        _check_offloaded(adapter("meta"), None, SimpleNamespace(rank=0))


def test_a_tie_across_units_must_be_refused_at_the_wrap_or_at_the_first_forward():
    """The tied_embeddings case's check (`_check_refused_wrap`): impl refuses its tok_emb and head
    as separate units at the root's first forward, as FSDP2 does, and passes; an implementation
    that wraps them and runs forward (the plain model, planted) is an error naming the case."""
    import pytest

    from cases.catalog import get_case
    from harness.adapters import RankContext
    from harness.adapters.registry import resolve_impl
    from harness.run.worker import _check_refused_wrap

    case = get_case("tied_embeddings")
    ctx = RankContext(0, 1, None)
    _check_refused_wrap(case, resolve_impl("ours"), ctx)
    with pytest.raises(RuntimeError, match=r"case=tied_embeddings: wrapping \['tok_emb', 'head'\] as separate units "
                                           r"was accepted and ran forward"):
        _check_refused_wrap(case, resolve_impl("single"), ctx)
