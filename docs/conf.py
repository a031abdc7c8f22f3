"""Sphinx configuration of pyfedkern's documentation: the guides in docs/*.md (MyST) and an API reference generated
from the docstrings. Build (warnings are errors, every cross-reference must resolve):

    pip install ".[docs]"
    python -m sphinx -W --keep-going -n -b html docs build/docs
"""

from __future__ import annotations

import importlib.metadata
import re

project = "pyfedkern"
author = "pyfedkern authors"
copyright = "pyfedkern authors, Apache License 2.0"
release = importlib.metadata.version("pyfedkern")

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Signatures without type hints (the docstrings state shapes and dtypes); members in source order.
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields: a NamedTuple's fields are documented once

# Every reference to a pyfedkern name must resolve. Names of other libraries cannot be checked offline (no
# intersphinx inventories are downloaded), so they are the only ones let through.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|cupy|flwr|collections|typing|dataclasses|pathlib|enum)(\..*)?"),
    # The base class of torch modules, named by the forward() docstring they inherit.
    (r"py:class", r"Module"),
    # Private bases shown by show-inheritance.
    (r"py:class", r".*\._\w+"),
    # Napoleon reads "text: description" lines of Returns/attribute docstrings as a type: prose, not a reference.
    (r"py:class", r".*[^\w.].*"),
    (r"py:class", r"[a-z_][a-z0-9_]*"),
]

myst_heading_anchors = 3
html_theme = "alabaster"


# Docstrings are written for help(): set sizes as |S| and |D_i| and shapes as [n, *input_shape], which
# reStructuredText would read as substitutions and emphasis. Outside ``literals``, such bars and stars are escaped.
_STAR = re.compile(r"(?:(?<=\[)|(?<=\()|(?<=, ))\*(?=[A-Za-z_])(?![A-Za-z_]\w*\*)")


def _escape_markup(app, what, name, obj, options, lines):
    for i, line in enumerate(lines):
        if line.lstrip().startswith((">>>", "+")):
            continue
        parts = line.split("``")
        parts[::2] = [_STAR.sub(r"\\*", part.replace("|", "\\|")) for part in parts[::2]]
        lines[i] = "``".join(parts)


def setup(app):
    app.connect("autodoc-process-docstring", _escape_markup)
