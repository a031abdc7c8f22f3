"""Parsing of the strings used on the command line: ``name:arg,arg`` (``dirichlet:0.3``, ``synthetic:1,1``),
booleans, and ``package.module:attr`` references to a user's own code."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from typing import Any

_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_flag(text: str) -> bool | None:
    """A boolean written as text: true/false, yes/no, on/off or 1/0 (any case); None for any other text."""
    return _FLAGS.get(text.strip().lower())


def parse_spec(text: str, *, what: str, choices: Iterable[str]) -> tuple[str, list[float]]:
    """Split ``"name:a,b"`` into ``("name", [a, b])`` with numeric arguments.

    ``what`` names the option in error messages (``"partition"``); an unknown name raises a ValueError
    listing ``choices``.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what}: expected a non-empty string like 'name' or 'name:1,2', got {text!r}")
    name, _, rest = text.strip().partition(":")
    name = name.strip().lower()
    valid = sorted(choices)
    if name not in valid:
        raise ValueError(f"unknown {what} {name!r}; valid choices: {', '.join(valid)}")
    args: list[float] = []
    if rest.strip():
        for piece in rest.split(","):
            try:
                args.append(float(piece))
            except ValueError:
                raise ValueError(f"{what} {text!r}: argument {piece.strip()!r} is not a number") from None
    return name, args


_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_reference(name: str) -> bool:
    """Whether a model, dataset or algorithm name is a ``package.module:attr`` reference, not a built-in (``cnn``,
    ``synthetic:1,1``)."""
    module, sep, attr = name.partition(":")
    return bool(sep) and _DOTTED.fullmatch(module) is not None and _DOTTED.fullmatch(attr) is not None


def import_object(reference: str, what: str) -> Any:
    """The callable ``attr`` of ``module`` named by ``"module:attr"`` (``attr`` may be dotted); ValueError naming
    ``what`` when it does not import or is not callable (the import's own error as the cause)."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {reference!r}: expected 'package.module:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:  # whatever importing the user's module raises
        raise ValueError(
            f"{what} {reference!r}: cannot import module {module_name!r} ({type(err).__name__}: {err})"
        ) from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {reference!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {reference!r}: {attr} is a {type(obj).__name__}, not callable")
    return obj
