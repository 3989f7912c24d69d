"""Printers: a short repr, an indented listing, and the listing with a driver's position.

The listing reads like code: a leaf is a call (``y = f(x, lr=0.1)``), a
container is a block header followed by its indented children.  Registers
print as bare names; constants print as their repr (shortened).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

from .elements import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Element, provide
from .protocol import target_text
from .kinds import KindTable
from .registers import Register

INDENT = "    "


def fn_name(fn: Any) -> str:
    """A readable name for a callable: ``f``, ``Dataset.next``, ``Linear``, ``partial(f, ...)``."""
    if isinstance(fn, functools.partial):
        return f"partial({fn_name(fn.func)}, ...)"
    owner = getattr(fn, "__self__", None)
    if isinstance(fn, (types.MethodType, types.BuiltinMethodType)) and owner is not None \
            and not isinstance(owner, types.ModuleType):
        owner_name = owner.__name__ if isinstance(owner, type) else type(owner).__name__
        return f"{owner_name}.{fn.__name__}"
    objclass = getattr(fn, "__objclass__", None)
    if isinstance(fn, (types.MethodDescriptorType, types.WrapperDescriptorType)) and objclass is not None:
        name = objclass.__name__
        return f"{'Tensor' if name in ('TensorBase', '_TensorBase') else name}.{fn.__name__}"  # str.upper, Tensor.add
    if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, type)):
        return _function_name(fn)
    name = getattr(fn, "__name__", None)
    if isinstance(name, str) and name.isidentifier():  # numpy's ufuncs and dispatchers: numpy.add, numpy.clip
        module = getattr(fn, "__module__", None)
        return f"{module}.{name}" if isinstance(module, str) and module else name
    return type(fn).__name__


def _function_name(fn: Any) -> str:
    qual = getattr(fn, "__qualname__", None) or fn.__name__
    if qual.startswith("_") and "." in qual and isinstance(fn, types.BuiltinFunctionType):
        # a builtin kept in a hidden class of its module, such as torch.sin
        return f"{fn.__module__}.{fn.__name__}" if getattr(fn, "__module__", None) else fn.__name__
    return qual.rsplit("<locals>.", 1)[-1]


def _shape_text(kind: str, value: Any, dtype: str) -> str:
    return f"<{kind} {dtype} {'x'.join(map(str, value.shape)) or 'scalar'}>"


def _array_text(value: Any) -> str | None:
    """A numpy array or torch tensor as its kind, dtype and shape (None for anything else)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        return _shape_text("array", value, str(value.dtype))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _shape_text("tensor", value, str(value.dtype).replace("torch.", ""))
    return None


def _container_text(value: Any, is_seq: bool, limit: int, inside: frozenset) -> str:
    opening, closing = ("[", "]") if isinstance(value, list) else ("(", ")") if is_seq else ("{", "}")
    if id(value) in inside:
        return f"{opening}...{closing}"
    inside = inside | {id(value)}
    parts, size = [], 0
    for item in (value if is_seq else value.items()):
        part = fmt(item, limit, inside) if is_seq else f"{fmt(item[0], limit, inside)}: {fmt(item[1], limit, inside)}"
        parts.append(part)
        size += len(part) + 2
        if size > limit:  # the rest would be cut off anyway
            break
    inner = ", ".join(parts)
    if is_seq and not isinstance(value, list) and len(value) == 1:
        inner += ","
    return f"{opening}{inner}{closing}"


def fmt(value: Any, limit: int = 40, _inside: frozenset = frozenset()) -> str:
    """A short source-like rendering of an argument value (containers: only as much as the limit shows;
    a container inside itself: ``[...]``)."""
    if isinstance(value, Register):
        return value.name
    text = _array_text(value)
    if text is not None:
        return text
    is_seq = isinstance(value, (list, tuple)) and not hasattr(value, "_fields")
    if is_seq or isinstance(value, dict):
        text = _container_text(value, is_seq, limit, _inside)
    elif callable(value) and not isinstance(value, type):
        text = fn_name(value)
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call_text(el: CALL) -> str:
    own = getattr(type(el.fn), "__flowvm_text__", None)  # a callable that prints as code of its own
    if own is not None:  # (a statement of a @flowvm.program function)
        return own.__get__(el.fn)
    args = [fmt(a) for a in el.args] + [f"{k}={fmt(v)}" for k, v in el.kwargs.items()]
    text = f"{fn_name(el.fn)}({', '.join(args)})"
    return f"{target_text(el.store_to)} = {text}" if el.store_to is not None else text


def _header_other(el: Element) -> str:
    text = getattr(el, "header_text", None)  # a kind written elsewhere may print itself
    return text() if text is not None else (f"{el.kind}:" if el.children and not el.is_leaf else el.kind)


def _weave_header(el: WEAVE) -> str:
    n = len(el.elements)
    req = f"all of {n}" if el.n_required == -1 else f"{el.n_required} of {n}"
    weights = f" (weights {', '.join(fmt(w) for w in el.weights)})" if el.weights is not None else ""
    return f"WEAVE {req}{weights}:"


def _selector_text(el: SWITCH) -> str:
    return el.selector.name if isinstance(el.selector, Register) else call_text(el.selector)


HEADER = KindTable("header", _header_other, {
    CALL: call_text,
    PRINT: lambda el: "PRINT " + ", ".join(fmt(o) for o in el.objs),
    SEQ: lambda el: "SEQ:" if el.elements else "SEQ: pass",
    REPEAT: lambda el: f"REPEAT {fmt(el.n)}" + (f" (counter {el.counter.name})" if el.counter is not None else "") + ":",
    BUFFER: lambda el: (f"{el.store_to.name} = " if el.store_to is not None else "") + f"BUFFER {fmt(el.n)}:",
    LOOP: lambda el: "LOOP:",
    WHILE: lambda el: f"WHILE {call_text(el.cond)}:",
    SWITCH: lambda el: f"SWITCH {_selector_text(el)}:",
    WEAVE: _weave_header,
})
"""The one line that stands for an element in a listing, by kind (default: ``header_text()`` when the
element has one, else its kind, with a colon when it has children)."""

DESCRIBE = KindTable("describe", lambda el: header(el).rstrip(":"), {CALL: lambda el: f"CALL {call_text(el)}"})
"""The one-line description of an element in error messages, by kind (default: its header)."""


def header(el: Element) -> str:
    """The one line that stands for el in a listing (without its children)."""
    return HEADER.of(el)(el)


def describe(el: Element) -> str:
    """A one-line description used in error messages: kind and header."""
    return DESCRIBE.of(el)(el)


def short(el: Element) -> str:
    if el.is_leaf:
        return f"<{describe(el)}>"
    return f"<{describe(el)} ({len(el.children)} children)>"


def _child_lines(el: Element, path: tuple, depth: int, visit) -> None:
    for i, child in enumerate(el.children):
        visit(child, path + (i,), depth + 1)


def _while_lines(el: WHILE, path: tuple, depth: int, visit) -> None:
    visit(el.body, path + (1,), depth + 1)  # the condition prints on the WHILE's line


def _switch_lines(el: SWITCH, path: tuple, depth: int, visit, out: list) -> None:
    children = el.children
    head = len(children) - len(el.cases) - (el.default is not None)
    for k, key in enumerate(el.cases):
        out.append((None, depth + 1, f"CASE {fmt(key)}:"))
        visit(children[head + k], path + (head + k,), depth + 2)
    if el.default is not None:
        out.append((None, depth + 1, "DEFAULT:"))
        visit(children[-1], path + (len(children) - 1,), depth + 2)


BODY = KindTable("listing body", lambda el, path, depth, visit, out: _child_lines(el, path, depth, visit), {
    WHILE: lambda el, path, depth, visit, out: _while_lines(el, path, depth, visit),
    SWITCH: _switch_lines,
})
"""The lines below an element's header, by kind: ``fn(el, path, depth, visit, out)`` calls
``visit(child, child_path, child_depth)`` for the children it shows and may append labels
``(None, depth, text)`` to out (default: every child, one level deeper)."""


def lines(program: Element) -> list[tuple[tuple[int, ...] | None, int, str]]:
    """(path, depth, text) for each line of the listing; path is None for CASE/DEFAULT labels."""
    out: list[tuple[tuple[int, ...] | None, int, str]] = []

    def visit(el: Element, path: tuple[int, ...], depth: int) -> None:
        out.append((path, depth, header(el)))
        for text in getattr(el, "detail_lines", lambda: ())():  # e.g. the calls a fused step replaced
            out.append((None, depth + 1, text))
        BODY.of(el)(el, path, depth, visit, out)

    visit(program, (), 0)
    return out


def listing(program: Element, marks: dict | None = None) -> str:
    """The program as indented code.  marks maps a path to (gutter, comment) for that line."""
    rows = lines(program)
    index = {path: k for k, (path, _, _) in enumerate(rows) if path is not None}
    notes: dict[int, tuple[str, str]] = {}
    for path, (gutter, comment) in (marks or {}).items():
        while path not in index and path:  # a WHILE condition or SWITCH selector prints on its parent's line
            path = path[:-1]
        k = index[path]
        old = notes.get(k)
        if old is None or (gutter.strip() and not old[0].strip()):
            notes[k] = (gutter, comment if comment else (old[1] if old else ""))
    gutter_width = 3 if marks else 0
    text = []
    for k, (path, depth, body) in enumerate(rows):
        gutter, comment = notes.get(k, ("", ""))
        line = f"{gutter:<{gutter_width}}{INDENT * depth}{body}"
        if comment:
            line += f"  # {comment}"
        text.append(line)
    return "\n".join(text)


provide("listing", listing)  # str(element)
provide("short", short)  # repr(element)
