"""The base class of every element (``Element``), the leaf protocol's base class (``Leaf``), the tools of the
layers above that the data's conveniences call (``TOOLS``), and the checks of an element's arguments.
elements.py defines flowvm's element kinds over these and re-exports them.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from ..pickled import stable
from ..base.environment import check_settings
from .paths import get, walk
from .registers import Register

# The tools of the layers above that the conveniences of the data call: "start" (the machine's Driver),
# "find", "at" (editing), "isolate" (namespaces), "call_kind" (the CALL class for given arguments: a
# DependsCALL when they hold a Depends), "copy_driver" (the pickler), "listing" and "short" (the printer).
# Each module that provides one registers it when it is imported (flowvm/__init__.py imports them all),
# so that this module, at the bottom, imports none of them.
TOOLS: dict[str, Callable[..., Any]] = {}


def provide(name: str, tool: Callable[..., Any]) -> None:
    """Register the tool that the data's conveniences call under name (see TOOLS)."""
    TOOLS[name] = tool


def tool(name: str) -> Callable[..., Any]:
    try:
        return TOOLS[name]
    except KeyError:
        raise RuntimeError(f"flowvm: no {name!r} tool registered: import flowvm first") from None

if TYPE_CHECKING:
    from ..machine.driver import Driver


_EDITS = [0]  # in-place edits so far (flowvm.editing.edit.become): subtree caches older than the last are stale


def subtrees_changed() -> None:
    """An element was edited in place (flowvm.editing.edit): every subtree cache (``_cached_subtree``) is stale."""
    _EDITS[0] += 1


@stable("flowvm")
class Element:
    """Base class of all elements."""

    kind: str = "ELEMENT"
    is_leaf: bool = False
    polls: bool = False  # a leaf whose steps may return PENDING (see driver.py)
    simple_leaf: bool = False
    """A leaf run by ``leaf_for(registers)`` alone: one step per call, never PENDING, nothing kept in its
    frame or the driver; the driver runs such leaves on its fast paths (see driver.py)."""
    frame_kind: "type | None" = None
    """The built-in kind whose frame layout and moves this class has, inherited: each built-in kind sets it to
    itself, so a subclass of SEQ is a SEQ wherever the machine, the state files and the tools ask
    (``el.frame_kind is SEQ``).  None: a kind of its own (a container written outside flowvm, registered with
    ``register_container``, or a subclass of a built-in kind that registers moves of its own)."""
    __slots__ = ("__dict__", "__weakref__")

    # -- immutability: elements are shared freely between programs and copies
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{self.kind} elements are immutable; build a new element instead")

    def _init(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    # -- caches (compiled call closures, analysis results) never travel
    def __getstate__(self) -> dict:
        # the overrides table is copied too, so that a copy.copy of a program has a table of its own
        return {k: dict(v) if k == "_overrides" else v for k, v in self.__dict__.items() if not k.startswith("_c_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def _cached(self, key: str, compute: Callable[[], Any]) -> Any:
        """A cache of something derived from this element's own fields."""
        name = "_c_" + key
        try:
            return self.__dict__[name]
        except KeyError:
            value = self.__dict__[name] = compute()
            return value

    def _cached_subtree(self, key: str, compute: Callable[[], Any]) -> Any:
        """A cache of something derived from the whole subtree (registers read, say): an element edited
        in place (``flowvm.editing.edit``) changes the subtrees of everything holding it, so every such cache
        is recomputed after any in-place edit."""
        name = "_c_" + key
        cached = self.__dict__.get(name)
        if cached is not None and cached[0] == _EDITS[0]:
            return cached[1]
        value = compute()
        self.__dict__[name] = (_EDITS[0], value)
        return value

    # -- structure
    @property
    def children(self) -> tuple["Element", ...]:
        return ()

    def with_children(self, children: Sequence["Element"]) -> "Element":
        if children:
            raise ValueError(f"{self.kind} has no children")
        return self

    def own_reads(self) -> list[Register]:
        """Registers this element reads itself (not counting its children)."""
        return []

    def own_writes(self) -> list[Register]:
        """Registers this element writes itself (not counting its children)."""
        return []

    # -- running
    def start(self) -> "Driver":
        """Return a resumable Driver for this program; nothing runs yet."""
        return tool("start")(self)

    def run(self, max_steps: int | None = None) -> Any:
        """Run the program to the end and return its value."""
        return self.start().run(max_steps)

    # -- editing and analysis (flowvm/editing/edit.py, flowvm/editing/namespaces.py, flowvm/program/analysis.py)
    scope = None
    """Set by ``isolate``/``template`` on the root of an instance: a ``flowvm.editing.namespaces.Scope``."""

    def with_scope(self, scope: Any) -> "Element":
        """The same element marked as the root of an instance (``scope`` None: unmarked)."""
        import copy

        new = copy.copy(self)
        new.__dict__["scope"] = scope
        return new

    def find(self, pattern: Any = None, *, where: Any = None, missing_ok: bool = False):
        """Every element matching pattern (see ``flowvm.editing.edit.find``); edit them through the result."""
        return tool("find")(self, pattern, where=where, missing_ok=missing_ok)

    def at(self, *paths: Any):
        """The elements at the given paths, as ``find`` returns them (see ``flowvm.editing.edit.at``)."""
        return tool("at")(self, *paths)

    def isolate(self, namespace: str, shared: Iterable[str] = ()) -> "Element":
        """This sub-program with its registers moved into namespace (see ``flowvm.editing.namespaces.isolate``)."""
        return tool("isolate")(self, namespace, shared)

    def walk(self):
        """(path, element) for this element and every element inside it, parents first."""
        return walk(self)

    def get(self, path: Any) -> "Element":
        """The element at path ("0.2.1" or a tuple of child indices)."""
        return get(self, path)

    @property
    def dependency_overrides(self) -> dict:
        """Replacements for ``Depends`` providers when this program runs (see ``flowvm.machine.depends``)."""
        return self.__dict__.setdefault("_overrides", {})

    def with_overrides(self, overrides: dict) -> "Element":
        """A copy of this element whose dependency_overrides also hold these (an expression form)."""
        import copy

        new = copy.copy(self)
        new.dependency_overrides.update(overrides)
        return new

    @property
    def process_settings(self) -> dict:
        """The process settings this program runs with (see with_process_settings); empty by default."""
        return dict(self.__dict__.get("_settings") or {})

    def with_process_settings(self, settings: dict) -> "Element":
        """A copy of this element that, run as a program, sets these process settings (names as in
        ``flowvm.base.environment``, such as ``{"torch.threads": 1}``) when its driver takes its first step.
        A resumed copy of the run sets the settings it was saved with instead."""
        import copy

        new = copy.copy(self)
        new.__dict__["_settings"] = {**self.process_settings, **check_settings(settings, "<settings>")}
        return new

    # -- printing
    def __str__(self) -> str:
        return tool("listing")(self)

    def __repr__(self) -> str:
        return tool("short")(self)


class Leaf(Element):
    """Base class of a new leaf kind that runs through the *leaf protocol* (docs/leaves.md has a worked
    example).

    - ``bind(driver, frame)`` returns a function of no arguments that the driver calls once per step.  It
      returns the leaf's value when the leaf is finished (the driver hands it to the enclosing element), or
      ``flowvm.PENDING`` when it only polled something still running: that poll counts as a step, and the
      leaf stays where it is.  Set ``polls = True`` on a kind whose steps may return PENDING.
    - Live handles the leaf keeps between polls (a process, a future, a thread) go in
      ``driver.live[id(frame)]``: a cache, never pickled, so a copy of the run finds none and starts the
      leaf's work again.  A handle may define ``ready_future()``, a ``concurrent.futures.Future`` done once
      the next poll will not return PENDING: while every runnable leaf is pending, ``run()`` blocks on
      those futures (``arun()`` awaits them) instead of polling.
    - ``abandon(driver, frame)`` is called when an enclosing WEAVE finishes without this leaf: stop the
      work it started.  The default drops the live handle.
    - Registers the leaf reads or writes are declared by ``own_reads()`` and ``own_writes()`` (lists of
      ``Register``), so that ``verify`` and the passes see them; a leaf writes its own ``store_to``.
    - Fields are set once, in ``__init__``, with ``self._init(name=value, ...)``: elements are immutable.
    """

    is_leaf = True

    def bind(self, driver: "Driver", frame: list) -> Callable[[], Any]:
        raise NotImplementedError(f"{type(self).__name__} must define bind(driver, frame)")

    def abandon(self, driver: "Driver", frame: list) -> None:
        driver.live.pop(id(frame), None)


def check_element(obj: Any, owner: str, what: str) -> "Element":
    """obj, when it is an element; else a TypeError naming owner (the kind being built) and what."""
    if not isinstance(obj, Element):
        raise TypeError(f"{owner}: {what} must be a flowvm element, got {type(obj).__name__} {obj!r:.60}")
    return obj


def check_count(n: Any, owner: str, what: str = "count") -> Any:
    """n, when it is an int >= 0 or a Register; else an error naming owner and what."""
    if isinstance(n, Register):
        return n
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{owner}: {what} must be an int or a Register, got {type(n).__name__} {n!r:.60}")
    if n < 0:
        raise ValueError(f"{owner}: {what} must be >= 0, got {n}")
    return int(n)


def check_target(store_to: Any, owner: str, unpack: bool = False) -> Register | tuple | None:
    """store_to, when it is a Register or None (or, with unpack, a tuple or list of Registers, as a tuple:
    the value is unpacked into them as Python's ``a, b = value`` does); else a TypeError naming owner."""
    if unpack and isinstance(store_to, (tuple, list)):
        if not store_to or not all(isinstance(r, Register) for r in store_to):
            raise TypeError(f"{owner}: store_to must be a Register or a tuple of Registers ((reg('a'), reg('b'))), "
                            f"got {store_to!r:.60}")
        names = [r.name for r in store_to]
        if len(set(names)) != len(names):
            raise ValueError(f"{owner}: store_to names a register twice: {', '.join(names)}")
        return tuple(store_to)
    if store_to is not None and not isinstance(store_to, Register):
        also = " or a tuple of Registers" if unpack else ""
        raise TypeError(f"{owner}: store_to must be a Register (reg('name')){also} or None, got "
                        f"{type(store_to).__name__}")
    return store_to


def store_source(store_to: Register | tuple) -> str:
    """The Python target that stores a leaf's value v in the register file R: ``R['a']`` or ``R['a'], R['b']``
    (unpacked as Python unpacks)."""
    if isinstance(store_to, tuple):
        return ", ".join(f"R[{r.name!r}]" for r in store_to)
    return f"R[{store_to.name!r}]"


def target_text(store_to: Register | tuple) -> str:
    """How a listing writes the target: ``a`` or ``a, b``."""
    return ", ".join(r.name for r in store_to) if isinstance(store_to, tuple) else store_to.name
