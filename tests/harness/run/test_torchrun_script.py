"""tests/support/torchrun_script.py: a hung rank script fails its test with every rank's stacks and leaves
nothing running (slow tier)."""

from __future__ import annotations

import os
import textwrap

import pytest
from tests.support.torchrun_script import run_rank_script

pytestmark = pytest.mark.slow

HUNG = textwrap.dedent("""
    import time
    import torch.distributed as dist
    from harness.run.rank import rank_prologue

    def rank1_waits_forever():
        time.sleep(3600)

    rank_prologue(threads=1)
    if dist.get_rank() == 1:
        rank1_waits_forever()
    dist.barrier()
""")


def test_a_hung_launch_fails_with_the_ranks_stacks(tmp_path):
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    with pytest.raises(AssertionError) as failure:
        run_rank_script(script, 2, tmp_path, timeout_s=15)
    text = str(failure.value)
    assert text.startswith("hung.py at W=2: launch W=2 timed out"), text
    # faulthandler's dump of rank 1 (the sleeper) and of rank 0 (in the barrier)
    assert "in rank1_waits_forever" in text and "in barrier" in text, text
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and str(script).encode() in _cmdline(pid)]


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
