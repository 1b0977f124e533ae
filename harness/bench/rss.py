"""A process's own peak RSS, for the bench's figures (no torch: the verify-cost part reads it in
the process that ran `harness run`, after the run)."""

from __future__ import annotations

import resource


def own_peak_rss_bytes() -> int:
    """This process's own peak RSS: its address space's high-water mark (VmHWM). RUSAGE_SELF's
    maxrss also counts, on Linux, the process this one was forked from up to its execve (a rank's
    torchrun agent; the bench itself for the `harness run` it launches: once 1.0 GB printed where
    the run held 0.43), which is not this process's memory; it serves where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
