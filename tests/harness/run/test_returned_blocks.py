"""Fast tier: [Note: Freed memory returned] in harness/run/launch.py. A launch whose ranks judge
on CPUs asks glibc to return freed blocks from 1/32 of the largest judged model's float32 bytes
(to the nearest power of two, between 2 and 32 MiB) to the system; any other launch keeps them in the heap (MALLOC_ENV), and a
user's own setting wins either way."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness.run import launch
from harness.run.plan import build_plan


@pytest.fixture
def plan(tmp_path):
    return build_plan(cases=("mlp",), impls=("ours",), world_sizes=(2,), data_modes=("split",), steps=1,
                      out_dir=tmp_path, judge_on="ranks")


def _spec_env(monkeypatch, plan, parameters: int) -> dict[str, str]:
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


@pytest.mark.parametrize("parameters, threshold", [
    (124_439_808, 16 << 20),  # GPT-2 small: 14.8 MiB, to the nearest power of two
    (16_800_000, 2 << 20),    # GPT-2 d384: 2.0 MiB (2.1 MB)
    (70_000_000, 8 << 20),    # 8.3 MiB
    (1_000, 2 << 20),                       # a catalog model: the huge-page size at least
    (1_500_000_000, 32 << 20),              # GPT-2 XL: glibc's largest default at most
])
def test_ranks_that_judge_return_blocks_from_a_size_that_grows_with_the_model(monkeypatch, plan, parameters,
                                                                               threshold):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert _spec_env(monkeypatch, plan, parameters)["MALLOC_MMAP_THRESHOLD_"] == str(threshold)


def test_ranks_that_do_not_judge_or_run_on_gpus_keep_freed_memory_in_the_heap(monkeypatch, plan):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    big = 124_000_000
    assert _spec_env(monkeypatch, replace(plan, judged_on_ranks=()), big)["MALLOC_MMAP_THRESHOLD_"] == str(1 << 40)
    assert _spec_env(monkeypatch, replace(plan, device="cuda"), big)["MALLOC_MMAP_THRESHOLD_"] == str(1 << 40)


def test_a_user_s_own_setting_wins(monkeypatch, plan):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert _spec_env(monkeypatch, plan, 124_000_000)["MALLOC_MMAP_THRESHOLD_"] == "65536"


def test_ranks_back_model_sized_tensors_with_huge_pages_unless_the_user_says(monkeypatch, plan):
    """[Note: Huge pages for model-sized tensors]: in every launch, whatever the memory, and a
    user's own setting wins."""
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    for parameters in (124_000_000, 16_800_000):
        assert _spec_env(monkeypatch, plan, parameters)["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert _spec_env(monkeypatch, plan, 124_000_000)["THP_MEM_ALLOC_ENABLE"] == "0"
