"""Root conftest: options and markers shared by the test tiers (see tests/README.md)."""

import os
import time

import pytest

# Pin intra-op threads before torch spins up its pool: equal thread counts in every process keep
# float reduction order, and so results, identical across world sizes.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption("--world-sizes", default="1,2,4,8", help="world sizes of the slow matrix tests")
    parser.addoption("--impls", default="ours,fsdp2", help="implementations of the slow matrix tests")


# -- progress and expected duration of the whole suite --------------------------------------------
# Measured (README "Measured figures"): the default command, `python -m pytest -n 2 -q`, took about
# 22 min on CI's machine, 31 min on the project's 2-core VM nearly alone and 46-65 min while
# other jobs shared it. The slow tier runs for minutes between dots, so a line every
# PROGRESS_EVERY_S seconds says how far the run is.
EXPECTED_SUITE_MINUTES = 25
PROGRESS_EVERY_S = 60.0


class _Progress:
    def __init__(self, config) -> None:
        self.clock = time.monotonic
        self.config = config
        self.start = self.last = self.clock()
        self.total = 0
        self.done = 0

    def pytest_sessionstart(self, session) -> None:
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:  # shown with -q too, unlike the report header
            terminal.write_line(f"expected duration: about {EXPECTED_SUITE_MINUTES} min for the whole suite with -n 2 "
                                f"on a quiet 2-core machine, longer when it is shared (README: Measured figures); a progress line every "
                                f"{PROGRESS_EVERY_S:.0f} s")

    def pytest_collection_finish(self, session) -> None:
        self.total = self.total or len(session.items)

    @pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown to pytest without xdist
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self.total = max(self.total, len(ids))

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "teardown":
            return
        self.done += 1
        now = self.clock()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            minutes, seconds = divmod(int(now - self.start), 60)
            terminal = self.config.pluginmanager.get_plugin("terminalreporter")
            if terminal is not None:
                terminal.write_line(f"[progress {minutes}m{seconds:02d}s] {self.done}/{self.total or '?'} tests done "
                                    f"(expected about {EXPECTED_SUITE_MINUTES} min in all)")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller reports progress, not xdist's workers
        config.pluginmanager.register(_Progress(config), "suite-progress")
