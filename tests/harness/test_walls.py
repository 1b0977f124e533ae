"""Fast tier: the import walls of [Note: Import walls] (harness/__init__.py), read from the source.

Every import of every module of harness/, cases/ and impl/ counts, lazy ones inside functions
included; a private name reached as an attribute of an imported module (`launch._signal_all`)
counts as an import of it. Tests themselves may reach into private names and are not scanned.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("harness", "cases", "impl")

# Wall 1: what the judge and the reports, which read results, never import.
MACHINERY = ("harness.run.orchestrate", "harness.run.launch", "harness.run.prefork", "harness.run.lifeline",
             "harness.run.rank", "harness.fuzz.pool", "harness.cli", "harness.verbs", "harness.ci")
READERS = ("harness.judge", "harness.report")
# Wall 2: the modules torchrun runs inside every rank (`-m`); no other module imports them.
RANK_SIDE = ("harness.run.worker", "harness.fuzz.worker", "harness.bench.worker")
# Wall 3: the harness modules that may import impl/ (bench/worker: see the note).
IMPL_IMPORTERS = ("harness.adapters.ours", "harness.bench.worker")
# Wall 5: which package may import which.
PACKAGE_IMPORTS = {"impl": ("impl",), "cases": ("cases",), "harness": PACKAGES}
# Wall 6: the layers below both the rank runtime (run/) and the judge (judge/) import nothing above
# them: the adapters (and the local step every rank runs), then the reference (the error model and
# the unsharded replay), each only itself and what is below it.
# Wall 7: the parent side reads fault names from the catalog (harness/faults.py), never from the
# seam that plants collective and loop faults inside the ranks.
FAULT_SEAM = "harness.run.dist_faults"
PARENT_SIDE = ("harness.cli", "harness.verbs", "harness.ci", "harness.fuzz.main", "harness.run.plan", "harness.run.orchestrate",
               "harness.run.launch", "harness.report", "harness.judge")
LAYER_IMPORTS = {
    "harness.adapters": ("harness.adapters", "harness.errors"),
    "harness.reference": ("harness.reference", "harness.adapters", "harness.errors"),
}


@dataclass(frozen=True)
class Import:
    importer: str
    line: int
    module: str  # the module imported, or the one a name is taken from
    name: str | None  # the name taken from `module`; None when the module itself is imported


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def project_sources() -> dict[str, str]:
    """Module name -> source, for every module of the three packages (a fresh dict each call)."""
    return dict(_read_sources())


@functools.cache
def _read_sources() -> tuple[tuple[str, str], ...]:
    sources = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            sources[name] = path.read_text()
    return tuple(sources.items())


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def imports_of(importer: str, source: str, modules: set[str]) -> list[Import]:
    """Every project import of one module: `import a.b`, `from a import b` (b a module or a name),
    and private attributes read from a module bound by either."""
    is_package = any(m.startswith(importer + ".") for m in modules)
    found: list[Import] = []
    bound: dict[str, str] = {}  # local name -> project module it refers to
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in PACKAGES:
                    continue
                found.append(Import(importer, node.lineno, alias.name, None))
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importer's package
                package = importer if is_package else importer.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    package = package.rsplit(".", 1)[0]
                base = f"{package}.{base}" if base else package
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.append(Import(importer, node.lineno, sub, None))
                    bound[alias.asname or alias.name] = sub
                else:
                    found.append(Import(importer, node.lineno, base, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            dotted = _dotted(node.value)
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            if head in bound:
                target = bound[head] + (f".{rest}" if rest else "")
                if target in modules:
                    found.append(Import(importer, node.lineno, target, node.attr))
    return found


def wall_violations(sources: dict[str, str]) -> list[str]:
    modules = set(sources)
    out = []
    for importer, source in sorted(sources.items()):
        for imp in imports_of(importer, source, modules):
            where = f"{imp.importer}:{imp.line} imports {imp.module}" + (f".{imp.name}" if imp.name else "")
            if _within(importer, READERS) and (_within(imp.module, MACHINERY) or imp.module in RANK_SIDE):
                out.append(f"wall 1 (judge and report import no machinery, verb or rank-side module): {where}")
            if imp.module in RANK_SIDE and importer != imp.module:
                out.append(f"wall 2 (no module imports a rank-side module): {where}")
            if imp.module.split(".")[0] == "impl" and importer.split(".")[0] == "harness" \
                    and importer not in IMPL_IMPORTERS:
                out.append(f"wall 3 (only {IMPL_IMPORTERS[0]} imports impl): {where}")
            own_package = importer.split(".")[0]
            if imp.name is not None and _is_private(imp.name) and imp.module != importer:
                out.append(f"wall 4 (no private name of another module): {where}")
            if imp.module.split(".")[0] != own_package and any(_is_private(p) for p in imp.module.split(".")):
                out.append(f"wall 4 (no private module of another package): {where}")
            if imp.module.split(".")[0] not in PACKAGE_IMPORTS[own_package]:
                out.append(f"wall 5 ({own_package} imports only {list(PACKAGE_IMPORTS[own_package])}): {where}")
            if _within(importer, PARENT_SIDE) and imp.module == FAULT_SEAM:
                out.append(f"wall 7 (the parent side takes fault names from harness.faults): {where}")
            for layer, allowed in LAYER_IMPORTS.items():
                if _within(importer, (layer,)) and _within(imp.module, ("harness",)) \
                        and not _within(imp.module, allowed):
                    out.append(f"wall 6 ({layer} imports only {list(allowed)} of harness): {where}")
    return out


def test_the_project_keeps_its_walls():
    sources = project_sources()
    assert {"harness.run.worker", "harness.adapters.ours", "harness.judge.diff", "harness.reference.shadow", "impl",
            "cases.catalog"} <= set(sources)
    violations = wall_violations(sources)
    assert not violations, "\n".join(violations)


def test_the_scan_sees_the_imports_the_walls_are_about():
    """The walls pass because the imports are allowed, not because the scan misses them."""
    sources = project_sources()
    modules = set(sources)
    seen = {(i.module, i.name) for i in imports_of("harness.adapters.ours", sources["harness.adapters.ours"], modules)}
    assert ("impl", None) in seen  # `import impl` inside a method
    seen = {(i.module, i.name) for i in imports_of("harness.judge.verdict", sources["harness.judge.verdict"], modules)}
    assert ("harness.run.outcome", "RunOutcome") in seen
    seen = {(i.module, i.name) for i in imports_of("harness.verbs.run", sources["harness.verbs.run"], modules)}
    assert ("harness.run.orchestrate", "run_plan") in seen  # a lazy import inside a function


PLANTED = [
    ("harness.judge.planted", "from harness.run.orchestrate import run_plan\n", "wall 1"),
    ("harness.report.planted", "def f():\n    from harness.ci import gate\n", "wall 1"),
    ("harness.report.planted", "import harness.run.worker\n", "wall 1"),
    ("harness.judge.planted", "from harness.run.prefork import rank_main\n", "wall 1"),
    ("harness.fuzz.planted", "from harness.fuzz.worker import main\n", "wall 2"),
    ("harness.run.planted", "from harness.run import worker\n", "wall 2"),
    ("harness.run.planted", "def f():\n    import impl\n", "wall 3"),
    ("harness.ci.planted", "from impl import FAULTS\n", "wall 3"),
    ("harness.fuzz.planted", "from harness.run.launch import _signal_all\n", "wall 4"),
    ("harness.fuzz.planted", "from harness.run import launch\nlaunch._signal_all([], 9)\n", "wall 4"),
    ("harness.fuzz.planted", "import harness.run.launch\nharness.run.launch._processes_with('x')\n", "wall 4"),
    ("harness.adapters.planted", "import impl._flat_param\n", "wall 4"),
    ("cases.planted", "from harness.errors import UserError\n", "wall 5"),
    ("impl.planted", "import cases.catalog\n", "wall 5"),
    ("harness.reference.planted", "from harness.run.plan import Cell\n", "wall 6"),
    ("harness.reference.planted", "def f():\n    from harness.judge.diff import CellJudge\n", "wall 6"),
    ("harness.adapters.planted", "from harness.reference.shadow import Shadow\n", "wall 6"),
    ("harness.adapters.planted", "import harness.run.rank\n", "wall 6"),
    ("harness.ci.planted", "from harness.run.dist_faults import NEVER_ACTED\n", "wall 7"),
    ("harness.run.plan", "def f():\n    from harness.run import dist_faults\n", "wall 7"),
]


@pytest.mark.parametrize("module, source, wall", PLANTED, ids=[f"{w}:{m}:{i}" for i, (m, _, w) in enumerate(PLANTED)])
def test_a_planted_violation_breaks_its_wall(module, source, wall):
    sources = project_sources()
    sources[module] = source
    violations = wall_violations(sources)
    assert violations and all(v.startswith("wall ") for v in violations)
    assert any(v.startswith(wall + " ") and f"{module}:" in v for v in violations), violations
