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


# -- inside the runtime: model < scheduler < config < ranks < serving < pd < launch ---------------
RUNTIME_LEVEL = {"model": 0, "tokenizer": 0, "tokenizer_export": 0, "chat_template": 0,
                 "topology": 0, "model_id": 0, "config_fields": 0, "scheduler": 1, "config": 2, "ranks": 3,
                 "serving": 4, "pd": 5, "launch": 6}


def runtime_room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["engine", "runtime"] or len(parts) < 3:
        return None
    return parts[2]


def runtime_modules():
    return sorted(p for p in (ROOT / "engine" / "runtime").rglob("*.py"))


def test_every_runtime_module_sits_in_a_known_room():
    rooms = {p.stem if p.is_file() else p.name for p in (ROOT / "engine" / "runtime").iterdir()
             if not p.name.startswith("__") and (p.is_dir() or p.suffix == ".py")}
    assert rooms == set(RUNTIME_LEVEL), f"runtime rooms without a level: {rooms ^ set(RUNTIME_LEVEL)}"


@pytest.mark.parametrize("path", runtime_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_runtime_imports_only_downward(path: Path):
    rel = path.relative_to(ROOT / "engine" / "runtime").parts
    if rel == ("__init__.py",):
        return
    own = rel[0].removesuffix(".py")
    for line, module in imports_of(path):     # function-level imports count too
        other = runtime_room(module)
        if other is None or other == own:
            continue
        assert other in RUNTIME_LEVEL, f"{path}:{line} imports unknown runtime room {module}"
        assert RUNTIME_LEVEL[other] <= RUNTIME_LEVEL[own], (
            f"{path}:{line}: runtime/{own} (level {RUNTIME_LEVEL[own]}) imports upward into "
            f"{module} (level {RUNTIME_LEVEL[other]})")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> list[str]:
    """What a file imports, ``from pkg import sub`` also as ``pkg.sub`` (it may be a module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_no_import_circle_in_the_runtime():
    """Between the runtime's modules (imports inside functions included), no module reaches
    itself again: a circle would fail here even inside one room."""
    mods = {_module_name(p): p for p in runtime_modules()}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        out = set()
        for module in _imported(path):
            # ``from pkg import name`` may name a submodule or an attribute: the longest
            # known prefix is the module imported
            parts = module.split(".")
            for k in range(len(parts), 2, -1):
                cand = ".".join(parts[:k])
                if cand in mods and cand != name:
                    out.add(cand)
                    break
        graph[name] = {m for m in out if not name.startswith(m + ".")}   # a package's parent
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
