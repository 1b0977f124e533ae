"""Root conftest: options, markers and the tiers of the test command (see tests/README.md).

Tiers (--tier): `default`, what `python -m pytest -n 2 -q` runs before a merge, is every fast
test and the slow tests marked `core` (the standard matrix and the planted-bug battery, each
configuration in one shared launch); `extended` is the other slow tests (real architectures,
feature cases, crash and hang handling, fuzz pools, adapters, gate, bisect, bench), which CI runs
after the default tier (.ci/run); `all` is both."""

import os
import time

import pytest

# Pin intra-op threads before torch spins up its pool: equal thread counts in every process keep
# float reduction order, and so results, identical across world sizes.
os.environ.setdefault("OMP_NUM_THREADS", "1")


TIERS = ("default", "extended", "all")
TIER_TEXT = {"default": "fast tests and the core slow tests; --tier extended runs the other slow tests",
             "extended": "the slow tests outside the core", "all": "every test"}


def pytest_addoption(parser):
    parser.addoption("--tier", default=None, choices=TIERS,
                     help="default: fast tests and the core slow tests; extended: the other slow tests; all: both "
                          "(without --tier: default, or all when the command names test files or ids)")
    parser.addoption("--world-sizes", default="1,2,4", help="world sizes of the core matrix tests (W = 8 runs in the "
                     "extended tier)")
    parser.addoption("--impls", default="ours,fsdp2", help="implementations of the slow matrix tests")


# -- progress and expected duration of each tier -------------------------------------------------
# Measured with -n 2 on the project's 2-core VM (the project's CI of fe7ea9f: the extended tier
# 31 min; the default tier 12.6 min on a fresh archive of it: docs/measured.md), rounded up. The
# slow tests run for minutes between dots, so a line every PROGRESS_EVERY_S seconds says how far
# the run is. A command that names test files runs an
# unknown share of a tier: it gets progress lines, no expectation.
EXPECTED_MINUTES = {"default": 13, "extended": 31, "all": 44}
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
            tier = selected_tier(self.config)
            terminal.write_line(f"tier {tier} ({TIER_TEXT[tier]}): "
                                + self.expected("expected about {} min with -n 2 on a quiet 2-core machine, longer "
                                                "when it is shared (docs/measured.md); ")
                                + f"a progress line every {PROGRESS_EVERY_S:.0f} s")

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
                terminal.write_line(f"[progress {minutes}m{seconds:02d}s] {self.done}/{self.total or '?'} tests done"
                                    + self.expected(" (expected about {} min in all)"))

    def expected(self, text: str) -> str:
        """`text` with the tier's expected minutes, or nothing where test files were named."""
        return "" if names_tests(self.config) else text.format(EXPECTED_MINUTES[selected_tier(self.config)])


def selected_tier(config) -> str:
    """--tier when given; otherwise `all` for a command that names test files or ids (someone asking
    for tests/cases/test_architectures.py wants it run) and `default` for the bare test command."""
    tier = config.getoption("--tier")
    if tier is not None:
        return tier
    return "all" if names_tests(config) else "default"


def names_tests(config) -> bool:
    """Whether the command names test files or ids (a share of a tier: no expected duration)."""
    whole = {(config.rootpath / p).resolve() for p in config.getini("testpaths")} | {config.rootpath.resolve()}
    return any((config.invocation_params.dir / a).resolve() not in whole for a in config.args)


def in_tier(item, tier: str) -> bool:
    extended = item.get_closest_marker("slow") is not None and item.get_closest_marker("core") is None
    return tier == "all" or extended == (tier == "extended")


def pytest_collection_modifyitems(config, items):
    tier = selected_tier(config)
    kept = [item for item in items if in_tier(item, tier)]
    dropped = [item for item in items if not in_tier(item, tier)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
        other = "--tier extended or --tier all" if tier == "default" else "--tier default or --tier all"
        terminal = config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None and not hasattr(config, "workerinput"):
            terminal.write_line(f"tier {tier}: {len(dropped)} tests of another tier deselected (run them with {other})")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller reports progress, not xdist's workers
        config.pluginmanager.register(_Progress(config), "suite-progress")
