"""The named singletons of the machine: ``INCOMPLETE`` (what ``step()`` and ``run()`` return while a
program is not finished), ``PENDING`` (what a leaf's step returns when it only polled work still running:
see ``flowvm.Leaf``), and the driver's own ``NOVALUE`` and ``PUSHED``.  Each pickles by name and loads as
itself.
"""

from __future__ import annotations

from ..pickled import stable

__all__ = ["INCOMPLETE", "PENDING", "NOVALUE", "PUSHED", "sentinel"]


class _Sentinel:
    """A named singleton that survives pickling as itself."""

    def __init__(self, name: str):
        self._name = name
        _SENTINELS[name] = self

    def __repr__(self) -> str:
        return self._name

    def __reduce__(self):
        return sentinel, (self._name,)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


_SENTINELS: dict[str, "_Sentinel"] = {}


@stable("flowvm.pickled")
def sentinel(name: str) -> "_Sentinel":
    """The singleton named name (how sentinels unpickle)."""
    return _SENTINELS[name]


INCOMPLETE = _Sentinel("INCOMPLETE")
PENDING = _Sentinel("PENDING")
# the driver's own: no value in transit; a move pushed a frame (the names are those saved runs hold)
NOVALUE = _Sentinel("_NOVALUE")
PUSHED = _Sentinel("_PUSHED")
