"""Simulated ranks ([Note: Simulated ranks], harness/run/simulated.py): W ranks as threads of one
process. Identical data gives bitwise the evidence of real gloo ranks; sums fold in rank order; a
failing rank fails the simulation instead of hanging it; W far above a parameter's numel runs."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.run.simulated import simulate
from tests.support.torchrun_script import RANK_SCRIPTS, run_rank_script

sys.path.insert(0, str(RANK_SCRIPTS))
import simulated_twin  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4, pytest.param(8, marks=pytest.mark.core)])
def test_identical_data_gives_the_bits_of_real_gloo_ranks(world_size, tmp_path):
    real = run_rank_script("simulated_twin.py", world_size, tmp_path)
    simulated = simulate(world_size, lambda rank: simulated_twin.train())
    assert len(simulated) == world_size
    for rank in range(world_size):
        assert simulated[rank]["losses"] == real[rank]["losses"], f"rank {rank}: losses"
        assert simulated[rank]["params"] == real[rank]["params"], f"rank {rank}: parameters"


def test_split_data_trains_every_replica_the_same():
    """Distinct terms: the fold's bits are its own (not gloo's ring order), every rank's replica
    the same (the losses are each rank's own batch's)."""
    out = simulate(4, lambda rank: simulated_twin.train(split=True))
    assert all(o["params"] == out[0]["params"] for o in out)
    assert len({tuple(o["losses"]) for o in out}) == 4


def _sum_of(world_size: int, op=dist.ReduceOp.SUM, scatter: bool = False) -> list[torch.Tensor]:
    def fn(rank):
        # distinct terms whose sum depends on the order: 1, then tiny ones that vanish only one by one
        term = torch.tensor([1.0 if rank == 0 else 2.0 ** -24] * world_size)
        if scatter:
            out = torch.empty(1)
            dist.reduce_scatter_tensor(out, term, op=op)
            return out
        dist.all_reduce(term, op=op)
        return term
    return simulate(world_size, fn)


@pytest.mark.parametrize("scatter", [False, True])
def test_a_sum_folds_left_to_right_in_rank_order(scatter):
    # ((1 + 2^-24) + 2^-24) + ...: each addition rounds back to 1 (ties to even); a tree that
    # first adds the small terms together would reach 1 + 2^-22 at W = 5
    results = _sum_of(5, scatter=scatter)
    folded = torch.tensor(1.0)
    for _ in range(4):
        folded = folded + torch.tensor(2.0 ** -24)
    assert folded == 1.0
    for r in results:
        assert torch.equal(r, torch.full_like(r, 1.0))


def test_avg_max_and_the_copies():
    def fn(rank):
        w = dist.get_world_size()
        avg = torch.tensor([float(rank)])
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        top = torch.tensor([float(rank)])
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        gathered = torch.empty(w)
        dist.all_gather_into_tensor(gathered, torch.tensor([float(rank)]))
        b = torch.tensor([float(rank)])
        dist.broadcast(b, src=w - 1)
        got = [torch.empty(1) for _ in range(w)] if rank == 0 else None
        dist.gather(torch.tensor([float(rank * 10)]), got, dst=0)
        if rank == 1:
            dist.send(torch.tensor([7.0]), dst=2)
        received = torch.zeros(1)
        if rank == 2:
            dist.recv(received, src=1)
        return avg.item(), top.item(), gathered.tolist(), b.item(), got and [g.item() for g in got], received.item()

    out = simulate(3, fn)
    assert [o[0] for o in out] == [1.0] * 3
    assert [o[1] for o in out] == [2.0] * 3
    assert all(o[2] == [0.0, 1.0, 2.0] for o in out)
    assert [o[3] for o in out] == [2.0] * 3
    assert out[0][4] == [0.0, 10.0, 20.0]
    assert out[2][5] == 7.0


def test_subgroups_meet_only_their_members():
    def fn(rank):
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = groups[rank // 2]
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mine)
        return t.item()

    assert simulate(4, fn) == [1.0, 1.0, 5.0, 5.0]


def test_a_failing_rank_fails_the_simulation_naming_it_without_hanging():
    def fn(rank):
        t = torch.ones(1)
        dist.all_reduce(t)
        if rank == 3:
            raise ValueError("planted failure")
        dist.all_reduce(t)  # the others wait here for rank 3
        return t.item()

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"simulated rank 3 of 6 failed: ValueError: planted failure"):
        simulate(6, fn)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("slots", [2, pytest.param(1000, marks=pytest.mark.xfail(strict=True, reason="planted: no pace"))])
def test_no_more_ranks_run_at_once_than_the_pace_has_slots(monkeypatch, slots):
    """After a collective the others are handed on a slot at a time, not woken together
    ([Note: Simulated ranks], `_Pace`); planted: a pace of 1000 slots lets them all run."""
    import threading

    from harness.run import simulated

    monkeypatch.setattr(simulated, "PACE_SLOTS", slots)
    lock, running, most = threading.Lock(), [0], [0]

    def fn(rank):
        t = torch.ones(1)
        for _ in range(3):
            dist.all_reduce(t)
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.005)
            with lock:
                running[0] -= 1
        return t.item()

    sim = simulated.Simulation(16)
    assert sim.run(fn) == [16.0 ** 3] * 16
    assert most[0] <= 2, most[0]
    assert sim.pace.free == slots  # every slot handed back: none lost to a rank made runnable before it blocked


@pytest.mark.parametrize("stall_s", [0.5, pytest.param(1e9, marks=[pytest.mark.slow, pytest.mark.xfail(
    strict=True, reason="planted: no lending (18 s)")])])
def test_ranks_blocked_outside_any_collective_do_not_starve_the_rank_they_wait_for(monkeypatch, stall_s):
    """Every rank but the last waits for an event only the last one sets, outside any collective
    (as a store's wait is): the slots' holders block, and the ranks waiting for a slot run on slots the pace lends once no slot has moved for STALL_S and the holders' threads used no CPU,
    so the event is set while they still wait. Planted: no lending, and the first ranks time out
    before the last one ever runs."""
    import threading

    from harness.run.simulated import _Pace

    monkeypatch.setattr(_Pace, "STALL_S", stall_s)
    event = threading.Event()

    def fn(rank):
        if rank == 7:
            event.set()
            return True
        return event.wait(timeout=6)

    assert simulate(8, fn) == [True] * 8


@pytest.mark.parametrize("cpu_share", [0.02, pytest.param(float("inf"), marks=pytest.mark.xfail(
    strict=True, reason="planted: a stall read from the clock alone"))])
def test_holders_that_compute_longer_than_a_stall_get_no_herd_beside_them(monkeypatch, cpu_share):
    """The slots' holders compute for several STALL_S without a collective (as a slow rank starved of
    CPU by other processes does): their threads' CPU clocks advance, so the pace lends no slot and
    no more ranks than the slots ever run at once. Planted: a stall read from the wall clock alone
    (any CPU share counts as blocked), and the waiting ranks run beside them."""
    import threading

    from harness.run import simulated

    monkeypatch.setattr(simulated._Pace, "STALL_CPU_SHARE", cpu_share)
    lock, running, most = threading.Lock(), [0], [0]

    def fn(rank):
        dist.all_reduce(torch.ones(1))
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        end = time.monotonic() + 3 * simulated._Pace.STALL_S
        while time.monotonic() < end:
            pass
        with lock:
            running[0] -= 1
        return True

    sim = simulated.Simulation(4)
    assert sim.run(fn) == [True] * 4
    assert most[0] <= 2, most[0]
    assert sim.pace.free == simulated.PACE_SLOTS and sim.pace.lent == 0


@pytest.mark.parametrize("wrapped", [True, pytest.param(False, marks=pytest.mark.xfail(
    strict=True, reason="planted: the wait not wrapped in blocking() (3 s)"))])
def test_a_wait_in_blocking_hands_the_slot_on_without_a_stall(monkeypatch, wrapped):
    """With the pace lending nothing (STALL_S huge), ranks that wait inside `simulated.blocking()`
    (as the run worker's store waits do) hand their slots on, so the rank they wait for runs at
    once. Planted: the same wait outside blocking() keeps the slots, and the waiters time out."""
    import contextlib
    import threading

    from harness.run import simulated

    monkeypatch.setattr(simulated._Pace, "STALL_S", 1e9)
    event = threading.Event()

    def fn(rank):
        if rank == 3:
            event.set()
            return True
        with simulated.blocking() if wrapped else contextlib.nullcontext():
            return event.wait(timeout=3)

    assert simulate(4, fn) == [True] * 4


@pytest.mark.parametrize("planted", [None, pytest.param("queue", marks=pytest.mark.xfail(
    strict=True, reason="planted: time queued for a slot counted as waiting for the others")),
    pytest.param("progress", marks=pytest.mark.xfail(
        strict=True, reason="planted: time waiting for others counted while slots move"))])
def test_the_group_timeout_bounds_waiting_for_other_ranks_not_for_a_slot(monkeypatch, planted):
    """A group made with a 2 s timeout. After a collective the first two ranks to run compute 3 s
    while the other six are queued for the two slots: the queued ones wait 3 s with no slot
    moving. Then the first two wait 2.4 s for the others, which compute 0.8 s each, two at a time,
    slots moving. Neither is a hang: every rank completes the next collective. Then one rank never
    comes to a collective, and the others fail after the group's timeout (a rank waiting at W =
    1024 behind the judging rank's long step, 600 s fixed before, stopped an honest cell). Planted:
    the time queued for a slot, or the time waiting while slots move, counted against it."""
    import threading
    from datetime import timedelta

    from harness.run import simulated

    monkeypatch.setattr(simulated._Pace, "POLL_S", 0.2)
    if planted == "progress":
        monkeypatch.setattr(simulated._Pace, "progress", property(lambda self: 0.0, lambda self, value: None))
    if planted == "queue":
        def runnable(self, tickets):  # the queue not marked: its wait counts against the timeout
            with self.lock:
                self.ready.extend(tickets)
                self._dispatch()
        monkeypatch.setattr(simulated._Pace, "runnable", runnable)
    sim = simulated.Simulation(8)
    lock, completed, started = threading.Lock(), [], []

    def fn(rank):
        dist.init_process_group(simulated.BACKEND, store=dist.PrefixStore("world", sim.store), rank=rank,
                                world_size=8, timeout=timedelta(seconds=2))
        dist.all_reduce(torch.ones(1))
        with lock:
            started.append(rank)
            first_two = len(started) <= 2
        end = time.monotonic() + (3.0 if first_two else 0.8)
        while time.monotonic() < end:
            pass
        dist.all_reduce(torch.ones(1))
        with lock:
            completed.append(rank)
        if rank != 5:  # rank 5 never comes to the third
            dist.all_reduce(torch.ones(1))

    with pytest.raises(RuntimeError, match=r"waiting for the other ranks' collective: waited \d+ s \(the group's timeout\)"):
        sim.run(fn, init=False)
    assert sorted(completed) == list(range(8))


@pytest.mark.slow
def test_world_sizes_far_above_the_parameters_numel():
    """W = 256 on an MLP whose biases have 7 to 31 elements: most ranks hold empty shards of every
    unit; the replicas agree bitwise and the first loss is the plain model's."""
    out = simulate(256, lambda rank: simulated_twin.train())
    assert all(o == out[0] for o in out)
    assert out[0]["losses"][0] == simulate(1, lambda rank: simulated_twin.train())[0]["losses"][0]


def test_simulations_run_one_after_another(tmp_path: Path):
    assert simulate(2, lambda rank: dist.get_world_size()) == [2, 2]
    assert simulate(3, lambda rank: dist.get_rank()) == [0, 1, 2]


# -- `harness run --backend simulated` -------------------------------------------------------------


def test_the_plan_refuses_what_simulated_ranks_cannot_run(tmp_path):
    from harness.errors import PlanError
    from harness.run.plan import build_plan

    def plan(**kw):
        return build_plan(**{"cases": ("mlp",), "impls": ("ours",), "world_sizes": (16,), "backend": "simulated",
                             "out_dir": tmp_path / "run", **kw})

    assert plan().cells and all(c.world_size == 16 for c in plan().cells)
    with pytest.raises(PlanError, match="threads on the CPU"):
        plan(device="cuda")
    with pytest.raises(PlanError, match="exceeds 1024"):
        plan(world_sizes=(2048,))
    with pytest.raises(PlanError, match="collective faults act at torch's ProcessGroup of real ranks"):
        plan(faults=("dist_scale_1e-5",))
    skipped = plan(impls=("ours", "fsdp2")).skipped
    assert [(c.impl, "needs real ranks" in why) for c, why in skipped] == [("fsdp2", True)] * len(skipped) != []
    with pytest.raises(PlanError, match="--backend simulated"):  # real ranks: the message says where to go
        build_plan(cases=("mlp",), impls=("ours",), world_sizes=(64,), out_dir=tmp_path / "run")


@pytest.mark.slow
def test_a_simulated_run_is_judged_labelled_and_catches_a_fault_of_scale(tmp_path):
    """The standard mlp at W = 8 and 128 as simulated ranks: honest cells pass with every check, the
    report says the ranks were simulated; an all-gather that keeps the rank index in 6 bits is exact
    at W = 8 and fails at W = 128 on the first loss."""
    from harness.judge.verdict import evaluate
    from harness.run.orchestrate import run_plan
    from harness.run.plan import build_plan

    plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(8, 128), data_modes=("identical",), steps=2,
                      backend="simulated", out_dir=tmp_path / "run", fault_copies=("rank_index_in_6_bits",))
    cells, _, _ = evaluate(plan, run_plan(plan))
    verdicts = {r.cell.cell_id: str(r.verdict) for r in cells}
    assert verdicts == {"mlp.ours.w8.identical": "pass", "mlp.ours.w128.identical": "pass",
                        "mlp.ours.w8.identical.rank_index_in_6_bits": "pass",
                        "mlp.ours.w128.identical.rank_index_in_6_bits": "fail"}, verdicts
    failed = next(r for r in cells if str(r.verdict) == "fail")
    assert (failed.first_divergence.step, failed.first_divergence.check) == (1, "loss")


def test_every_report_of_simulated_ranks_says_so():
    from harness.report.environment import environment, ranks_label

    simulated, real = environment("simulated", "cpu", 1), environment("gloo", "cpu", 1)
    assert simulated["ranks"].startswith("simulated") and real["ranks"] == "processes"
    assert ranks_label(simulated) == " (simulated ranks)" and ranks_label(real) == ""
