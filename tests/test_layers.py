"""The package's layers import only downward: cli → integrations/reproduce/benchmarks → sim (the engine) →
algorithms → data/models/links → ops, reference (their plain twins), flat, persample → _C."""

from __future__ import annotations

import ast
from pathlib import Path

import pyfedkern

# Rank of each top-level part of the package; a module may import parts of its own rank or lower only.
LAYERS = {
    "_C": 0,
    "_runtime": 1,
    "_arrays": 1,
    "reference": 3,
    "ops": 3,
    "flat": 3,
    "persample": 4,
    "dpsgd": 4,
    "privacy": 4,
    "testing": 4,
    "data": 5,
    "models": 5,
    "links": 5,
    "algorithms": 6,
    "sim": 7,
    "reproduce": 8,
    "integrations": 8,
    "benchmarks": 8,
    "cli": 9,
    "__main__": 10,
}
ROOT = Path(pyfedkern.__file__).parent


def _part(module_path: Path) -> str:
    rel = module_path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def _imported_parts(tree: ast.AST) -> set[str]:
    parts = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = (
                [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                if node.module == "pyfedkern"
                else [node.module]
            )
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            pieces = name.split(".")
            if pieces[0] == "pyfedkern" and len(pieces) > 1:
                parts.add(pieces[1])
    return parts


def test_every_part_has_a_layer():
    found = {_part(p) for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT}
    assert found <= set(LAYERS), f"parts without a layer: {sorted(found - set(LAYERS))}"


def test_imports_only_go_down():
    violations = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent == ROOT and path.name == "__init__.py":
            continue
        own = _part(path)
        for part in _imported_parts(ast.parse(path.read_text(encoding="utf-8"))):
            if part in LAYERS and LAYERS[part] > LAYERS[own]:
                violations.append(f"{path.relative_to(ROOT)} imports pyfedkern.{part}")
    assert not violations, "upward imports:\n" + "\n".join(violations)


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``), the top-level package left out:
    it is the public face above every layer (its ``Experiment`` is imported on first use)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name != "pyfedkern":
            found[name] = path
    return found


def _imported_modules(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The package's modules a source imports anywhere: at module level, inside functions and under TYPE_CHECKING
    (``from a import b`` imports the module a.b when there is one, else a)."""
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            ]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found.update(name for name in names if name in modules)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module → the modules it imports) as [m0, m1, ..., m0], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                return [*path[path.index(other) :], other]
            if other not in state and (found := visit(other)):
                return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_cycle_finds_a_deferred_cycle():
    tree = ast.parse("import pyfedkern.a\ndef f():\n    from pyfedkern import b\n")
    modules = {"pyfedkern.a": ROOT, "pyfedkern.b": ROOT}
    assert _imported_modules(tree, modules) == {"pyfedkern.a", "pyfedkern.b"}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    modules = _modules()
    graph = {
        name: _imported_modules(ast.parse(path.read_text(encoding="utf-8")), modules) - {name}
        for name, path in modules.items()
    }
    cycle = _cycle(graph)
    assert cycle is None, "import cycle (imports inside functions and under TYPE_CHECKING count): " + " → ".join(cycle)


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_context_probes():
    """An algorithm's context declares every member it may read, with its default (FLContext): members are read as
    plain attributes, never probed with getattr/hasattr on ``ctx`` (or on ``ctx.local``, ...)."""
    probes = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and _root_name(node.args[0]) == "ctx"
            ):
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not probes, "context probed instead of read (declare the member in FLContext):\n" + "\n".join(probes)
