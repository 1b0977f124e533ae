"""The judge-mutation script (tests/judge_mutants.py, run by hand) edits the judge by exact text.
When the judge is restructured its anchors stop matching and the script refuses to run, which is
discovered only when someone runs it: here every mutant is applied to a copy of its file, so a
stale anchor fails the default test command instead."""

from __future__ import annotations

import shutil

import pytest

import judge_mutants
from tests.support.scratch_repo import REPO


@pytest.mark.parametrize("mutant", judge_mutants.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_to_the_current_judge(mutant, tmp_path):
    (tmp_path / mutant.path).parent.mkdir(parents=True)
    shutil.copy(REPO / mutant.path, tmp_path / mutant.path)
    before = (tmp_path / mutant.path).read_text()
    judge_mutants.apply(mutant, tmp_path)  # SystemExit naming the anchor when one does not occur exactly once
    assert (tmp_path / mutant.path).read_text() != before


def test_a_stale_anchor_is_refused(tmp_path):
    stale = judge_mutants.Mutant("stale", "an anchor the judge no longer has", "harness/reference/tolerance.py",
                                 (("TRAJECTORY_FACTOR = 4.0 # not in the file", "TRAJECTORY_FACTOR = 40.0"),))
    (tmp_path / stale.path).parent.mkdir(parents=True)
    shutil.copy(REPO / stale.path, tmp_path / stale.path)
    with pytest.raises(SystemExit, match="0 occurrences"):
        judge_mutants.apply(stale, tmp_path)
