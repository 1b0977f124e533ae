"""One `git bisect run` step: run the checked-out commit's OWN gate and map its exit code.

Run as a script (`python bisect_step.py OUT -- GATE_FLAGS`) with the bisect worktree as the
current directory; standard library only, because it must not import this commit's harness (it
runs the commit's harness in a child process: cwd and PYTHONPATH = the worktree).

    gate 0 -> 0 (good), 1 -> 1 (bad: a cell failed, crashed or hung),
    125 -> 125 (cannot test: the project does not import),
    2 -> 125 (this commit's harness rejects the flags: it cannot be tested with them),
    anything else (killed, timed out) -> 125.
A commit without harness/ at all cannot be tested either: 125. A step never answers >= 128,
which would abort the whole bisect.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

GOOD, BAD, SKIP = 0, 1, 125
STEP_FILE = "bisect_step.json"
INTERRUPT_GRACE_S = 60.0


def map_exit_code(rc: int) -> int:
    return {0: GOOD, 1: BAD}.get(rc, SKIP)


def run_step(worktree: Path, out_root: Path, gate_flags: list[str], timeout_s: float | None = None) -> int:
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=worktree, capture_output=True, text=True,
                         check=True).stdout.strip()
    out = out_root / sha
    out.mkdir(parents=True, exist_ok=True)
    if not (worktree / "harness" / "__main__.py").exists():
        rc, mapped = None, SKIP
        print(f"bisect step {sha[:12]}: no harness/__main__.py in this commit: cannot test (125)", flush=True)
    else:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(worktree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        cmd = [sys.executable, "-m", "harness", "gate", *gate_flags, "--out", str(out), "--quiet"]
        proc = subprocess.Popen(cmd, cwd=worktree, env=env)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            rc = None
        except KeyboardInterrupt:  # the gate got SIGINT too: let it stop its own torchrun first
            try:
                proc.wait(timeout=INTERRUPT_GRACE_S)
            finally:
                if proc.poll() is None:
                    proc.kill()
            raise
        if rc is None:
            try:
                proc.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        mapped = SKIP if rc is None else map_exit_code(rc)
        print(f"bisect step {sha[:12]}: gate exit {rc} -> {mapped}", flush=True)
    (out / STEP_FILE).write_text(json.dumps({"sha": sha, "gate_exit": rc, "bisect_exit": mapped}) + "\n")
    return mapped


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 1:
        print("usage: bisect_step.py OUT -- GATE_FLAGS", file=sys.stderr)
        return SKIP
    try:
        return run_step(Path.cwd(), Path(argv[0]), argv[2:])
    except Exception as e:  # anything that stops us from testing is "cannot test", never "bad"
        print(f"bisect step: cannot test: {type(e).__name__}: {e}", file=sys.stderr)
        return SKIP


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
