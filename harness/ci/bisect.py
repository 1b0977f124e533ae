"""`python -m harness bisect --good REV --bad REV [gate flags]`: the first commit whose gate fails.

Everything happens in a temporary `git worktree` (detached), so the user's work tree, index and
HEAD are never touched; the worktree is removed afterwards, also after Ctrl-C, SIGTERM, SIGHUP or
an exception. One left behind by a bisect that was killed outright (SIGKILL) is removed by the
next bisect of that repository: its temporary directory names the process that owned it.
Each commit is judged by its OWN harness: the step (harness/ci/bisect_step.py, copied out of the
work tree first, standard library only) runs `python -m harness gate GATE_FLAGS` with cwd and
PYTHONPATH = the worktree, and maps "could not test" to 125 for `git bisect run`.

Before bisecting, GOOD must pass and BAD must fail (else the range does not bracket a regression
and bisecting it would name a meaningless commit). Exit codes of the verb: 0 a first bad commit
was named, 1 git could not name one (only untestable commits left), 2 bad usage (unknown
revision, GOOD not an ancestor of BAD, GOOD does not pass, BAD does not fail).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from harness.run import lifeline
from harness.errors import UserError
from harness.run.output import OutputDir

STEP_SCRIPT = Path(__file__).resolve().parent / "bisect_step.py"
TMP_PREFIX = "harness-bisect-"
OWNER_FILE = "owner"  # in the temporary directory: lifeline.token() of the bisect that made it
INTERRUPT_GRACE_S = 60.0  # a gate needs a moment to stop its torchrun and write nothing further


class BisectError(UserError):
    """The request cannot be bisected (see the module docstring); the CLI answers exit 2."""


def _git(cwd: Path, *args: str, check: bool = True) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise BisectError(f"git {' '.join(args)} (in {cwd}) failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip()


def _resolve(repo: Path, rev: str, flag: str) -> str:
    proc = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=repo,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise BisectError(f"{flag}={rev} is not a commit of {repo}")
    return proc.stdout.strip()


def _run_group(cmd: list[str], cwd: Path, log) -> int:
    """Run `cmd` in its own session, teeing its output to stdout and `log`. On Ctrl-C or any
    exception the whole session gets SIGINT (gates stop their torchrun on it), then SIGKILL."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        line = "\n"
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
        if not line.endswith("\n"):  # git bisect run's last line has none
            sys.stdout.write("\n")
        return proc.wait()
    except BaseException:
        for sig, grace in ((signal.SIGINT, INTERRUPT_GRACE_S), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        raise


def _step_command(step_script: Path, steps_dir: Path, gate_flags: list[str]) -> list[str]:
    return [sys.executable, str(step_script), str(steps_dir), "--", *gate_flags]


def failing_cells_report(step_dir: Path) -> str:
    """The failing and crashed cells of one commit's gate, from the summary it wrote."""
    summary = step_dir / "summary.json"
    if not summary.exists():
        step = step_dir / "bisect_step.json"
        info = json.loads(step.read_text()) if step.exists() else {}
        return f"  (no gate summary in {step_dir}; gate exit {info.get('gate_exit')})"
    data = json.loads(summary.read_text())
    lines = []
    def first_line(text: str | None) -> str:
        return (text or "").strip().splitlines()[0] if (text or "").strip() else ""

    for cell in data["cells"]:
        if cell["verdict"] == "fail":
            lines.append(f"  FAIL {cell['first_divergence_text']}")
        elif cell["verdict"] != "pass":
            lines.append(f"  {cell['verdict'].upper()} {cell['cell_id']}: {first_line(cell.get('error'))}")
    for ref in data.get("references", []):
        if ref["verdict"] != "pass":
            lines.append(f"  {ref['verdict'].upper()} ref.{ref['case']}: {first_line(ref.get('error'))}")
    md = step_dir / "summary.md"
    if md.exists():
        lines.append(f"  (gate summary: {md}; full report: {step_dir / 'report.md'})")
    return "\n".join(lines) if lines else "  (the gate summary lists no failing cell)"


def prune_stale_worktrees(top: Path) -> list[Path]:
    """Remove the worktrees of earlier bisects that died without cleaning up: registered in `top`,
    inside a TMP_PREFIX directory whose owner process is gone (or that no longer exists)."""
    removed = []
    for line in _git(top, "worktree", "list", "--porcelain", check=False).splitlines():
        path = Path(line.removeprefix("worktree "))
        if not line.startswith("worktree ") or path.name != "worktree" or not path.parent.name.startswith(TMP_PREFIX):
            continue
        try:
            owner = (path.parent / OWNER_FILE).read_text().strip()
        except OSError:
            owner = ""
        if path.exists() and (not owner or lifeline.alive(owner)):
            continue  # a bisect still running, or one we cannot prove dead
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=top, capture_output=True)
        shutil.rmtree(path.parent, ignore_errors=True)
        removed.append(path)
    return removed


def bisect(repo: str | Path, good: str, bad: str, gate_flags: list[str], out: str | Path) -> int:
    top = Path(_git(Path(repo).resolve(), "rev-parse", "--show-toplevel"))
    for stale in prune_stale_worktrees(top):
        print(f"harness bisect: removed {stale}, the worktree of an earlier bisect that was killed", flush=True)
    good_sha, bad_sha = _resolve(top, good, "--good"), _resolve(top, bad, "--bad")
    if good_sha == bad_sha:
        raise BisectError(f"--good={good} and --bad={bad} are the same commit {good_sha[:12]}")
    if subprocess.run(["git", "merge-base", "--is-ancestor", good_sha, bad_sha], cwd=top).returncode != 0:
        raise BisectError(f"--good={good} ({good_sha[:12]}) is not an ancestor of --bad={bad} ({bad_sha[:12]})")
    out_root = Path(out).resolve()
    output = OutputDir(out_root, uuid.uuid4().hex, ("steps", "bisect.log", "bisect_log.txt"))
    output.open()  # owned and locked, or refused (exit 2) before any commit is checked out
    steps_dir = out_root / "steps"
    steps_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
    (tmp / OWNER_FILE).write_text(lifeline.token() + "\n")
    worktree = tmp / "worktree"
    step_script = tmp / "bisect_step.py"  # the user's copy may change while we bisect
    shutil.copy2(STEP_SCRIPT, step_script)
    step = _step_command(step_script, steps_dir, gate_flags)
    added = False
    try:
        with open(out_root / "bisect.log", "w") as log:
            added = True  # before the add: a signal during it must still remove the worktree
            _git(top, "worktree", "add", "--detach", str(worktree), bad_sha)
            for flag, rev, sha, want in (("--good", good, good_sha, 0), ("--bad", bad, bad_sha, 1)):
                _git(worktree, "checkout", "--quiet", "--detach", sha)
                print(f"harness bisect: checking {flag}={rev} ({sha[:12]})", flush=True)
                rc = _run_group(step, worktree, log)
                if rc != want:
                    verdict = {0: "passes", 1: "fails", 125: "cannot be tested"}.get(rc, f"exit {rc}")
                    raise BisectError(f"{flag}={rev} ({sha[:12]}) {verdict}, but it must "
                                      f"{'pass' if want == 0 else 'fail'} with these flags; its report: "
                                      f"{steps_dir / sha}\n{failing_cells_report(steps_dir / sha)}")
            _git(worktree, "bisect", "start", bad_sha, good_sha)
            rc = _run_group(["git", "bisect", "run", *step], worktree, log)
            bisect_log = _git(worktree, "bisect", "log", check=False)
            _git(worktree, "bisect", "reset", "--quiet", check=False)
        (out_root / "bisect_log.txt").write_text(bisect_log + "\n")
    finally:
        if added:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=top, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=top, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        output.close()
    found = re.search(r"^# first bad commit: \[([0-9a-f]{40})\]", bisect_log, re.MULTILINE)
    if rc != 0 or not found:
        print(f"harness bisect: git bisect run could not name a first bad commit (exit {rc}); "
              f"see {out_root / 'bisect.log'}", file=sys.stderr)
        return 1
    sha = found.group(1)
    subject = _git(top, "log", "-1", "--format=%s", sha)
    print(f"first bad commit: {sha} {subject}")
    print(f"failing cells at {sha[:12]}:")
    print(failing_cells_report(steps_dir / sha))
    return 0
