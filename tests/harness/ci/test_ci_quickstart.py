"""CI runs the README's quick-start commands verbatim (.ci/run reads them through .ci/quickstart.py):
a change to the README's test command changes what CI runs, and a README without them stops CI."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _ci_copy(tmp_path: Path, readme: str) -> Path:
    (tmp_path / ".ci").mkdir()
    for name in ("run", "quickstart.py"):
        shutil.copy(REPO / ".ci" / name, tmp_path / ".ci" / name)
    (tmp_path / "README.md").write_text(readme)
    return tmp_path


def _dry_run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CI_DRY_RUN": "1"})


def test_ci_runs_the_readmes_quick_start_commands_verbatim(tmp_path):
    readme = (REPO / "README.md").read_text()
    proc = _dry_run(_ci_copy(tmp_path, readme))
    assert proc.returncode == 0, proc.stderr
    ran = [line.removeprefix("ci: would run: ") for line in proc.stdout.splitlines()]
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.strip() for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2 and ran[:2] == [commands[1], commands[0]], (ran, commands)


def test_changing_the_readmes_test_command_changes_what_ci_runs(tmp_path):
    readme = (REPO / "README.md").read_text()
    changed = readme.replace("python -m pytest -n 2 -q\n", "python -m pytest -n 2 -q -x --planted-change\n", 1)
    assert changed != readme, "the README's test command no longer ends in 'python -m pytest -n 2 -q'"
    proc = _dry_run(_ci_copy(tmp_path, changed))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].endswith("python -m pytest -n 2 -q -x --planted-change"), proc.stdout


def test_a_readme_without_its_quick_start_commands_stops_ci_before_anything_runs(tmp_path):
    proc = _dry_run(_ci_copy(tmp_path, "# fsdp-equiv\n\n## Quick start\n\nNo commands here.\n"))
    assert proc.returncode == 2 and "quick start must hold exactly 2 commands" in proc.stderr, proc.stderr
    assert "would run" not in proc.stdout
