"""Registers summarized for a listing (``flowvm show``): a value's type and shape or a short text of it, and text
made printable (control characters escaped)."""

from __future__ import annotations

import re
from typing import Any


def _shape(value: Any) -> tuple | None:
    """The shape of an array or tensor (not of the ndarray class itself), else None."""
    shape = None if isinstance(value, type) else getattr(value, "shape", None)
    try:
        return tuple(int(n) for n in shape) if shape is not None and not callable(shape) else None
    except (TypeError, ValueError):
        return None


def describe_value(value: Any) -> tuple[str, str]:
    """(type, detail) of a register value: shape and dtype for arrays, length for containers."""
    from ..program.printer import fmt

    kind = type(value).__name__
    shape = _shape(value)
    if shape is not None:
        dtype = str(getattr(value, "dtype", "")).replace("torch.", "")
        if shape == ():  # a scalar (a loss): its value
            try:
                scalar = value.detach() if hasattr(value, "detach") else value  # (torch warns on a graph's)
                return kind, f"{float(scalar):.6g} {dtype}".rstrip()
            except (TypeError, ValueError):
                pass
        return kind, f"shape {shape} {dtype}".rstrip()
    if isinstance(value, (list, tuple, dict)):
        inner = sorted({type(v).__name__ for v in (value.values() if isinstance(value, dict) else value)})
        what = f"{len(value)} item{'' if len(value) == 1 else 's'}" + (f" of {', '.join(inner[:3])}" if inner else "")
        if isinstance(value, dict):
            what += ": keys " + fmt(list(value)[:6], 50)
        return kind, what
    if isinstance(value, float):
        return kind, f"{value:.6g}"
    return kind, fmt(value, 60)


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def printable(text: str) -> str:
    """text with its control characters escaped (``\\x1b``, ``\\u202e``): a file's names and listing reach
    the terminal as text, never as escape sequences (line breaks and tabs are kept)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1] if m.group() != "\\" else m.group(), text)


def registers_summary(registers: dict) -> str:
    rows = []
    for name, value in registers.items():
        kind, detail = describe_value(value)
        rows.append(f"  {name:<16} {kind:<10} {detail}")
    return "registers:\n" + ("\n".join(rows) if rows else "  (none)")
