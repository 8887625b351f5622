"""The engine's subsystems import only downward (docs/design.md, "Layers").

core <- cache, storage, loadgen <- snapshot, parallel <- runtime <- sim, and the cache stack never
imports parallel, runtime or sim: the facade stays rank-agnostic and the distributed layers wrap it.
The library packages (engine, formats, checkers) never import the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LEVEL = {"core": 0, "cache": 1, "storage": 1, "loadgen": 1, "snapshot": 2, "parallel": 2,
         "runtime": 3, "sim": 4}
FORBIDDEN = {"cache": {"parallel", "runtime", "sim"}, "storage": {"parallel", "runtime", "sim"},
             "core": set(LEVEL) - {"core"}}


def imports_of(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def subsystem(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "engine" and len(parts) > 1 else None


def engine_modules():
    return sorted(p for p in (ROOT / "engine").rglob("*.py"))


def test_every_engine_module_sits_in_a_known_subsystem():
    flat = [p.name for p in (ROOT / "engine").glob("*.py") if p.name != "__init__.py"]
    assert flat == [], f"modules directly in engine/ (give them a subsystem): {flat}"
    dirs = {p.name for p in (ROOT / "engine").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert dirs == set(LEVEL), f"subsystems without a layer in this test: {dirs ^ set(LEVEL)}"


@pytest.mark.parametrize("path", engine_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_engine_imports_only_downward(path: Path):
    own = path.relative_to(ROOT / "engine").parts[0]
    if own == "__init__.py":
        return
    for line, module in imports_of(path):
        other = subsystem(module)
        assert not module.startswith("hicache_cli"), f"{path}:{line} imports the CLI ({module})"
        if other is None or other == own:
            continue
        assert other in LEVEL, f"{path}:{line} imports unknown subsystem {module}"
        assert other not in FORBIDDEN.get(own, set()), f"{path}:{line}: {own} must not import {module}"
        assert LEVEL[other] <= LEVEL[own], (
            f"{path}:{line}: {own} (layer {LEVEL[own]}) imports upward into {module} "
            f"(layer {LEVEL[other]})")


@pytest.mark.parametrize("package", ["formats", "checkers"])
def test_library_packages_never_import_the_cli_or_the_runtime(package):
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imports_of(path):
            assert not module.startswith("hicache_cli"), f"{path}:{line} imports the CLI"
            assert subsystem(module) in (None, "core"), f"{path}:{line} imports {module}"


def test_every_subpackage_says_what_lives_there():
    for init in (ROOT / "engine").rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init} needs a docstring: what lives here, where new code goes"
