"""Parsing of the ``name:arg,arg`` strings used on the command line (``dirichlet:0.3``, ``synthetic:1,1``)."""

from __future__ import annotations

from collections.abc import Iterable


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
