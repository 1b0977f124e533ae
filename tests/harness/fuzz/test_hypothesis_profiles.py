"""The ci profile draws the same examples on every run; the thorough profile does not (fast tier)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

import tests.support.strategies as strategies


def _drawn_layouts(profile: str, max_examples: int) -> list:
    drawn = []

    @settings(settings.get_profile(profile), max_examples=max_examples)
    @given(strategies.flat_layouts(max_numel=64))
    def record(layout):
        drawn.append(layout)

    record()
    return drawn


def test_ci_profile_is_derandomised_and_thorough_is_not():
    assert settings.get_profile("ci").derandomize and settings.get_profile("ci").database is None
    assert not settings.get_profile("thorough").derandomize


def test_ci_profile_draws_identical_examples_run_after_run():
    first, second = _drawn_layouts("ci", 30), _drawn_layouts("ci", 30)
    assert len(first) >= 20 and first == second


def test_thorough_profile_draws_fresh_examples(request):
    if request.config.getoption("hypothesis_seed", None) is not None:
        pytest.skip("--hypothesis-seed seeds every draw of this session on purpose")
    # Random: two runs of 30 draws from a space this large agree only by a vanishing chance.
    assert _drawn_layouts("thorough", 30) != _drawn_layouts("thorough", 30)
