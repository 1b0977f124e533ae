"""Collective faults (harness/run/dist_faults.py): planted in what torch.distributed delivers, so
they apply to any implementation.

fast: each fault's effect on a fake process group (scale, drop on the last rank only, rotate,
stale once), sums only; honest runs install nothing; the faults reach only the training step's
context; bad names are exit 2 before any rank starts; which cells a plan gives them.
slow: each fault on ours and on torch FSDP2 at W = 2 fails with a first divergence while the
honest cells of the same launch pass; on DDP (whose C++ reducer they cannot reach) a fault is an
error saying it never acted, not a pass; fuzz --impls fsdp2 --faults dist_... fails.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions, ProcessGroup, ReduceScatterOptions

from harness import cli
from harness.adapters.base import RankContext
from harness.ci.mutants import Evidence, MutantRow, table
from harness.run import dist_faults
from harness.faults import NEVER_ACTED, of_layer
from harness.run.dist_faults import CollectiveFaults

REPO = Path(__file__).resolve().parents[3]


class FakeGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _sum_opts(op=dist.ReduceOp.SUM) -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = op
    return opts


def _all_reduce(plant: CollectiveFaults, rank: int, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """An all-reduce over 2 ranks whose other rank contributes ones."""
    def original(group, tensors, opts):
        tensors[0].add_(1)

    plant._call(FakeGroup(rank, 2), "reduce", "inplace", "allreduce", original, ([tensor], _sum_opts(op)), {})
    return tensor


def test_scale_multiplies_every_summing_reduction_and_leaves_max_alone():
    plant = CollectiveFaults({"dist_scale_1e-5"})
    out = _all_reduce(plant, 0, torch.full((3,), 2.0))
    assert torch.equal(out, torch.full((3,), 3.0) * (1 + 1e-5))
    assert torch.equal(_all_reduce(plant, 0, torch.full((3,), 2.0), dist.ReduceOp.MAX), torch.full((3,), 3.0))
    assert torch.equal(_all_reduce(plant, 0, torch.ones(2, dtype=torch.int64)), torch.full((2,), 2, dtype=torch.int64))
    assert plant.acted == {"dist_scale_1e-5": 1}


def test_drop_removes_the_last_ranks_contribution_only():
    assert torch.equal(_all_reduce(CollectiveFaults({"dist_drop_last_rank"}), 1, torch.full((2,), 5.0)), torch.ones(2))
    assert torch.equal(_all_reduce(CollectiveFaults({"dist_drop_last_rank"}), 0, torch.full((2,), 5.0)),
                       torch.full((2,), 6.0))
    seen = []
    opts = ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    plant = CollectiveFaults({"dist_drop_last_rank"})
    plant._call(FakeGroup(1, 2), "reduce", "tensor", "reduce_scatter_single",
                lambda group, out, inp, opts: seen.append(inp.clone()), (torch.empty(2), torch.ones(4), opts), {})
    assert torch.equal(seen[0], torch.zeros(4))  # the reduce-scatter's input, not the caller's tensor
    assert plant.acted == {"dist_drop_last_rank": 1}


def test_rotate_delivers_rank_r_plus_ones_shard_in_rank_rs_slot():
    def gather(group, out, inp, opts):
        out.copy_(torch.arange(4.0).repeat_interleave(2))  # rank r's shard is [r, r]

    plant = CollectiveFaults({"dist_rotate_all_gather"})
    out = torch.empty(8)
    plant._call(FakeGroup(0, 4), "gather", "tensor", "all_gather_single", gather, (out, torch.empty(2), None), {})
    assert out.tolist() == [1, 1, 2, 2, 3, 3, 0, 0]

    def gather_list(group, outs, inps, opts):
        for r, t in enumerate(outs[0]):
            t.fill_(r)

    outs = [[torch.empty(2) for _ in range(3)]]
    plant._call(FakeGroup(0, 3), "gather", "lists", "allgather", gather_list, (outs, [torch.empty(2)], None), {})
    assert [t[0].item() for t in outs[0]] == [1, 2, 0]


def test_stale_returns_the_first_result_once_for_the_second_reduction_of_a_shape():
    plant = CollectiveFaults({"dist_stale_reduction"})
    first = _all_reduce(plant, 0, torch.full((2,), 1.0)).clone()
    second = _all_reduce(plant, 0, torch.full((2,), 7.0))
    third = _all_reduce(plant, 0, torch.full((2,), 9.0))
    other_shape = _all_reduce(plant, 0, torch.full((3,), 4.0))
    assert torch.equal(second, first) and torch.equal(third, torch.full((2,), 10.0))
    assert torch.equal(other_shape, torch.full((3,), 5.0)) and plant.acted == {"dist_stale_reduction": 1}


def test_the_faulted_result_survives_a_backend_that_writes_the_output_again_at_each_wait():
    class RewritingWork:  # as gloo's reduce_scatter_single on torch 2.13 does
        def __init__(self, out):
            self.out = out

        def wait(self):
            self.out.fill_(3.0)
            return True

    out = torch.empty(2)
    plant = CollectiveFaults({"dist_scale_1e-5"})
    work = plant._call(FakeGroup(0, 2), "reduce", "tensor", "reduce_scatter_single",
                       lambda group, o, i, opts: RewritingWork(o), (out, torch.ones(4), None), {})
    assert work.wait() and work.wait() and torch.equal(out, torch.full((2,), 3.0) * (1 + 1e-5))


def test_a_fault_that_never_acted_is_an_error_naming_it():
    plant = CollectiveFaults({"dist_stale_reduction", "dist_scale_1e-5"})
    _all_reduce(plant, 0, torch.ones(2))
    with pytest.raises(RuntimeError, match=rf"\['dist_stale_reduction'\] {NEVER_ACTED}"):
        plant.check_acted("rank 0: cell c")


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.contexts = []

    def wrap(self, model, wrap_paths, ctx):
        self.contexts.append(ctx)
        return model

    def forward_backward(self, *args):
        return ProcessGroup.__dict__["allreduce"]


def test_honest_runs_install_nothing_and_faults_reach_only_the_training_step():
    adapter = Recorder()
    untouched = dict(ProcessGroup.__dict__)
    assert dist_faults.planted(adapter, ()) is adapter
    assert dist_faults.planted(adapter, ("no_grad_average",)) is adapter  # impl/'s faults travel in the context
    with dist_faults.armed(adapter):
        assert ProcessGroup.__dict__["allreduce"] is untouched["allreduce"]
    planted = dist_faults.planted(adapter, ("dist_scale_1e-5",))
    ctx = RankContext(0, 2, None, torch.device("cpu"), faults=frozenset({"dist_scale_1e-5", "no_grad_average"}))
    planted.wrap(None, (), ctx)
    assert adapter.contexts[-1].faults == {"no_grad_average"}
    assert planted.forward_backward() is not untouched["allreduce"]  # armed inside the step
    assert planted.name == "recorder" and all(ProcessGroup.__dict__[n] is untouched[n] for n in dist_faults.COLLECTIVE_METHODS
                                               if n in untouched)


def test_a_plan_gives_collective_faults_to_every_cell_with_collectives_and_impl_faults_to_ours():
    from harness.run.plan import _cell_faults

    both = ("dist_drop_last_rank", "no_grad_average")
    assert _cell_faults(both, "ours", 2) == ("dist_drop_last_rank", "no_grad_average")
    assert _cell_faults(both, "fsdp2", 4) == ("dist_drop_last_rank",)
    assert _cell_faults(both, "fsdp2", 1) == () and _cell_faults(both, "ours", 1) == ("no_grad_average",)


@pytest.mark.parametrize("argv, message", [
    (["run", "--impls", "fsdp2", "--cases", "mlp", "--world-sizes", "2", "--faults", "dist_nope"], "unknown fault(s) ['dist_nope']"),
    (["fuzz", "--impls", "fsdp2", "--world-size", "2", "--faults", "dist_nope"], "unknown fault(s) ['dist_nope']"),
    (["mutants", "--impls", "fsdp2", "--only", "dist_nope"], "unknown fault(s) ['dist_nope']"),
    (["mutants", "--impls", "fsdp2", "--only", "no_grad_average"], "apply to --impls ours only, not fsdp2"),
    (["mutants", "--impls", "single"], "runs without a process group"),
])
def test_bad_fault_names_are_exit_2_in_one_line_before_any_rank(tmp_path, capsys, argv, message):
    rc = cli.main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()  # refused before anything was written or launched


def test_mutants_refuses_two_implementations_of_one_name_before_any_rank(tmp_path, capsys):
    for stem in ("a", "b"):
        (tmp_path / f"{stem}.py").write_text("from harness.adapters import Adapter\n\n\nclass Same(Adapter):\n"
                                             "    name = 'same'\n\n    def wrap(self, model, wrap_paths, ctx):\n"
                                             "        return model\n")
    rc = cli.main(["mutants", "--impls", f"{tmp_path / 'a.py'}:Same,{tmp_path / 'b.py'}:Same", "--out",
                   str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "share the name 'same'" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_the_table_reports_a_fault_an_implementation_cannot_take_as_not_applicable():
    impl_only = MutantRow("no_grad_average", "a bug", [], "n/a: planted inside impl/, impl=ours only")
    idle = MutantRow("dist_scale_1e-5", "a bug", [Evidence("gate mlp.ddp.w2.split.dist_scale_1e-5",
                                                           error=f"rank 0: ... {NEVER_ACTED}: ...")])
    assert impl_only.not_applicable and idle.not_applicable and not idle.caught
    text = table([impl_only, idle])
    assert "| no_grad_average | n/a |" in text and "| dist_scale_1e-5 | n/a |" in text and "NO" not in text


@pytest.mark.slow
def test_each_collective_fault_is_caught_on_ours_and_fsdp2_and_never_acted_on_ddp_is_an_error(tmp_path):
    from harness.judge.verdict import evaluate
    from harness.run.orchestrate import run_plan
    from harness.run.output import OutputDir
    from harness.run.plan import build_plan

    base = build_plan(cases=("mlp",), impls=("ours", "fsdp2", "ddp"), world_sizes=(2,), data_modes=("split",),
                      steps=2, timeout_s=1200, out_dir=tmp_path)
    faulted = [replace(c, faults=(f,)) for f in of_layer("collective") for c in base.cells if c.impl != "ddp"]
    idle = [replace(c, faults=("dist_scale_1e-5",)) for c in base.cells if c.impl == "ddp"]
    plan = replace(base, cells=base.cells + tuple(faulted) + tuple(idle))
    with OutputDir(plan.out_dir, plan.run_id, ("snapshots", "logs", "init")):
        results, references, _ = evaluate(plan, run_plan(plan))
    by_id = {r.cell.cell_id: r for r in results}
    assert all(r.verdict == "pass" for r in references)
    for cell in base.cells:  # honest: ours, fsdp2 and ddp pass in the launch that carries the faults
        assert by_id[cell.cell_id].verdict == "pass", by_id[cell.cell_id].error or by_id[cell.cell_id].violations[:1]
    for cell in faulted:
        r = by_id[cell.cell_id]
        assert r.verdict == "fail" and r.error is None and r.violations, (cell.cell_id, r.error)
        first = min(r.violations, key=lambda v: v.sort_key())
        assert f"step={first.step}" in first.describe("gate"), first.describe("gate")
    for cell in idle:
        r = by_id[cell.cell_id]
        assert r.error is not None and NEVER_ACTED in r.error and "dist_scale_1e-5" in r.error, r.error


@pytest.mark.slow
def test_fuzz_fsdp2_with_a_collective_fault_fails_with_its_first_divergence(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness", "fuzz", "--impls", "fsdp2", "--world-size", "2",
                           "--max-examples", "4", "--faults", "dist_drop_last_rank", "--out", str(tmp_path / "out")],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "[fuzz] FAIL: minimal failing model" in proc.stdout and "faults=['dist_drop_last_rank']" in proc.stdout
    assert "first divergence: fuzz optimizer=" in proc.stdout, proc.stdout[-3000:]
