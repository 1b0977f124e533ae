"""Wall time of one matrix run batched (one torchrun per world size) against one torchrun per
cell, measured back to back in one process: `python -m harness.measure_batching [run flags]`.
Prints both times and the ratio, and writes them as JSON to --out/batching.json."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _timed(args: list[str], out: Path) -> tuple[float, int]:
    start = time.monotonic()
    rc = subprocess.run([sys.executable, "-m", "harness", "run", *args, "--out", str(out), "--quiet"]).returncode
    return time.monotonic() - start, rc


def main(argv: list[str]) -> int:
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else Path("runs/batching")
    args = [a for i, a in enumerate(argv) if a != "--out" and (i == 0 or argv[i - 1] != "--out")]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        batched_s, rc_batched = _timed(args, Path(tmp) / "batched")
        per_cell_s, rc_per_cell = _timed([*args, "--launch-per-cell"], Path(tmp) / "per_cell")
        cells = len(json.loads((Path(tmp) / "batched" / "summary.json").read_text())["cells"])
    result = {
        "cells": cells, "batched_s": round(batched_s, 1), "per_cell_s": round(per_cell_s, 1),
        "ratio": round(per_cell_s / batched_s, 2), "exit_codes": [rc_batched, rc_per_cell],
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, gloo, torch run by {sys.executable}",
        "args": args,
    }
    (out / "batching.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if rc_batched == rc_per_cell == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
