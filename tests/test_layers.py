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
