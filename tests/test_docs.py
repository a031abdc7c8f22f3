"""The project stands on its own: no citation of material outside the repository, working relative links in the
docs, section citations ("docs/bherd.md §3") that name an existing section, and a docstring for every public name."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Built from pieces so that this file does not match its own patterns.
OUTSIDE_CITATIONS = [
    ("a specs folder", re.compile("spec" + r"s/\w")),
    ("the shared folder", re.compile(re.escape("..") + "/" + "shared")),
    ("a bare issue number", re.compile(r"\bissues?\s+#?\d", re.IGNORECASE)),
]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SECTION_CITATION = re.compile(r"docs/([\w-]+\.md) §(\d+(?:\.\d+)?)")
PUBLIC_MODULES = [
    "pyfedkern",
    "pyfedkern.ops",
    "pyfedkern.algorithms",
    "pyfedkern.flat",
    "pyfedkern.sim",
    "pyfedkern.integrations.flower",
]


def _tracked_files() -> list[Path]:
    """The repository's tracked files (skips the test outside a git checkout, e.g. on an installed package)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs the git checkout")
    return [ROOT / name for name in out.decode().split("\0") if name]


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary file (or a tracked file that is missing from the work tree)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def _markdown_files() -> list[Path]:
    return [
        p
        for p in _tracked_files()
        if p.suffix == ".md" and not p.relative_to(ROOT).as_posix().startswith("bench/results/")
    ]


def test_no_citation_of_material_outside_the_repository():
    found = []
    for path in _tracked_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("bench/results/"):  # recorded runs are kept as they were written
            continue
        text = _text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for what, pattern in OUTSIDE_CITATIONS:
                if pattern.search(line):
                    found.append(f"{rel}:{number}: {what}: {line.strip()[:100]}")
    assert not found, "cite the project's own docs instead:\n" + "\n".join(found)


def test_relative_links_in_the_docs_point_at_files():
    broken = []
    files = _markdown_files()
    assert any(p.name == "README.md" for p in files) and any(p.parent.name == "docs" for p in files)
    for path in files:
        text = re.sub(r"```.*?```", "", _text(path) or "", flags=re.DOTALL)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # URLs, anchors in the page
                continue
            resolved = (path.parent / target.split("#", 1)[0]).resolve()
            if not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def _sections(doc: Path) -> set[str]:
    """Section numbers of a doc's headings: "## 3. Title" gives "3", "### 7.4 Title" gives "7.4"."""
    heading = re.compile(r"^#+\s+(\d+(?:\.\d+)?)\.?\s", re.MULTILINE)
    return set(heading.findall(doc.read_text(encoding="utf-8")))


def test_section_citations_name_existing_sections():
    missing = []
    cited = 0
    for path in _tracked_files():
        text = _text(path)
        if text is None:
            continue
        for name, section in SECTION_CITATION.findall(text):
            cited += 1
            doc = ROOT / "docs" / name
            if not doc.exists() or section not in _sections(doc):
                missing.append(f"{path.relative_to(ROOT)}: docs/{name} §{section}")
    assert cited > 20, "the code cites the algorithm docs by section; the pattern found almost none"
    assert not missing, "citations of sections that do not exist:\n" + "\n".join(missing)


def _public_names(module_name: str) -> list[tuple[str, object]]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    assert names, f"{module_name} has no __all__"
    return [(name, getattr(module, name)) for name in names]


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_has_a_docstring(module_name):
    if module_name.endswith("flower"):
        pytest.importorskip("flwr")
    module = importlib.import_module(module_name)
    assert inspect.getdoc(module), f"{module_name} has no module docstring"
    undocumented = []
    for name, obj in _public_names(module_name):
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.ismodule(obj)):
            continue  # constants are described where they are defined
        if not (obj.__doc__ or "").strip():
            undocumented.append(name)
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if member.startswith("_") or not (inspect.isfunction(value) or isinstance(value, property)):
                    continue
                if not (value.__doc__ or "").strip() and not _inherits_doc(obj, member):
                    undocumented.append(f"{name}.{member}")
    assert not undocumented, f"{module_name}: public names without a docstring: {', '.join(undocumented)}"


def _inherits_doc(cls: type, member: str) -> bool:
    """True when an overridden method's base class documents it (the API reference shows that docstring)."""
    return any((getattr(getattr(base, member, None), "__doc__", None) or "").strip() for base in cls.__mro__[1:])
