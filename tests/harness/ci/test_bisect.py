"""`python -m harness bisect`: the first bad commit named in a scratch repository, the user's work
tree, index and HEAD untouched, the temporary worktree gone afterwards (also after Ctrl-C)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.scratch_repo import (REPO, append, commit_all, copy_project, drop_grad_average, git, harness, init_repo,
                          repo_state)

sys.path.insert(0, str(REPO))
from harness.ci.bisect_step import map_exit_code  # noqa: E402

# The cheapest gate that sees a missing gradient average: W = 2 with identical data doubles every
# gradient at step 1 (at W = 1 the division by 1 is a no-op).
CHEAP_GATE = ["--cases", "mlp", "--world-sizes", "2", "--data", "identical", "--steps", "1", "--timeout", "300"]


def test_step_exit_codes_follow_git_bisect_run():
    assert [map_exit_code(rc) for rc in (0, 1, 2, 125, 124, 137, -9)] == [0, 1, 125, 125, 125, 125, 125]


@pytest.mark.slow
def test_bisect_names_the_commit_that_drops_the_gradient_average(tmp_path):
    # The last commit's project (a history needs commits), bisected by the work tree's bisect verb.
    repo = copy_project(tmp_path / "repo", source="head")
    good = init_repo(repo)
    append(repo / "README.md", "\nA neutral note.\n")
    commit_all(repo, "docs: a neutral note")
    drop_grad_average(repo)
    bug = commit_all(repo, "impl: skip the division after the reduce-scatter")
    append(repo / "tests" / "README.md", "\nAnother neutral note.\n")
    commit_all(repo, "tests: a neutral note")
    append(repo / "cases" / "__init__.py", "\n# a neutral comment\n")
    commit_all(repo, "cases: a neutral comment")
    before = repo_state(repo)

    rc, out = harness(["bisect", "--repo", str(repo), "--good", good, "--bad", "HEAD", "--out", str(tmp_path / "bisect"),
                       *CHEAP_GATE], cwd=REPO, timeout=1200)

    assert rc == 0, out[-4000:]
    assert f"first bad commit: {bug} impl: skip the division after the reduce-scatter" in out, out[-4000:]
    # the failing cell of that commit, with the parameter whose gradient diverged
    assert re.search(r"FAIL mlp\.ours\.w2\.identical optimizer=\w+ step=1 grad: '[\w.]+'", out), out[-4000:]
    assert repo_state(repo) == before
    assert not list(tmp_path.glob("repo/.git/worktrees/*"))


def _tiny_repo(path: Path, harness_main: str | None) -> tuple[str, str]:
    """Two commits of a repository that is not this project (no harness at all, or a stand-in)."""
    path.mkdir()
    (path / "README.md").write_text("scratch\n")
    if harness_main is not None:
        (path / "harness").mkdir()
        (path / "harness" / "__init__.py").write_text("")
        (path / "harness" / "__main__.py").write_text(harness_main)
    good = init_repo(path, "first")
    append(path / "README.md", "more\n")
    return good, commit_all(path, "second")


def test_a_good_revision_that_cannot_be_tested_is_refused_and_cleaned_up(tmp_path):
    good, bad = _tiny_repo(tmp_path / "repo", harness_main=None)
    before = repo_state(tmp_path / "repo")
    rc, out = harness(["bisect", "--repo", str(tmp_path / "repo"), "--good", good, "--bad", bad,
                       "--out", str(tmp_path / "out")], cwd=REPO, timeout=120)
    assert rc == 2, out
    assert f"--good={good} ({good[:12]}) cannot be tested" in out
    assert repo_state(tmp_path / "repo") == before


def test_unknown_or_reversed_revisions_are_usage_errors(tmp_path):
    good, bad = _tiny_repo(tmp_path / "repo", harness_main=None)
    rc, out = harness(["bisect", "--repo", str(tmp_path / "repo"), "--good", "nosuchrev", "--bad", bad],
                      cwd=REPO, timeout=60)
    assert rc == 2 and "--good=nosuchrev is not a commit" in out, out
    rc, out = harness(["bisect", "--repo", str(tmp_path / "repo"), "--good", bad, "--bad", good],
                      cwd=REPO, timeout=60)
    assert rc == 2 and "is not an ancestor of --bad" in out, out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_removes_the_worktree_and_stops_the_step(tmp_path, sig):
    # A stand-in harness whose gate blocks: the bisect is stopped (Ctrl-C, CI cancellation, a
    # closed terminal) while it runs.
    good, bad = _tiny_repo(tmp_path / "repo", harness_main=(
        "import pathlib, sys, time\n"
        f"pathlib.Path({str(tmp_path / 'started')!r}).write_text('x')\n"
        "time.sleep(600)\n"))
    repo = tmp_path / "repo"
    before = repo_state(repo)
    proc = subprocess.Popen([sys.executable, "-m", "harness", "bisect", "--repo", str(repo), "--good", good,
                             "--bad", bad, "--out", str(tmp_path / "out")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600  # a guard against waiting forever, not a speed claim
    while not (tmp_path / "started").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    assert len(git(repo, "worktree", "list").splitlines()) == 2  # the temporary worktree exists now
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 128 + sig, out  # stopped: neither "bad commit" (1) nor "cannot test" (125)
    assert f"interrupted by {signal.Signals(sig).name}" in out
    assert repo_state(repo) == before
    assert not list((repo / ".git").glob("worktrees/*"))
    stand_ins = subprocess.run(["pgrep", "-f", str(tmp_path / "out")], capture_output=True, text=True).stdout
    assert not [p for p in stand_ins.split() if int(p) != os.getpid()], "a step outlived the interrupted bisect"


def test_a_worktree_left_by_a_killed_bisect_is_pruned_by_the_next(tmp_path):
    from harness.ci.bisect import OWNER_FILE, TMP_PREFIX
    from harness.run.lifeline import token

    good, bad = _tiny_repo(tmp_path / "repo", harness_main=None)
    repo = tmp_path / "repo"
    before = repo_state(repo)
    dead = subprocess.Popen(["true"])
    dead_token = token(dead.pid)  # read while it exists
    dead.wait()
    stale, alive = tmp_path / f"{TMP_PREFIX}stale", tmp_path / f"{TMP_PREFIX}alive"
    for tmp, owner in ((stale, dead_token), (alive, token())):
        tmp.mkdir()
        (tmp / OWNER_FILE).write_text(owner + "\n")
        git(repo, "worktree", "add", "--detach", str(tmp / "worktree"), bad)
    rc, out = harness(["bisect", "--repo", str(repo), "--good", "nosuchrev", "--bad", bad,
                       "--out", str(tmp_path / "out")], cwd=REPO, timeout=60)
    assert rc == 2, out
    assert f"removed {stale / 'worktree'}, the worktree of an earlier bisect that was killed" in out, out
    worktrees = git(repo, "worktree", "list", "--porcelain")
    assert str(stale) not in worktrees and not stale.exists()
    assert str(alive / "worktree") in worktrees  # this process owns it: still running, left alone
    git(repo, "worktree", "remove", "--force", str(alive / "worktree"))
    assert repo_state(repo) == before
