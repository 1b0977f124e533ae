"""A cell judged by its own rank 0 ([Note: Judged where the evidence lives] in
harness/run/judged.py) gets the verdict its snapshot gets in the parent, bit for bit: every margin,
violation, first divergence, per-step worst element and trajectory figure; and it leaves a record
of a few kilobytes, no snapshot.

One plan runs both ways: honest cells of two cases at W = 1, 2 and 4 in both data modes, and a
copy of each with a planted fault (a 1e-5 gradient scale, and gradient padding left non-zero: the
grad, param, bias, padding and trajectory checks fail). The launch is shared by the tests here."""

from __future__ import annotations

import math

import pytest
import torch

from harness.judge.result import first_of
from harness.judge.verdict import evaluate
from harness.run.orchestrate import run_plan
from harness.run.plan import build_plan
from harness.verbs.common import plan_from_args
from harness.run.snapshot import judged_path, load_judged, snapshot_path

CASES = ("mlp", "uneven_tiny")
FAULTS = ("grad_scale_1e-5", "grad_padding_garbage")


def _run(tmp_path, judge_on: str, cases=CASES, impls=("ours",), world_sizes=(1, 2, 4), steps=3, fault_copies=FAULTS):
    plan = build_plan(cases=cases, impls=impls, world_sizes=world_sizes, data_modes=None, steps=steps,
                      out_dir=tmp_path / judge_on, fault_copies=fault_copies, judge_on=judge_on)
    torch.set_num_threads(1)  # as `harness run` judges
    outcome = run_plan(plan)
    cells, references, matrices = evaluate(plan, outcome)
    return plan, {r.cell.cell_id: r for r in references + cells}, matrices


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("judged_on_ranks")
    return _run(tmp, "parent"), _run(tmp, "ranks")


def _same(a: float, b: float) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_every_verdict_margin_and_violation_is_the_parents(both):
    (_, parent, _), (plan, ranks, _) = both
    assert plan.judged_on_ranks == CASES
    verdicts = {str(r.verdict) for r in parent.values()}
    assert verdicts == {"pass", "fail"}, verdicts  # the comparison covers failing cells too
    _assert_same_results(parent, ranks)
    failing = [r for r in ranks.values() if str(r.verdict) == "fail"]
    assert {v.check for r in failing for v in r.violations} >= {"grad", "param", "padding", "trajectory"}
    # the evidence around a failing element travels in the record: the report shows it
    scaled = ranks["mlp.ours.w2.split.grad_scale_1e-5"]
    hood, first = next((o.neighbourhood, first_of(o.violations)) for o in scaled.optimizers.values() if o.neighbourhood)
    assert (hood["step"], hood["check"], hood["name"], hood["index"]) == (first.step, first.check, first.name, first.index)
    at = hood["index"] - hood["start"]
    assert hood["rows"]["grad"][at] == first.actual and hood["rows"]["replay grad"][at] == first.expected


@pytest.mark.parametrize("case", ["mlp", "transformer", "tied_embeddings", "grad_accumulation", "batchnorm"])
def test_a_reference_whose_team_shares_its_perturbed_runs_is_judged_as_the_parent_judges_it(tmp_path_factory, case):
    """The smallest world size 2: the reference cell runs in a team of two, whose rank 1 steps the
    perturbed runs beside rank 0, around the reference parameters rank 0 sends it each step
    (harness/run/worker.py ReferenceFeed); the envelope, hence every trajectory margin, is the
    parent's bit for bit: with reordered replays that deviate (transformer), float64 sums of
    several terms (tied uses, micro-batches) and buffers a forward updates (batchnorm)."""
    tmp = tmp_path_factory.mktemp("judged_shared_envelope")
    args = dict(cases=(case,), world_sizes=(2,), steps=3, fault_copies=("grad_scale_1e-6",))
    (_, parent, _), (_, ranks, _) = _run(tmp, "parent", **args), _run(tmp, "ranks", **args)
    _assert_same_results(parent, ranks)
    assert all(o.checks["trajectory"]["elements"] > 0 for r in ranks.values() if not r.cell.is_reference
               for o in r.optimizers.values())


def test_an_honest_reordering_is_judged_as_the_parent_judges_it(tmp_path_factory):
    """torch FSDP2 on T5 reorders its local backward from step 1 ([Note: Reordered accumulation]):
    judged on the rank, the replay runs its reordered replays only when the judge needs them
    (Shadow.step reorder=False), and the allowance it then computes is the parent's, bit for bit."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("judged_reordered")
    args = dict(cases=("t5",), impls=("fsdp2",), world_sizes=(2,), steps=2, fault_copies=())
    (_, parent, _), (_, ranks, _) = _run(tmp, "parent", **args), _run(tmp, "ranks", **args)
    _assert_same_results(parent, ranks)
    cells = [r for r in ranks.values() if not r.cell.is_reference]
    assert cells and all(str(r.verdict) == "pass" for r in cells)
    assert all(o.checks["bias"].get("not_applied_from") for r in cells for o in r.optimizers.values())


def _assert_same_results(parent: dict, ranks: dict) -> None:
    assert set(parent) == set(ranks)
    for cell_id, p in parent.items():
        r = ranks[cell_id]
        assert (r.verdict, r.error) == (p.verdict, p.error), cell_id
        assert set(r.optimizers) == set(p.optimizers), cell_id
        for kind, po in p.optimizers.items():
            ro = r.optimizers[kind]
            assert [v.to_json() for v in ro.violations] == [v.to_json() for v in po.violations], (cell_id, kind)
            assert all(_same(ro.margins[c], po.margins[c]) for c in po.margins), (cell_id, kind, ro.margins, po.margins)
            for field in ("checks", "step_checks", "per_step", "losses", "trajectory", "stopped_after", "neighbourhood"):
                assert repr(getattr(ro, field)) == repr(getattr(po, field)), (cell_id, kind, field)


def test_the_matrices_agree_wherever_the_records_can_say(both):
    (_, _, parent), (_, _, ranks) = both
    assert len(parent) == len(ranks)
    known = 0
    for p, r in zip(parent, ranks):
        assert (p.case, p.impl, p.data_mode, p.optimizer, p.labels) == (r.case, r.impl, r.data_mode, r.optimizer, r.labels)
        for prow, rrow in zip(p.values, r.values):
            for pv, rv in zip(prow, rrow):
                if rv is not None:
                    known += 1
                    assert _same(pv, rv), (p, r)
        assert all(_same(p.values[0][j], r.values[0][j]) for j in range(len(p.labels))), p  # vs the reference: exact
    assert known > 0


def test_a_judged_cell_leaves_a_small_record_and_no_snapshot(both):
    _, (plan, _, _) = both
    for cell in plan.references + plan.cells:
        for kind in ("sgd", "adamw"):
            assert not snapshot_path(plan.snapshot_dir, cell.cell_id, kind).exists()
            path = judged_path(plan.snapshot_dir, cell.cell_id, kind)
            assert path.stat().st_size < 64 << 10, (path, path.stat().st_size)
            record = load_judged(path)
            assert record["run_id"] == plan.run_id and record["steps"] == [1, 2, 3]
            assert (record["envelopes"] is not None) == cell.is_reference


def test_auto_judges_big_models_on_the_ranks_unless_the_snapshots_are_asked_for(monkeypatch, tmp_path):
    from harness import cli
    from harness.run import plan as plan_module

    monkeypatch.setattr(plan_module, "JUDGE_ON_RANKS_FROM", 5000)  # mlp (1017) below it, transformer (9648) above
    args = ["run", "--cases", "mlp,transformer", "--impls", "ours", "--world-sizes", "2", "--out", str(tmp_path / "o")]
    assert plan_from_args(cli.build_parser().parse_args(args)).judged_on_ranks == ("transformer",)
    kept = plan_from_args(cli.build_parser().parse_args(args + ["--keep-evidence"]))
    assert kept.judged_on_ranks == ()
    forced = plan_from_args(cli.build_parser().parse_args(args + ["--keep-evidence", "--judge-on", "ranks"]))
    assert forced.judged_on_ranks == ("mlp", "transformer")


def test_frozen_parameters_are_judged_as_the_parent_judges_them(tmp_path_factory):
    """frozen_params' layouts read the raw shards across their rows (a replicated, trainable bias
    beside frozen weights): the rows a rank gathers must be the snapshot's, contiguous and bitwise."""
    tmp = tmp_path_factory.mktemp("judged_frozen")
    args = dict(cases=("frozen_params",), world_sizes=(2,), steps=2, fault_copies=())
    (_, parent, _), (_, ranks, _) = _run(tmp, "parent", **args), _run(tmp, "ranks", **args)
    _assert_same_results(parent, ranks)
    assert all(str(r.verdict) == "pass" for r in ranks.values())


def test_the_shard_checks_judged_on_each_rank_are_the_parents(tmp_path_factory):
    """The raw shards are judged on the rank that holds them and only summaries are gathered
    ([Note: Shards judged where they live] in harness/judge/shards.py): a shard's non-finite
    element, a parameter's non-zero padding and a gathered parameter that contradicts its shards
    (the state-dict gather a slot late) are named as the parent names them from the snapshot's
    rows, with the same element, value, rank and count, at W = 2 and 4 (uneven_tiny's last rank
    holds alignment padding first: the NaN goes to its first element outside it)."""
    tmp = tmp_path_factory.mktemp("judged_shards")
    args = dict(cases=("mlp", "uneven_tiny"), world_sizes=(2, 4), steps=2,
                fault_copies=("grad_nan_one_element", "padding_garbage_at_init", "state_gather_rank_order"))
    (_, parent, _), (plan, ranks, _) = _run(tmp, "parent", **args), _run(tmp, "ranks", **args)
    assert plan.judged_on_ranks == ("mlp", "uneven_tiny")
    _assert_same_results(parent, ranks)
    named = {(r.cell.faults, v.check, v.gathered, v.name.endswith("(grad)"))
             for r in ranks.values() for o in r.optimizers.values() for v in o.violations}
    assert (("grad_nan_one_element",), "nonfinite", False, True) in named  # in a gradient shard
    assert all(str(r.verdict) == "fail" for r in ranks.values() if r.cell.faults == ("grad_nan_one_element",))
    assert any(f == ("padding_garbage_at_init",) and c == "padding" for f, c, _, _ in named)
    assert any(f == ("state_gather_rank_order",) and c == "replicas" and g for f, c, g, _ in named)
