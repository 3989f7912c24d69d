"""Matching elements against a pattern: what ``find`` (flowvm.editing.edit) looks for.

A pattern matches elements of the same kind whose function and given arguments are equal; positional
arguments are compared from the first (``ANY`` matches anything), keyword arguments not named in the
pattern match anything, ``store_to`` is compared only when the pattern gives one, and a Register matches a
Register of the same name.  A container pattern matches containers with equal settings whose children
match the pattern's children.  A plain function as the pattern matches every CALL of it, an element class
(``REPEAT``) every element of that kind.
"""

from __future__ import annotations

import types
from typing import Any, Callable

from ..program.elements import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Element
from ..program.kinds import KindTable
from ..program.paths import format_path, walk
from ..program.printer import describe, fn_name
from ..program.registers import Register, Registers


class _Any:
    """Matches any argument in a pattern."""

    def __repr__(self) -> str:
        return "ANY"

    def __reduce__(self):
        return "ANY"


ANY = _Any()


def same_value(p: Any, v: Any) -> bool:
    """Whether pattern value p matches value v (ANY, Registers by name, containers item by item)."""
    if p is ANY or p is v:
        return True
    if getattr(v, "__func__", None) is p and p is not None:  # Class.method matches obj.method
        return True
    if isinstance(p, types.FunctionType) and _same_function(p, getattr(v, "__func__", v)):
        return True
    for kind, compare in _STRUCTURED:
        if isinstance(p, kind) and not isinstance(p, Registers):
            return compare(p, v)
    return type(p) is type(v) and _equal(p, v)


def _same_items(p: list | tuple, v: Any) -> bool:
    return type(p) is type(v) and len(p) == len(v) and all(same_value(a, b) for a, b in zip(p, v))


def _same_entries(p: dict, v: Any) -> bool:
    return isinstance(v, dict) and len(p) == len(v) and all(k in v and same_value(p[k], v[k]) for k in p)


# pattern values compared by their structure: (their class, the comparison), in order
_STRUCTURED = (
    (Register, lambda p, v: isinstance(v, Register) and p.name == v.name),
    (Element, lambda p, v: isinstance(v, Element) and matches(p, v)),
    ((list, tuple), _same_items),
    (dict, _same_entries),
)


def _equal(p: Any, v: Any) -> bool:
    """p == v, for values of one type; numpy arrays and tensors are equal when every item is."""
    try:
        equal = p == v
    except Exception:
        return False
    if isinstance(equal, bool):
        return equal
    try:
        return bool(equal.all()) and getattr(p, "shape", None) == getattr(v, "shape", None)
    except Exception:
        return False


def _same_function(p: types.FunctionType, v: Any) -> bool:
    """Whether v is a copy of function p (one pickled by value, as functions of a script are): the same
    module, qualified name and code."""
    return (isinstance(v, types.FunctionType) and v.__qualname__ == p.__qualname__
            and v.__module__ == p.__module__ and v.__code__.co_code == p.__code__.co_code
            and v.__code__.co_consts == p.__code__.co_consts)


def matches(pattern: Element, el: Element) -> bool:
    """Whether el matches pattern (see the module docstring)."""
    if pattern is el:
        return True
    if pattern.kind != el.kind or not SETTINGS_MATCH.of(pattern)(pattern, el):
        return False
    pc, ec = pattern.children, el.children
    return len(pc) == len(ec) and all(matches(a, b) for a, b in zip(pc, ec))


def _call_matches(pattern: CALL, el: Element) -> bool:
    return (isinstance(el, CALL) and same_value(pattern.fn, el.fn)
            and len(pattern.args) <= len(el.args)
            and all(same_value(p, v) for p, v in zip(pattern.args, el.args))
            and all(k in el.kwargs and same_value(p, el.kwargs[k]) for k, p in pattern.kwargs.items())
            and (pattern.store_to is None or same_value(pattern.store_to, el.store_to)))


def _print_matches(pattern: PRINT, el: PRINT) -> bool:
    return len(pattern.objs) <= len(el.objs) and all(same_value(p, v) for p, v in zip(pattern.objs, el.objs))


def _counted_matches(pattern: REPEAT | BUFFER, el: REPEAT | BUFFER, extra: str) -> bool:
    given = getattr(pattern, extra)
    return same_value(pattern.n, el.n) and (given is None or same_value(given, getattr(el, extra)))


def _switch_matches(pattern: SWITCH, el: SWITCH) -> bool:
    return (list(pattern.cases) == list(el.cases) and (pattern.default is None) == (el.default is None)
            and same_value(pattern.selector, el.selector))


def _weave_matches(pattern: WEAVE, el: WEAVE) -> bool:
    return pattern.n_required == el.n_required and (pattern.weights is None or pattern.weights == el.weights)


def _fields_match(pattern: Element, el: Element) -> bool:
    """Another kind: every field equal (fields holding its children are left to the children's match)."""
    fields, other = _settings(pattern), _settings(el)
    return fields.keys() == other.keys() and all(same_value(fields[k], other[k]) for k in fields)


def _settings(el: Element) -> dict:
    kids = {id(c) for c in el.children}

    def child_field(v: Any) -> bool:  # a child, or a list of children
        return id(v) in kids or (isinstance(v, (list, tuple)) and bool(v) and all(id(x) in kids for x in v))

    return {k: v for k, v in el.__dict__.items() if not k.startswith("_") and k != "scope" and not child_field(v)}


SETTINGS_MATCH = KindTable("match", _fields_match, {
    CALL: _call_matches, PRINT: _print_matches,
    REPEAT: lambda p, el: _counted_matches(p, el, "counter"), BUFFER: lambda p, el: _counted_matches(p, el, "store_to"),
    SWITCH: _switch_matches, WEAVE: _weave_matches,
    SEQ: lambda p, el: True, LOOP: lambda p, el: True, WHILE: lambda p, el: True,
})
"""Whether an element's own settings match a pattern of its kind, by the pattern's kind: ``fn(pattern, el)``
(the children are matched after it, one by one).  Default: every field equal."""


def pattern_test(pattern: Any) -> Callable[[Element], bool] | None:
    if pattern is None:
        return None
    if isinstance(pattern, Element):
        return lambda el: matches(pattern, el)
    if isinstance(pattern, type) and issubclass(pattern, Element):  # an element kind: all elements of it
        return lambda el: isinstance(el, pattern)
    if callable(pattern):
        return lambda el: isinstance(el, CALL) and same_value(pattern, el.fn)
    raise TypeError(f"find: the pattern must be an element or a function, got {type(pattern).__name__} "
                    f"{pattern!r:.60} (use where= for a predicate)")


def describe_pattern(pattern: Any, where: Any) -> str:
    parts = []
    if isinstance(pattern, Element):
        parts.append(describe(pattern))
    elif isinstance(pattern, type) and issubclass(pattern, Element):
        parts.append(f"any {pattern.kind}")
    elif pattern is not None:
        parts.append(f"CALL {fn_name(pattern)}(...)")
    if where is not None:
        parts.append(f"where {getattr(where, '__name__', 'predicate')}")
    return " ".join(parts)


def near_misses(program: Element, pattern: Any) -> str:
    """A hint naming elements of the same kind and function when nothing matched."""
    if isinstance(pattern, CALL):
        same_fn = [(p, el) for p, el in walk(program) if isinstance(el, CALL) and same_value(pattern.fn, el.fn)]
        if same_fn:
            shown = "; ".join(f"{describe(el)} at {format_path(p)!r}" for p, el in same_fn[:3])
            return f" (CALLs of the same function with other arguments: {shown})"
        return " (no CALL of that function at all)"
    if isinstance(pattern, Element):
        kinds = sum(1 for _, el in walk(program) if el.kind == pattern.kind)
        return f" ({kinds} {pattern.kind} elements, none with these settings and children)"
    return ""
