"""Fast tier: [Note: Freed memory returned] in harness/run/launch.py. A launch whose ranks may need
most of the machine's memory (a big model judged on the ranks, on CPUs) asks glibc to return freed
blocks (RETURNING_MALLOC_ENV in its ranks' environment); any other launch keeps them in the heap
(MALLOC_ENV), and a user's own setting wins either way."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness.run import launch
from harness.run.plan import build_plan


@pytest.fixture
def plan(tmp_path):
    return build_plan(cases=("mlp",), impls=("ours",), world_sizes=(2,), data_modes=("split",), steps=1,
                      out_dir=tmp_path, judge_on="ranks")


def _spec_env(monkeypatch, plan, available: int, parameters: int) -> dict[str, str]:
    monkeypatch.setattr(launch, "available_memory", lambda: available)
    monkeypatch.setattr(launch, "num_parameters", lambda name: parameters)
    seen = {}

    class Captured(Exception):
        pass

    def capture(spec):
        seen.update(launch._child_env("x", spec.threads, spec.extra_pythonpath, spec.extra_env))
        raise Captured

    monkeypatch.setattr(launch, "Launch", capture)
    with pytest.raises(Captured):
        launch.launch(plan, 2, plan.cells, "w2")
    return seen


def test_a_model_whose_ranks_near_the_machine_s_memory_returns_freed_blocks(monkeypatch, plan):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    big = 124_000_000  # GPT-2 small: 2 x 110 B x 124M = 27 GB
    assert _spec_env(monkeypatch, plan, 23 << 30, big)["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
    # the same model where memory is plentiful, or judged in the parent, or on GPUs: the heap keeps them
    assert _spec_env(monkeypatch, plan, 512 << 30, big)["MALLOC_MMAP_THRESHOLD_"] == str(1 << 40)
    assert _spec_env(monkeypatch, replace(plan, judged_on_ranks=()), 23 << 30, big)["MALLOC_MMAP_THRESHOLD_"] == str(1 << 40)
    assert _spec_env(monkeypatch, replace(plan, device="cuda"), 23 << 30, big)["MALLOC_MMAP_THRESHOLD_"] == str(1 << 40)


def test_a_small_model_keeps_freed_memory_in_the_heap(monkeypatch, plan):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert _spec_env(monkeypatch, plan, 23 << 30, 16_800_000)["MALLOC_MMAP_THRESHOLD_"] == str(1 << 40)


def test_a_user_s_own_setting_wins(monkeypatch, plan):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert _spec_env(monkeypatch, plan, 23 << 30, 124_000_000)["MALLOC_MMAP_THRESHOLD_"] == "65536"


def test_ranks_back_model_sized_tensors_with_huge_pages_unless_the_user_says(monkeypatch, plan):
    """[Note: Huge pages for model-sized tensors]: in every launch, whatever the memory, and a
    user's own setting wins."""
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    for parameters in (124_000_000, 16_800_000):
        assert _spec_env(monkeypatch, plan, 23 << 30, parameters)["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert _spec_env(monkeypatch, plan, 23 << 30, 124_000_000)["THP_MEM_ALLOC_ENABLE"] == "0"
