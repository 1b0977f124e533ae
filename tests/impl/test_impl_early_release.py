"""A unit releases its unsharded parameters as soon as no backward op needs them (slow tier):
gradients bitwise equal to the same run without early release, at W = 2 under torchrun.

See tests/rank_scripts/impl_early_release.py for the scenarios and the planted faults.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.torchrun_script import run_rank_script

SCENARIOS = ("plain", "blocks_checkpointed", "embedding_recomputed", "head_recomputed", "one_rank_holds")
pytestmark = pytest.mark.slow


def launch(out_dir: Path, fault: str | None = None) -> list[dict]:
    return run_rank_script("impl_early_release.py", 2, out_dir, *([fault] if fault else []))


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("honest"))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_early_release_changes_no_bit(honest, scenario):
    for rank in honest:
        result = rank[scenario]
        assert "error" not in result, result.get("traceback")
        assert result["losses_equal"] and result["grads_equal"], (scenario, result)
        # Without early release the root holds its parameters through every block's backward.
        assert len(result["root_bytes_late"]) == 3 and min(result["root_bytes_late"]) > 0, result


def test_ranks_that_release_differently_stay_in_step(honest):
    # Rank 0 holds a tensor on the embeddings' storage: only rank 1 releases, and the
    # recomputation of the embeddings still gathers on both.
    rank0, rank1 = (rank["one_rank_holds"] for rank in honest)
    assert min(rank0["root_bytes_early"]) > 0 and rank1["root_bytes_early"] == [0, 0, 0], (rank0, rank1)


@pytest.mark.parametrize("scenario", ["plain", "blocks_checkpointed", "embedding_recomputed"])
def test_root_released_before_the_blocks_backward(honest, scenario):
    # The tied head and the final norm are done; the embeddings need no weight in backward.
    for rank in honest:
        assert rank[scenario]["root_bytes_early"] == [0, 0, 0], rank[scenario]


def test_no_release_once_the_unit_recomputes(honest):
    # The head is recomputed at the start of backward: the unit's saved tensors are not all
    # visible, so it keeps its parameters until its last gradient.
    for rank in honest:
        result = rank["head_recomputed"]
        assert result["root_bytes_early"] == result["root_bytes_late"], result


@pytest.mark.parametrize("fault, scenarios", [
    # Released while the final norm still needs its weight: backward reads an empty buffer.
    ("release_ignores_saved", SCENARIOS[:3]),
    # The embeddings recomputed after the release read an empty buffer.
    ("no_regather_on_recompute", ("embedding_recomputed", "one_rank_holds")),
    # Only the rank that released gathers again: the collectives fall out of step and time out.
    ("regather_where_released", ("one_rank_holds",)),
])
def test_planted_faults_are_caught(tmp_path, fault, scenarios):
    for rank in launch(tmp_path, fault):
        for scenario in scenarios:
            assert "error" in rank[scenario], (fault, scenario, rank[scenario])
