"""The output directory (harness/run/output.py): owned, locked, cleaned only of the harness's own
files, and its report set written whole or not at all (fast, no ranks)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

import harness.run.output
from harness.run.output import MARKER, STATE, OutputDir, OutputError

GENERATED = ("snapshots", "logs", "init")
REPO = Path(__file__).resolve().parents[3]
REPORTS = {"report.md": "# r\n", "junit.xml": "<testsuite/>\n", "summary.json": "{}\n"}


def _run(path, run_id="a" * 32, logs=("w1-0/torchrun.log",), reports=REPORTS) -> None:
    """One run: writes its generated files and its report set."""
    with OutputDir(path, run_id, GENERATED) as out:
        for rel in logs:
            (path / "logs" / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / "logs" / rel).write_text(run_id)
        out.write_report_set(dict(reports))


def test_an_empty_out_is_refused():
    with pytest.raises(OutputError, match="--out is empty"):
        OutputDir("", "a" * 32, GENERATED).open()


def test_a_users_non_empty_directory_is_refused_and_left_alone(tmp_path):
    mine = tmp_path / "mine"
    (mine / "logs").mkdir(parents=True)
    (mine / "logs" / "mine.txt").write_text("keep")
    (mine / "init").mkdir()
    (mine / "init" / "seed.cfg").write_text("keep")
    with pytest.raises(OutputError, match="not empty and was not created by the harness"):
        OutputDir(mine, "a" * 32, GENERATED).open()
    assert sorted(str(p.relative_to(mine)) for p in mine.rglob("*")) == ["init", "init/seed.cfg", "logs", "logs/mine.txt"]


def test_a_second_run_deletes_only_the_files_the_first_one_wrote(tmp_path):
    out = tmp_path / "out"
    _run(out, logs=("w1-0/torchrun.log", "w1-0/ranks/0/stderr.log"))
    (out / "logs" / "mine.txt").write_text("a user's note, added later")
    (out / "logs" / "w1-0" / "notes.txt").write_text("inside a directory of the harness")
    (out / "README").write_text("the user's")
    _run(out, "b" * 32, logs=("w2-0/torchrun.log",), reports={"report.md": "# second\n"})
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == [MARKER, STATE, "README", "logs/mine.txt", "logs/w1-0/notes.txt", "logs/w2-0/torchrun.log",
                     "report.md"], files
    assert (out / "report.md").read_text() == "# second\n"  # and the first run's junit.xml is gone, not stale


def test_a_run_killed_before_recording_its_files_is_cleaned_by_the_next(tmp_path):
    out = tmp_path / "out"
    _run(out)
    (out / "logs" / "mine.txt").write_text("pre-existing")
    killed = OutputDir(out, "k" * 32, GENERATED)
    killed.open()
    (out / "snapshots" / "cell").mkdir(parents=True)
    (out / "snapshots" / "cell" / "sgd.pt").write_text("evidence of the killed run")
    killed.close(record=False)  # as after SIGKILL: STATE still says "running"
    _run(out, "c" * 32, logs=())
    assert not (out / "snapshots").exists()
    assert (out / "logs" / "mine.txt").read_text() == "pre-existing"


def test_a_second_concurrent_run_is_refused(tmp_path):
    out = tmp_path / "out"
    with OutputDir(out, "a" * 32, GENERATED):
        with pytest.raises(OutputError, match=rf"--out={out} is in use by another harness run \(pid {os.getpid()}\)"):
            OutputDir(out, "b" * 32, GENERATED).open()
    OutputDir(out, "c" * 32, GENERATED).open()  # free again once the first one ended


def test_a_symlinked_generated_directory_is_refused(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    _run(out)
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep")
    (out / "logs").rename(tmp_path / "old-logs")
    (out / "logs").symlink_to(elsewhere)
    with pytest.raises(OutputError, match="is a symbolic link"):
        OutputDir(out, "b" * 32, GENERATED).open()
    assert (elsewhere / "precious.txt").read_text() == "keep"


def test_a_failing_report_write_leaves_no_report_rather_than_a_mix(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _run(out, reports={**REPORTS, "report.md": "# first run: PASS\n"})
    real_open = open

    def full_disk(path, *args, **kwargs):
        if str(path).endswith("summary.json"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(harness.run.output, "open", full_disk, raising=False)
    with pytest.raises(OSError, match="No space left"):
        _run(out, "b" * 32, reports={**REPORTS, "report.md": "# second run: FAIL\n"})
    left = sorted(p.name for p in out.iterdir())
    assert left == [MARKER, STATE, "logs"], left  # neither the first run's reports nor part of the second's


@pytest.mark.slow
@pytest.mark.core
def test_a_passing_cell_leaves_its_report_not_its_snapshots_and_a_failing_one_keeps_them(tmp_path):
    """A run keeps full tensors only around a failure (the failing cell and its reference);
    --keep-evidence keeps every cell's."""
    def run(out, *extra):
        return subprocess.run([sys.executable, "-m", "harness", "run", "--cases", "mlp", "--impls", "ours",
                               "--world-sizes", "2", "--data", "split", "--steps", "1", "--quiet", "--out", str(out),
                               *extra], cwd=REPO, capture_output=True, text=True, timeout=600)

    proc = run(tmp_path / "pass")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "pass" / "report.md").exists() and not list((tmp_path / "pass").glob("snapshots/*/*.pt"))
    proc = run(tmp_path / "fail", "--faults", "grad_scale_1e-5")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    kept = sorted(p.parent.name for p in (tmp_path / "fail").glob("snapshots/*/*.pt"))
    assert set(kept) == {"ref.mlp", "mlp.ours.w2.split.grad_scale_1e-5"}, kept
    proc = run(tmp_path / "keep", "--keep-evidence")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert {p.parent.name for p in (tmp_path / "keep").glob("snapshots/*/*.pt")} == {"ref.mlp", "mlp.ours.w2.split"}
