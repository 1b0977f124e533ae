"""Communication overlapped with compute: implicit prefetch and reduce-scatters left in flight
(slow tier, W = 2 under torchrun). See tests/rank_scripts/impl_overlap.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.torchrun_script import run_rank_script

pytestmark = pytest.mark.slow


def launch(out_dir: Path, fault: str | None = None) -> list[dict]:
    return run_rank_script("impl_overlap.py", 2, out_dir, *([fault] if fault else []))


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("honest"))


def test_overlap_changes_no_bit(honest):
    for rank in honest:
        assert rank["losses_equal"] and rank["grads_equal"], rank


def test_next_units_gathered_ahead_and_reduction_left_in_flight(honest):
    for rank in honest:
        seen = rank["overlapped"]
        # The first forward has no order to prefetch by; from the second step on it has.
        assert seen["forward_prefetched"][1:] == [True, True], seen
        assert seen["backward_prefetched"] == [True, True, True], seen
        assert seen["reduce_in_flight"] == [True, True, True], seen
        # With both turned off, nothing is gathered ahead nor left in flight.
        assert rank["blocking"] == {k: [False] * 3 for k in seen}, rank["blocking"]


@pytest.mark.parametrize("fault, observations", [
    ("no_implicit_prefetch", ("forward_prefetched", "backward_prefetched")),
    ("blocking_reduce", ("reduce_in_flight",)),
])
def test_planted_faults_are_caught(tmp_path, fault, observations):
    for rank in launch(tmp_path, fault):
        for observation in observations:
            assert not any(rank["overlapped"][observation]), (fault, rank["overlapped"])
