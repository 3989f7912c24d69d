"""The register file and references into it.

A ``Registers`` object is a plain dict of named values.  ``reg('x')`` makes a
``Register`` reference bound to that dict; elements hold references, and the
driver reads or writes the value when the element runs.
"""

from __future__ import annotations

from ..pickled import stable

import copy

from typing import Any


@stable("flowvm")
class Registers(dict):
    """The register file: a dict of named values.

    >>> reg = Registers()
    >>> x = reg('x')
    >>> x.set(3); reg['x']
    3
    """

    def __call__(self, name: str) -> "Register":
        return Register(self, name)

    # dicts compare by content; two register files are the same only when
    # they are the same object, so keep identity hashing for lookups.
    __hash__ = object.__hash__  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Registers({dict.__repr__(self)})"


@stable("flowvm")
class Register:
    """A reference to one named slot of one register file."""

    __slots__ = ("file", "name")

    def __init__(self, file: Registers, name: str):
        if not isinstance(file, Registers):
            raise TypeError(f"Register file must be a flowvm.Registers, got {type(file).__name__}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"register name must be a non-empty str, got {name!r}")
        self.file = file
        self.name = name

    def get(self) -> Any:
        return self.file[self.name]

    def set(self, value: Any) -> None:
        self.file[self.name] = value

    def __reduce__(self):
        return (Register, (self.file, self.name))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Register):
            return NotImplemented
        return self.file is other.file and self.name == other.name

    def __hash__(self) -> int:
        return hash(("flowvm.Register", self.name))

    def __repr__(self) -> str:
        return f"reg({self.name!r})"


def iter_registers(obj: Any):
    """Yield every Register found in obj, looking inside lists, tuples and dicts."""
    if isinstance(obj, Register):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_registers(item)
    elif isinstance(obj, dict) and not isinstance(obj, Registers):
        for key, item in obj.items():
            yield from iter_registers(key)
            yield from iter_registers(item)


def has_registers(obj: Any) -> bool:
    return next(iter_registers(obj), None) is not None


def resolve(obj: Any, file: dict) -> Any:
    """Replace every Register in obj (also inside lists, tuples, dicts) by its value."""
    if isinstance(obj, Register):
        return file[obj.name]
    if isinstance(obj, list):
        return [resolve(item, file) for item in obj]
    if isinstance(obj, tuple):
        items = [resolve(item, file) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, dict) and not isinstance(obj, Registers):
        pairs = {resolve(k, file): resolve(v, file) for k, v in obj.items()}
        return pairs if type(obj) is dict else same_kind_of_dict(obj, pairs)
    return obj


def same_kind_of_dict(like: dict, pairs: dict) -> dict:
    """pairs in a dict of like's class (a defaultdict keeps its default factory, an OrderedDict its kind)."""
    out = copy.copy(like)
    out.clear()
    out.update(pairs)
    return out
