"""Parsing of the strings used on the command line: ``name:arg,arg`` (``dirichlet:0.3``, ``synthetic:1,1``) and
booleans."""

from __future__ import annotations

from collections.abc import Iterable

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
