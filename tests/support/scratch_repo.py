"""Scratch git repositories built from this project's files, for the bisect and baseline tests.

Not a test module (pytest collects test_*.py only). The copy is the work tree as git sees it
(tracked and untracked-but-not-ignored files) or the last commit; see copy_project.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GIT_IDENTITY = ("-c", "user.name=scratch", "-c", "user.email=scratch@example.invalid", "-c", "commit.gpgsign=false")


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", *GIT_IDENTITY, *args], cwd=repo, capture_output=True, text=True)
    assert proc.returncode == 0, f"git {' '.join(args)} in {repo}: {proc.stderr}"
    return proc.stdout.strip()


def copy_project(dst: Path, source: str = "worktree") -> Path:
    """The project's files into `dst`: the work tree as git sees it (tracked and untracked-but-not-
    ignored files: the code under test), or with source="head" the last commit (a consistent
    project even while files are being edited, e.g. to build a history on top of it)."""
    dst.mkdir(parents=True, exist_ok=True)
    if source == "head":
        archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=REPO, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dst)], input=archive.stdout, check=True)
        return dst
    assert source == "worktree", f"source={source!r} is not 'worktree' or 'head'"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():  # a tracked file deleted in the work tree is not part of it
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


def init_repo(path: Path, message: str = "base: the project as it is") -> str:
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", message)
    return git(path, "rev-parse", "HEAD")


def edit(path: Path, pattern: str, replacement: str) -> None:
    """Replace exactly one match of the regex `pattern` (fails loudly when the file changed shape)."""
    text = path.read_text()
    new, count = re.subn(pattern, replacement, text, flags=re.MULTILINE)
    assert count == 1, f"{path}: {count} matches of {pattern!r}; the planted edit needs exactly one"
    path.write_text(new)


def append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def commit_all(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def drop_grad_average(repo: Path) -> None:
    """The planted bug: the reduce-scattered gradient is never divided by the data-parallel size."""
    edit(repo / "impl" / "_handle.py", r"^(\s*)sharded_grad\.div_\(divisor\)$", r"\1pass")


def scale_first_layer_init(repo: Path, factor: float = 1.5) -> None:
    """A change to the model math that sharding cannot see: the MLP's first layer starts larger."""
    edit(repo / "cases" / "catalog.py", r"^def _mlp\(\) -> nn\.Module:\n    return MLP\(_MLP_SIZES\)$",
         "def _mlp() -> nn.Module:\n    model = MLP(_MLP_SIZES)\n"
         f"    model.layers[0].weight.data.mul_({factor})\n    return model")


def repo_state(repo: Path) -> dict:
    """What a bisect must leave untouched: HEAD, the branch, the index, the work tree, worktrees."""
    return {
        "head": git(repo, "rev-parse", "HEAD"),
        "branch": git(repo, "symbolic-ref", "--quiet", "HEAD"),
        "index": git(repo, "write-tree"),
        "status": git(repo, "status", "--porcelain", "--untracked-files=all"),
        "worktrees": git(repo, "worktree", "list", "--porcelain"),
    }


def harness(args: list[str], cwd: Path, timeout: float, env: dict | None = None) -> tuple[int, str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(cwd), **(env or {})}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr + f"\n[{time.monotonic() - start:.0f}s]"
