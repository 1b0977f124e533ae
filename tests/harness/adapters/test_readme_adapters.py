"""The README's adapter examples, extracted from the README itself and run by the real CLI.

fast: both adapter files are there and each is at most ten lines of code.
slow: MyFSDP2 and MyFSDP1 pass (mlp, W = 1 and 2, split data); BuggyFSDP1 (a comm hook that
sums without averaging) fails at W = 2 on the gradient check at step 1 with every gradient W times
the mean, and passes at W = 1, where nothing is reduced.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
FILE_LINE = re.compile(r"# (\w+\.py)(, continued)?:")


def readme_files() -> dict[str, str]:
    """File name -> source, from the README's python blocks whose first line names a file."""
    files: dict[str, str] = {}
    for block in re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S):
        match = FILE_LINE.match(block)
        if match:
            name, continued = match.groups()
            assert continued or name not in files, f"README names {name} twice without ', continued'"
            files[name] = files.get(name, "") + ("\n\n" if continued else "") + block
    return files


def _code_lines(source: str) -> int:
    return sum(1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))


def test_the_readme_has_a_ten_line_adapter_for_fsdp2_and_for_fsdp1():
    files = readme_files()
    assert {"my_fsdp2.py", "my_fsdp1.py"} <= set(files), sorted(files)
    assert _code_lines(files["my_fsdp2.py"]) <= 10
    fsdp1 = files["my_fsdp1.py"].split("# my_fsdp1.py, continued")[0]
    assert _code_lines(fsdp1) <= 10, fsdp1


@pytest.mark.slow
def test_the_readme_adapters_pass_and_the_planted_comm_hook_bug_fails(tmp_path):
    for name, source in readme_files().items():
        (tmp_path / name).write_text(source)
    impls = f"{tmp_path}/my_fsdp2.py:MyFSDP2,{tmp_path}/my_fsdp1.py:MyFSDP1,{tmp_path}/my_fsdp1.py:BuggyFSDP1"
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "run", "--cases", "mlp", "--impls", impls, "--world-sizes", "1,2",
         "--data", "split", "--steps", "2", "--timeout", "1200", "--out", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=2400)
    assert proc.returncode == 1, proc.stdout[-3000:]
    cells = {c["cell_id"]: c for c in json.loads((out / "summary.json").read_text())["cells"]}
    for impl in ("my_fsdp2", "my_fsdp1"):
        for w in (1, 2):
            cell = cells[f"mlp.{impl}.w{w}.split"]
            assert cell["verdict"] == "pass", cell["first_divergence_text"] or cell["error"]
    assert cells["mlp.buggy_fsdp1.w1.split"]["verdict"] == "pass"
    buggy = cells["mlp.buggy_fsdp1.w2.split"]
    assert buggy["verdict"] == "fail" and buggy["first_check"] == "grad", buggy
    first = buggy["first_divergence"]
    assert first["step"] == 1 and abs(first["actual"] - 2 * first["expected"]) <= 2 * first["tol"], first
    assert f"FAIL {buggy['first_divergence_text']}" in proc.stdout
