"""The buffers check (harness/judge/checks/buffers.py; [Note: Buffers] in harness/judge/diff.py): honest evidence of a model with
BatchNorm statistics, a persistent and a non-persistent constant passes with every buffer compared
at every step; each planted damage (one ulp, a sign of zero, a NaN, a counter, a constant at init, a
rank's digest, missing evidence) fails or errors naming the check, the step, the buffer and the rank.

Runs in this process (impl=single at W = 1, no torchrun); tests/harness/run/test_harness_runs.py runs the same
model through torchrun with ours and fsdp2 at W = 2 and the planted impl/ fault."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from harness.adapters.base import RankContext
from harness.judge.checks import buffers
from harness.judge.checks.base import CheckStats
from harness.judge.verdict import evaluate
from harness.run.orchestrate import write_init_states
from harness.run.outcome import RunOutcome
from harness.run.plan import build_plan
from harness.run.snapshot import digest, load_init, load_snapshot, save_snapshot, snapshot_path
from harness.run.worker import run_cell

CASE_FILE = Path(__file__).resolve().parents[2] / "data" / "user_case_buffers.py"
CASE = f"{CASE_FILE}:make_case"
STEPS = 3
CELL = "buffers.single.w1.identical"
BUFFERS = {"scale", "blocks.0.mix", "blocks.0.norm.running_mean", "blocks.0.norm.running_var",
           "blocks.0.norm.num_batches_tracked", "blocks.1.mix", "blocks.1.norm.running_mean",
           "blocks.1.norm.running_var", "blocks.1.norm.num_batches_tracked"}


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("buffers") / "out"
    plan = build_plan(cases=(CASE,), impls=("single",), world_sizes=(1,), data_modes=("identical",), steps=STEPS,
                      out_dir=out)
    write_init_states(plan)
    path = plan.init_dir / "buffers.pt"
    init, init_buffers = load_init(path, plan.run_id)
    assert set(init_buffers) == BUFFERS and "scale" not in init  # non-persistent: only in the buffers
    for cell in plan.references + plan.cells:
        snap = run_cell(cell, plan_spec(), init, RankContext(0, 1, None), out / "scratch", init_buffers)
        snap["run_id"] = plan.run_id
        save_snapshot(snapshot_path(plan.snapshot_dir, cell.cell_id, "sgd"), snap)
    return plan


def plan_spec():
    from cases.catalog import get_case

    (spec,) = get_case(CASE).optimizers
    return spec


@pytest.fixture
def run(recorded_run, tmp_path):
    shutil.copytree(recorded_run.out_dir, tmp_path / "out")
    return dataclasses.replace(recorded_run, out_dir=tmp_path / "out")


def _edit(plan, edit, cell_id: str = CELL) -> None:
    path = snapshot_path(plan.snapshot_dir, cell_id, "sgd")
    snap = load_snapshot(path)
    edit(snap)
    save_snapshot(path, snap)


def _result(plan):
    cells, references, _ = evaluate(plan, RunOutcome(plan))
    assert [r.verdict for r in references] == ["pass"], references[0].error
    (cell,) = cells
    return cell


def test_honest_buffers_pass_every_buffer_compared_at_every_step(run):
    cell = _result(run)
    assert cell.verdict == "pass", cell.error or cell.violations[:3]
    snap = load_snapshot(snapshot_path(run.snapshot_dir, CELL, "sgd"))
    assert set(snap["init"]["buffers"]["values"]) == BUFFERS
    assert [set(rec["buffers"]["values"]) for rec in snap["steps"]] == [BUFFERS] * STEPS
    # The statistics moved (so an update skipped or doubled would show), the constants did not.
    last = snap["steps"][-1]["buffers"]["values"]
    assert int(last["blocks.0.norm.num_batches_tracked"]) == STEPS
    assert not torch.equal(last["blocks.1.norm.running_mean"], snap["init"]["buffers"]["values"]["blocks.1.norm.running_mean"])
    assert torch.equal(last["scale"], snap["init"]["buffers"]["values"]["scale"])
    numel = sum(t.numel() for t in snap["init"]["buffers"]["values"].values())
    assert cell.optimizers["sgd"].checks["buffers"]["elements"] == numel * (STEPS + 1)


def _one_ulp_up(t: torch.Tensor, index: int = 0) -> None:
    flat = t.view(-1)
    flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf")))


def _assert_first(cell, step: int, name: str, rank: int = 0) -> None:
    assert cell.verdict == "fail", cell.error
    first = cell.first_divergence
    assert (first.check, first.step, first.name, first.rank) == ("buffers", step, name, rank), first
    text = first.describe(CELL)
    assert f"step={step} buffers: buffer '{name}'" in text and f"on rank {rank}" in text, text


@pytest.mark.parametrize("step", [1, 3])
def test_a_running_mean_one_ulp_off_fails_at_its_step(run, step):
    _edit(run, lambda snap: _one_ulp_up(snap["steps"][step - 1]["buffers"]["values"]["blocks.1.norm.running_mean"], 2))
    _assert_first(_result(run), step, "blocks.1.norm.running_mean")


def test_a_batch_counter_updated_twice_fails(run):
    def edit(snap):
        snap["steps"][0]["buffers"]["values"]["blocks.0.norm.num_batches_tracked"] += 1

    _edit(run, edit)
    _assert_first(_result(run), 1, "blocks.0.norm.num_batches_tracked")


def test_a_nonpersistent_constant_wrong_at_init_fails_at_step_0(run):
    _edit(run, lambda snap: _one_ulp_up(snap["init"]["buffers"]["values"]["scale"], 5))
    _assert_first(_result(run), 0, "scale")


def test_a_nan_buffer_fails_though_nan_compares_unequal_to_nothing(run):
    def edit(snap):
        snap["steps"][1]["buffers"]["values"]["blocks.0.mix"].view(-1)[3] = float("nan")

    _edit(run, edit)
    _assert_first(_result(run), 2, "blocks.0.mix")


def test_negative_zero_for_zero_fails_buffers_are_compared_by_their_bits(run):
    def edit(snap):
        mean = snap["init"]["buffers"]["values"]["blocks.0.norm.running_mean"]
        assert float(mean[0]) == 0.0 and not torch.signbit(mean[0])
        mean[0] = -0.0

    _edit(run, edit)
    _assert_first(_result(run), 0, "blocks.0.norm.running_mean")


@pytest.mark.parametrize("where", ["init", "step", "replay"])
def test_missing_buffer_evidence_is_an_error_not_a_pass(run, where):
    def edit(snap):
        if where == "init":
            del snap["init"]["buffers"]
        elif where == "step":
            del snap["steps"][1]["buffers"]["values"]["blocks.1.mix"]
        else:
            del snap["steps"][2]["shadow"]["buffers"]["scale"]

    _edit(run, edit)
    cell = _result(run)
    assert cell.verdict == "error" and "incomplete evidence" in cell.error and "buffer" in cell.error, cell.error


# -- every rank, through its digest -------------------------------------------------------------------

def _evidence(values: dict[str, torch.Tensor], rank_values: list[dict[str, torch.Tensor]]) -> dict:
    names = list(values)
    return {"values": values, "digests": torch.tensor([[digest(rv[n]) for n in names] for rv in rank_values])}


def test_a_rank_whose_buffer_differs_is_named_by_its_digest():
    stats = CheckStats()
    want = {"stat": torch.tensor([1.0, 2.0]), "table": torch.arange(4.0)}
    off = {"stat": torch.tensor([1.0, 2.0]), "table": torch.tensor([0.0, 1.0, 2.0, 3.0000002])}
    honest = _evidence(want, [want, want, want])
    assert buffers.violations("sgd", 1, honest, want, None, stats) == []
    assert stats.count == 6 + 2 * 2 and stats.max_ratio == 0.0
    bad = buffers.violations("sgd", 1, _evidence(want, [want, want, off]), want, None, CheckStats())
    assert [(v.check, v.name, v.rank) for v in bad] == [("buffers", "table", 2)]


def test_split_data_holds_other_ranks_to_constants_only():
    """With split data a rank's running statistics are its own batch's: the caller passes the
    names the step left unchanged (`every_rank`), and only those are held on every rank."""
    want = {"stat": torch.tensor([1.0, 2.0]), "table": torch.arange(4.0)}
    own_batch = {"stat": torch.tensor([1.5, 2.5]), "table": torch.arange(4.0)}
    evidence = _evidence(want, [want, own_batch])
    assert buffers.violations("sgd", 1, evidence, want, {"table"}, CheckStats()) == []
    broken = _evidence(want, [want, {"stat": torch.tensor([1.5, 2.5]), "table": torch.zeros(4)}])
    bad = buffers.violations("sgd", 1, broken, want, {"table"}, CheckStats())
    assert [(v.name, v.rank) for v in bad] == [("table", 1)]


def test_the_replay_follows_a_buffer_the_forward_reassigns():
    """`self.calls = self.calls + 1` puts a new tensor in the module's buffers: the replay must read
    the model's buffers afresh, or it would report the stale one and fail an honest run."""
    import torch.nn as nn
    import torch.nn.functional as F

    from cases.catalog import Case, OptimizerSpec
    from harness.reference.shadow import Shadow

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.calls = self.calls + 1
            return self.lin(x)

    case = Case(name="counting", description="", build_model=Counting, wrap=(), loss_fn=F.mse_loss,
                make_batch=lambda seed, step, b: (torch.ones(b, 2), torch.zeros(b, 2)),
                optimizers=(OptimizerSpec("sgd", lr=0.1),), global_batch=2, world_sizes=(1,))
    model = Counting()
    shadow = Shadow(case, case.optimizers[0], model.state_dict())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = shadow.step(params, case.make_batch(0, 1, 2), "identical", 1, buffers_before={"calls": torch.tensor(4)})
    assert int(out["buffers"]["calls"]) == 5
