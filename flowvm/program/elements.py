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
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..pickled import stable
from .protocol import (TOOLS, Element, Leaf, check_count, check_element, check_target, provide,  # noqa: F401
                      subtrees_changed, tool)  # (re-exported: the names every layer imports from here)
from .registers import Register, iter_registers


@stable("flowvm")
class CALL(Element):
    """One step: call ``fn(*args, **kwargs)``.

    Registers anywhere in args and kwargs (also inside lists, tuples and dicts)
    are replaced by their values when the call runs.  The return value is the
    element's value, stored to ``store_to`` when given: a register, or a tuple of registers that the value
    is unpacked into as Python's ``a, b = value`` does (``store_to=(reg('a'), reg('b'))``).
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
        self._init(fn=fn, args=tuple(args), kwargs=dict(kwargs), store_to=check_target(store_to, "CALL", unpack=True))

    def own_reads(self) -> list[Register]:
        return list(iter_registers(self.args)) + list(iter_registers(self.kwargs))

    def own_writes(self) -> list[Register]:
        if isinstance(self.store_to, tuple):
            return list(self.store_to)
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
            check_element(el, "SEQ", f"element {i}")
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
        n = check_count(n, "REPEAT")
        check_element(element, "REPEAT", "body")
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
        self._init(body=check_element(element, "LOOP", "body"))

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
        self._init(cond=cond, body=check_element(element, "WHILE", "body"))

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
            check_element(el, "SWITCH", f"case {key!r}")
        if default is not None:
            check_element(default, "SWITCH", "default")
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
            check_element(el, "WEAVE", f"element {i}")
        n_required = int(n_required)
        if n_required < -1:
            raise ValueError(f"WEAVE: n_required must be -1 (all) or >= 0, got {n_required}")
        if n_required > len(elements):
            raise ValueError(f"WEAVE: n_required={n_required} but it has only {len(elements)} children")
        if weights is not None:
            weights = _check_weights(weights, len(elements))
        self._init(n_required=n_required, elements=elements, weights=weights)

    @property
    def children(self):
        return self.elements

    def with_children(self, children):
        return WEAVE(self.n_required, children, self.weights)

    @property
    def required(self) -> int:
        return len(self.elements) if self.n_required == -1 else self.n_required


def _check_weights(weights: Any, n: int) -> tuple:
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable):
        raise TypeError(f"WEAVE: weights must be a sequence of numbers, one per child, got "
                        f"{type(weights).__name__} {weights!r:.60}")
    weights = tuple(weights)
    if len(weights) != n:
        raise ValueError(f"WEAVE: {len(weights)} weights for {n} children")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not w > 0 or w != w or w == float("inf"):
            raise ValueError(f"WEAVE: weights must be positive finite numbers, got {w!r}")
    return weights


@stable("flowvm")
class BUFFER(Element):
    """Run ``element`` n times and collect its values.

    The value is a list, stacked into one numpy array (or torch tensor) when
    all values are numpy arrays/scalars (or all are tensors) of one shape.
    """

    kind = "BUFFER"

    def __init__(self, n: int | Register, element: Element, store_to: Register | None = None):
        n = check_count(n, "BUFFER")
        check_element(element, "BUFFER", "body")
        self._init(n=n, body=element, store_to=check_target(store_to, "BUFFER"))

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


for _kind in (CALL, PRINT, SEQ, REPEAT, LOOP, WHILE, SWITCH, WEAVE, BUFFER):
    _kind.frame_kind = _kind  # inherited: a subclass is its kind (Element.frame_kind)
del _kind
