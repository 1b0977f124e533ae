"""The tier a pytest command runs (root conftest.py): the bare command runs the default tier, a
command naming test files or ids runs what it names, --tier wins; core slow tests are default."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
root_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(root_conftest)


def _config(args: list[str], tier: str | None = None, cwd: Path = ROOT):
    return SimpleNamespace(getoption=lambda name: tier, args=args, getini=lambda name: ["tests"],
                           rootpath=ROOT, invocation_params=SimpleNamespace(dir=cwd))


@pytest.mark.parametrize("args, tier, expected", [
    (["tests"], None, "default"),  # the bare command: pytest puts testpaths in args
    (["tests/"], None, "default"),
    (["."], None, "default"),
    (["tests/cases/test_architectures.py"], None, "all"),
    (["tests/harness/ci/test_gate.py::test_gate_passes_with_junit_per_cell_and_a_step_summary"], None, "all"),
    (["tests"], "extended", "extended"),
    (["tests/cases/test_architectures.py"], "default", "default"),
])
def test_the_tier_of_a_command(args, tier, expected):
    assert root_conftest.selected_tier(_config(args, tier)) == expected


def _item(*markers: str):
    return SimpleNamespace(get_closest_marker=lambda name: object() if name in markers else None)


def test_fast_and_core_tests_are_default_the_other_slow_tests_extended():
    fast, core, extended = _item(), _item("slow", "core"), _item("slow")
    assert [root_conftest.in_tier(i, "default") for i in (fast, core, extended)] == [True, True, False]
    assert [root_conftest.in_tier(i, "extended") for i in (fast, core, extended)] == [False, False, True]
    assert [root_conftest.in_tier(i, "all") for i in (fast, core, extended)] == [True, True, True]


@pytest.mark.parametrize("args, tier, shown", [
    (["tests"], None, "about 7 min"),
    (["tests"], "extended", "about 9 min"),
    (["tests/harness/run/test_nodes.py"], None, ""),  # a share of a tier: no expected duration,
    (["tests/harness/run/test_nodes.py"], "all", ""),  # --tier or not
])
def test_only_a_whole_tier_is_promised_a_duration(monkeypatch, args, tier, shown):
    monkeypatch.setattr(root_conftest, "EXPECTED_MINUTES", {"default": 7, "extended": 9, "all": 16})  # any figures
    progress = root_conftest._Progress(_config(args, tier))
    assert progress.expected(" (expected about {} min in all)") == (f" (expected {shown} in all)" if shown else "")
