"""A run judged on its ranks lets the case's initial state go once every consumer holds its own
copy ([Note: The initial state handed over] in harness/run/worker.py): no tensor of it is alive at
the judge's first step, and the run's judgement is the one it gets when the state stays held.

The mlp through impl=ours at W = 1, judged in this process (`judge_here`), 3 steps. Planted: the
state not emptied (`hand_over` off) -> its tensors are alive at every step."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from cases.catalog import get_case
from harness.adapters import RankContext
from harness.run import worker
from harness.run.judged import RankJudge
from harness.run.plan import build_plan
from harness.run.snapshot import build_init
from harness.run.worker import run_cell


def _judged(tmp_path, monkeypatch, hand_over: bool) -> tuple[dict, list[int]]:
    """The judged record of mlp's cell and, at each step the judge takes, how many of the initial
    state's tensors are alive."""
    plan = build_plan(cases=("mlp",), impls=("ours",), world_sizes=(1,), data_modes=("identical",), steps=3,
                      out_dir=tmp_path / "out")
    (cell,) = plan.cells
    case = get_case("mlp")
    init_state, init_buffers = build_init(case)
    refs = [weakref.ref(t) for t in init_state.values()]
    alive: list[int] = []
    take = RankJudge.take

    def counted(self, rec):
        gc.collect()
        alive.append(sum(r() is not None for r in refs))
        return take(self, rec)

    with monkeypatch.context() as patched:
        patched.setattr(RankJudge, "take", counted)
        record = run_cell(cell, case.optimizer("sgd"), init_state, RankContext(0, 1, None), tmp_path / "scratch",
                          init_buffers, judge_here=True, run_id=plan.run_id, hand_over=hand_over)
    assert (init_state == {}) == hand_over
    return record, alive


def test_the_initial_state_is_let_go_and_the_judgement_kept(tmp_path, monkeypatch):
    handed, alive = _judged(tmp_path / "a", monkeypatch, True)
    kept, alive_kept = _judged(tmp_path / "b", monkeypatch, False)
    assert alive == [0, 0, 0], alive
    assert alive_kept[0] > 0 and len(set(alive_kept)) == 1, alive_kept  # the comparison can fail
    assert handed["error"] is None and kept["error"] is None, (handed["error"], kept["error"])
    assert not handed["result"]["violations"]
    own = {"wall_s", "run_id"}  # each run's own
    assert set(handed) - own == set(kept) - own
    for key in sorted(set(handed) - own):
        assert repr(handed[key]) == repr(kept[key]), key


def test_each_run_but_the_last_is_handed_a_copy():
    state = {"w": torch.ones(3)}
    first, last = worker._handed(state, 0, 2), worker._handed(state, 1, 2)
    assert last is state and first is not state and first["w"] is not state["w"]
    assert bool((first["w"] == state["w"]).all())
    first.clear()
    assert "w" in state


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
