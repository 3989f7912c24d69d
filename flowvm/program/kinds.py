"""Dispatch on element kind: one ``KindTable`` per task that treats kinds differently (a listing's header,
verify's check, a pattern's match, a rename, the source form, the driver's moves, ...).

A table maps an element class to the function that does the task for that kind.  A class without an entry
takes its nearest registered base class's (looked up along the MRO once, then kept), so a subclass of a
kind is treated as that kind; a class with none takes the table's ``default``, which handles any element
through the protocol every element has (``kind``, ``children``, ``with_children``, ``own_reads``,
``own_writes``): that is how a container kind written outside flowvm is printed, verified, matched and
renamed without registering anything.  A kind that wants more registers its own entry::

    HEADER.register(TWICE, lambda el: "TWICE:")

Every table is listed in ``TABLES`` by name (docs/containers.md lists them with their defaults).
"""

from __future__ import annotations

from typing import Any, Callable

TABLES: dict[str, "KindTable"] = {}


class KindTable(dict):
    """Functions by element class for one task (see the module docstring).  ``table.of(el)`` is the
    function for el's kind; ``table[cls]`` the function for a class."""

    def __init__(self, name: str, default: Callable | None = None, entries: dict | None = None):
        super().__init__(entries or {})
        self.name = name
        self.default = default
        self.own = set(self)  # the classes registered, as opposed to those that took a base's entry
        TABLES[name] = self

    def __missing__(self, cls: type) -> Callable:
        for base in cls.__mro__[1:]:
            if base in self.own:
                fn = self[cls] = dict.__getitem__(self, base)
                return fn
        if self.default is None:
            return self.missing(cls)
        fn = self[cls] = self.default
        return fn

    def missing(self, cls: type) -> Callable:
        """What a class with no entry and no default gets (a table may raise a clearer error here)."""
        raise TypeError(f"{getattr(cls, 'kind', cls.__name__)} has no {self.name!r} entry")

    def of(self, el: Any) -> Callable:
        return self[el.__class__]

    def register(self, cls: type, fn: Callable | None = None):
        """Make fn the table's entry for cls (and for its subclasses that have none of their own); used as a
        decorator when fn is left out.  Returns fn."""
        if not isinstance(cls, type):
            raise TypeError(f"{self.name}: register expects an element class, got {cls!r:.60}")
        if fn is None:
            return lambda f: self.register(cls, f)
        if not callable(fn):
            raise TypeError(f"{self.name}: the entry for {cls.__name__} must be a function, got {fn!r:.60}")
        for known in [k for k in self if k not in self.own and issubclass(k, cls)]:
            del self[known]  # taken from a base, or the default, before: looked up again
        self[cls] = fn
        self.own.add(cls)
        return fn
