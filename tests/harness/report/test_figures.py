"""harness/report/figures.py: docs/measured.md's generated table is what reports/ says, and a
changed report changes it (`python -m harness figures --check` then fails)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _figures(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "figures", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_the_committed_table_is_what_reports_say():
    done = _figures("--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_changed_report_makes_the_table_stale(tmp_path):
    reports = tmp_path / "reports"
    shutil.copytree(REPO / "reports" / "bench", reports / "bench")
    shutil.copy(REPO / "reports" / "summary.json", reports / "summary.json")
    doc = tmp_path / "measured.md"
    doc.write_text((REPO / "docs" / "measured.md").read_text())
    assert _figures("--reports", str(reports), "--doc", str(doc)).returncode == 0
    assert _figures("--reports", str(reports), "--doc", str(doc), "--check").returncode == 0
    summary = json.loads((reports / "summary.json").read_text())
    summary["cells"][0]["verdict"] = "fail"
    (reports / "summary.json").write_text(json.dumps(summary))
    stale = _figures("--reports", str(reports), "--doc", str(doc), "--check")
    assert stale.returncode == 1 and "stale" in stale.stdout, stale.stdout + stale.stderr
    assert _figures("--reports", str(reports), "--doc", str(doc)).returncode == 0
    n = len(summary["cells"])
    assert f"{n - 1}/{n} cells pass" in doc.read_text()


def test_a_document_without_the_block_is_refused(tmp_path):
    doc = tmp_path / "other.md"
    doc.write_text("# nothing generated here\n")
    done = _figures("--doc", str(doc))
    assert done.returncode == 2 and "no generated-figures block" in done.stderr, done.stderr
