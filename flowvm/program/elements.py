"""The element kinds a program is built from.

Elements are small immutable data objects: they describe control flow and
hold no execution state.  Running a program is the driver's job
(``flowvm.machine.driver``); printing, analysis and verification live in their own
modules.  This split is what lets a half-run program be pickled: the run state
is in the driver's frames, never in the elements.

Every element has ``children`` (a tuple of elements, in path order) and
``with_children(children)``, which builds the same element over new children:
together they are all that tree walkers and editors need.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from ..pickled import stable
from ..base.environment import check_settings
from .paths import get, walk
from .registers import Register, iter_registers

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


def _check_element(obj: Any, owner: str, what: str) -> "Element":
    if not isinstance(obj, Element):
        raise TypeError(f"{owner}: {what} must be a flowvm element, got {type(obj).__name__} {obj!r:.60}")
    return obj


def _check_count(n: Any, owner: str, what: str = "count") -> Any:
    if isinstance(n, Register):
        return n
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{owner}: {what} must be an int or a Register, got {type(n).__name__} {n!r:.60}")
    if n < 0:
        raise ValueError(f"{owner}: {what} must be >= 0, got {n}")
    return int(n)


def _check_target(store_to: Any, owner: str) -> Register | None:
    if store_to is not None and not isinstance(store_to, Register):
        raise TypeError(f"{owner}: store_to must be a Register (reg('name')) or None, got {type(store_to).__name__}")
    return store_to


@stable("flowvm")
class CALL(Element):
    """One step: call ``fn(*args, **kwargs)``.

    Registers anywhere in args and kwargs (also inside lists, tuples and dicts)
    are replaced by their values when the call runs.  The return value is the
    element's value, stored to ``store_to`` when given.
    """

    kind = "CALL"
    is_leaf = True
    simple_leaf = True

    def __new__(cls, *args: Any, **kwargs: Any):
        # A CALL with a Depends argument is a DependsCALL, a leaf that resolves
        # its dependencies when it runs; plain CALLs stay on the compiled path.
        if cls is CALL and (len(args) > 1 or kwargs):
            return super().__new__(tool("call_kind")(args[1:], kwargs))
        return super().__new__(cls)

    def __init__(self, fn: Callable, *args: Any, store_to: Register | None = None, **kwargs: Any):
        if not callable(fn):
            raise TypeError(f"CALL: fn must be callable, got {type(fn).__name__} {fn!r:.60}")
        self._init(fn=fn, args=tuple(args), kwargs=dict(kwargs), store_to=_check_target(store_to, "CALL"))

    def own_reads(self) -> list[Register]:
        return list(iter_registers(self.args)) + list(iter_registers(self.kwargs))

    def own_writes(self) -> list[Register]:
        return [self.store_to] if self.store_to is not None else []


@stable("flowvm")
class PRINT(Element):
    """One step: print the objects (a Register prints its value)."""

    kind = "PRINT"
    is_leaf = True
    simple_leaf = True

    def __init__(self, *objs: Any, sep: str = " "):
        if not isinstance(sep, str):
            raise TypeError("PRINT: sep must be a str")
        self._init(objs=tuple(objs), sep=sep)

    def own_reads(self) -> list[Register]:
        return list(iter_registers(self.objs))


@stable("flowvm")
class SEQ(Element):
    """Run the children in order; the value is the last child's."""

    kind = "SEQ"

    def __init__(self, elements: Iterable[Element]):
        if isinstance(elements, Element) or not isinstance(elements, Iterable):
            raise TypeError(f"SEQ: expects a list of elements, got {type(elements).__name__}")
        elements = tuple(elements)
        for i, el in enumerate(elements):
            _check_element(el, "SEQ", f"element {i}")
        self._init(elements=elements)

    @property
    def children(self):
        return self.elements

    def with_children(self, children):
        return SEQ(children)


@stable("flowvm")
class REPEAT(Element):
    """Run ``element`` n times (n an int or a Register read on entry).

    The counter register holds 0 on entry and the number of finished
    iterations after each one.  The value is the last iteration's (None when
    n is 0).
    """

    kind = "REPEAT"

    def __init__(self, n: int | Register, element: Element, counter: Register | None = None):
        n = _check_count(n, "REPEAT")
        _check_element(element, "REPEAT", "body")
        if counter is not None and not isinstance(counter, Register):
            raise TypeError(f"REPEAT: counter must be a Register or None, got {type(counter).__name__}")
        self._init(n=n, body=element, counter=counter)

    @property
    def children(self):
        return (self.body,)

    def with_children(self, children):
        (body,) = children
        return REPEAT(self.n, body, self.counter)

    def own_reads(self):
        return [self.n] if isinstance(self.n, Register) else []

    def own_writes(self):
        return [self.counter] if self.counter is not None else []


@stable("flowvm")
class LOOP(Element):
    """Run ``element`` forever; only an enclosing WEAVE (or stopping the driver) ends it."""

    kind = "LOOP"

    def __init__(self, element: Element):
        self._init(body=_check_element(element, "LOOP", "body"))

    @property
    def children(self):
        return (self.body,)

    def with_children(self, children):
        (body,) = children
        return LOOP(body)


@stable("flowvm")
class WHILE(Element):
    """Evaluate ``cond`` (a CALL, one step) before each iteration; loop while it is truthy.

    The value is the last iteration's (None when no iteration ran).
    """

    kind = "WHILE"

    def __init__(self, cond: CALL, element: Element):
        if not isinstance(cond, CALL):
            raise TypeError(f"WHILE: cond must be a CALL, got {type(cond).__name__} {cond!r:.60}")
        self._init(cond=cond, body=_check_element(element, "WHILE", "body"))

    @property
    def children(self):
        return (self.cond, self.body)

    def with_children(self, children):
        cond, body = children
        return WHILE(cond, body)


@stable("flowvm")
class SWITCH(Element):
    """Run ``cases[value]`` where value is the selector's (a Register, or a CALL run as a step).

    With no matching case the default runs; with no default either, running
    it raises ``SwitchError`` naming the value.  The value is the case's.
    """

    kind = "SWITCH"

    def __init__(self, selector: Register | CALL, cases: Mapping[Any, Element], default: Element | None = None):
        if not isinstance(selector, (Register, CALL)):
            raise TypeError(f"SWITCH: selector must be a Register or a CALL, got {type(selector).__name__}")
        if not isinstance(cases, Mapping):
            raise TypeError(f"SWITCH: cases must be a dict of value -> element, got {type(cases).__name__}")
        for key, el in cases.items():
            _check_element(el, "SWITCH", f"case {key!r}")
        if default is not None:
            _check_element(default, "SWITCH", "default")
        self._init(selector=selector, cases=dict(cases), default=default)

    @property
    def children(self):
        head = (self.selector,) if isinstance(self.selector, CALL) else ()
        tail = (self.default,) if self.default is not None else ()
        return head + tuple(self.cases.values()) + tail

    def with_children(self, children):
        children = list(children)
        selector = children.pop(0) if isinstance(self.selector, CALL) else self.selector
        cases = dict(zip(self.cases, children[: len(self.cases)]))
        rest = children[len(self.cases):]
        return SWITCH(selector, cases, rest[0] if rest else None)

    def case_index(self, key: Any) -> int:
        """Index in ``children`` of the case for key (the default when no case matches), or -1."""
        head = 1 if isinstance(self.selector, CALL) else 0
        try:
            return head + list(self.cases).index(key) if key in self.cases else (
                head + len(self.cases) if self.default is not None else -1)
        except TypeError:  # unhashable selector value
            return head + len(self.cases) if self.default is not None else -1

    def own_reads(self):
        return [self.selector] if isinstance(self.selector, Register) else []


@stable("flowvm")
class WEAVE(Element):
    """Interleave the children, one step each in round-robin order.

    Done when ``n_required`` children have finished (-1: all); the others are
    abandoned.  ``weights`` give relative step frequencies: with integer
    weights a child takes that many consecutive steps per turn; a weight
    below 1 makes a child skip turns.  The value is the list of the
    children's values (None for an abandoned child).
    """

    kind = "WEAVE"

    def __init__(self, n_required: int, elements: Iterable[Element], weights: Sequence[float] | None = None):
        if isinstance(n_required, bool) or not isinstance(n_required, numbers.Integral):
            raise TypeError(f"WEAVE: n_required must be an int, got {type(n_required).__name__}")
        if isinstance(elements, Element) or not isinstance(elements, Iterable):
            raise TypeError(f"WEAVE: expects a list of elements, got {type(elements).__name__}")
        elements = tuple(elements)
        for i, el in enumerate(elements):
            _check_element(el, "WEAVE", f"element {i}")
        n_required = int(n_required)
        if n_required < -1:
            raise ValueError(f"WEAVE: n_required must be -1 (all) or >= 0, got {n_required}")
        if n_required > len(elements):
            raise ValueError(f"WEAVE: n_required={n_required} but it has only {len(elements)} children")
        if weights is not None:
            if isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable):
                raise TypeError(f"WEAVE: weights must be a sequence of numbers, one per child, got "
                                f"{type(weights).__name__} {weights!r:.60}")
            weights = tuple(weights)
            if len(weights) != len(elements):
                raise ValueError(f"WEAVE: {len(weights)} weights for {len(elements)} children")
            for w in weights:
                if isinstance(w, bool) or not isinstance(w, numbers.Real) or not w > 0 or w != w or w == float("inf"):
                    raise ValueError(f"WEAVE: weights must be positive finite numbers, got {w!r}")
        self._init(n_required=n_required, elements=elements, weights=weights)

    @property
    def children(self):
        return self.elements

    def with_children(self, children):
        return WEAVE(self.n_required, children, self.weights)

    @property
    def required(self) -> int:
        return len(self.elements) if self.n_required == -1 else self.n_required


@stable("flowvm")
class BUFFER(Element):
    """Run ``element`` n times and collect its values.

    The value is a list, stacked into one numpy array (or torch tensor) when
    all values are numpy arrays/scalars (or all are tensors) of one shape.
    """

    kind = "BUFFER"

    def __init__(self, n: int | Register, element: Element, store_to: Register | None = None):
        n = _check_count(n, "BUFFER")
        _check_element(element, "BUFFER", "body")
        self._init(n=n, body=element, store_to=_check_target(store_to, "BUFFER"))

    @property
    def children(self):
        return (self.body,)

    def with_children(self, children):
        (body,) = children
        return BUFFER(self.n, body, self.store_to)

    def own_reads(self):
        return [self.n] if isinstance(self.n, Register) else []

    def own_writes(self):
        return [self.store_to] if self.store_to is not None else []


ELEMENT_KINDS = (CALL, PRINT, SEQ, REPEAT, LOOP, WHILE, SWITCH, WEAVE, BUFFER)
