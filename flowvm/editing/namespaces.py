"""Namespaces: two instances of one template side by side without sharing registers.

A template is a function that builds a sub-program over register names it
chooses (``reg('w')``, ``reg('loss')``).  Two instances in one program would
read and write the same registers.  ``isolate(sub, 'a')`` (also
``sub.isolate('a')``) moves every register of the sub-program into the
namespace ``a`` (``w`` becomes ``a.w``) except the ``shared`` ones (and those
the template declares shared), and marks
the sub-program's root as an instance, so that ``verify`` (and ``start()``)
report collisions: two instances, not the same element, that write a
register in common, other than one both declare shared.  ``@template`` marks
what a function builds as an instance without renaming, so that two
un-isolated instances are reported too.

>>> from flowvm import CALL, SEQ, Registers
>>> reg = Registers(lr=0.5)
>>> @template(shared=["lr"])
... def train(w0):
...     return SEQ([CALL(float, w0, store_to=reg('w')),
...                 CALL(lambda w, lr: w - lr, reg('w'), reg('lr'), store_to=reg('w'))])
>>> prog = SEQ([train(1).isolate('a'), train(2).isolate('b')])
>>> prog.run(), reg['a.w'], reg['b.w']
(1.5, 0.5, 1.5)
>>> print(prog)
SEQ:
    SEQ:
        a.w = float(1)
        a.w = <lambda>(a.w, lr)
    SEQ:
        b.w = float(2)
        b.w = <lambda>(b.w, lr)
>>> SEQ([train(1), train(2)]).run()
Traceback (most recent call last):
...
flowvm.VerifyError: register collision: two instances of template flowvm.editing.namespaces.train (paths '0' and '1', ...

A register that holds a value when it is isolated is copied to its new name
(the original stays), so templates may give their registers initial values.
Renamed registers are those referenced anywhere in the sub-program: CALL and
PRINT arguments, ``store_to``, REPEAT/BUFFER counts and counters, SWITCH
selectors, and the ``__flowvm_source__()`` arguments of other kinds (a
POPEN's argument list, a SPAWN's fragment).  A ``Depends`` provider is not a
register and is not renamed.  An element found at several places stays
shared in the result.
"""

from __future__ import annotations

import copy

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..pickled import stable
from ..program.elements import BUFFER, CALL, PRINT, REPEAT, SWITCH, Element, provide
from ..program.kinds import KindTable
from ..program.registers import Register, Registers, same_kind_of_dict
from ..program.verify import check_collisions, collisions, instances  # noqa: F401  (they check what isolate makes)

SEPARATOR = "."


@stable("flowvm.pickled")
@dataclass(frozen=True)
class Scope:
    """The mark on an instance's root: its namespace (None: not renamed), template name, shared registers."""

    namespace: str | None = None
    template: str | None = None
    shared: frozenset = frozenset()

    def __repr__(self) -> str:
        parts = []
        if self.namespace is not None:
            parts.append(f"namespace {self.namespace!r}")
        if self.template is not None:
            parts.append(f"template {self.template}")
        if self.shared:
            parts.append(f"shared {sorted(self.shared)}")
        return f"Scope({', '.join(parts)})"


def _rename_value(value: Any, rename: Callable[[Register], Register],
                  sub: Callable[[Element], Element] | None = None) -> Any:
    """value with its Registers renamed, also inside lists, tuples and dicts; elements go through sub."""
    if isinstance(value, Register):
        return rename(value)
    if isinstance(value, Element):
        return sub(value) if sub is not None else value
    if isinstance(value, list):
        return [_rename_value(v, rename, sub) for v in value]
    if isinstance(value, tuple):
        items = [_rename_value(v, rename, sub) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict) and not isinstance(value, Registers):
        pairs = {_rename_value(k, rename, sub): _rename_value(v, rename, sub) for k, v in value.items()}
        return pairs if type(value) is dict else same_kind_of_dict(value, pairs)
    return value


def rename_registers(program: Element, rename: Callable[[Register], Register],
                     rename_name: Callable[[str], str] | None = None) -> Element:
    """The program with every Register reference r replaced by rename(r).

    Instance marks are kept, their shared names mapped through rename_name.
    Kinds other than flowvm's own are rebuilt from their
    ``__flowvm_source__()`` form (constructor, args, kwargs), with Registers
    renamed and elements rebuilt wherever they appear in the arguments
    (a SPAWN's fragment and ``store_to``, a POPEN's argument list).  An
    element found at several places is rebuilt once, so the result shares it
    in the same way.
    """
    memo: dict[tuple, Element] = {}

    def scoped(keep: frozenset, rename: Callable[[Register], Register],
               rename_name: Callable[[str], str] | None) -> Callable[[Element], Element]:
        def sub(el: Element) -> Element:
            key = (id(el), keep)
            done = memo.get(key)
            if done is None:
                shared = el.scope.shared if el.scope is not None else frozenset()
                if shared - keep:  # an instance inside: what its template shares stays shared
                    inner = keep | shared
                    r = lambda reg: reg if reg.name in inner else rename(reg)  # noqa: E731
                    n = None if rename_name is None else (lambda name: name if name in inner else rename_name(name))
                    done = _rename_element(el, r, n, scoped(inner, r, n))
                else:
                    done = _rename_element(el, rename, rename_name, sub)
                memo[key] = done
            return done

        return sub

    return scoped(frozenset(), rename, rename_name)(program)


def _rename_call(el: CALL, rename, sub) -> Element:
    args = _rename_value(el.args, rename)  # data: an element there is a value
    kwargs = _rename_value(el.kwargs, rename)
    store = el.store_to if el.store_to is None else tuple(rename(r) for r in el.store_to) \
        if isinstance(el.store_to, tuple) else rename(el.store_to)
    return CALL(el.fn, *args, store_to=store, **kwargs)


def _rename_switch(el: SWITCH, rename, sub) -> Element:
    selector = el.selector
    selector = rename(selector) if isinstance(selector, Register) else sub(selector)
    cases = {k: sub(c) for k, c in el.cases.items()}
    return SWITCH(selector, cases, sub(el.default) if el.default is not None else None)


def _rename_other(el: Element, rename, sub) -> Element:
    if getattr(el, "__flowvm_source__", None) is not None:  # rebuilt from its constructor form
        ctor, args, kwargs = el.__flowvm_source__()
        return ctor(*_rename_value(tuple(args), rename, sub), **_rename_value(dict(kwargs), rename, sub))
    if not (el.own_reads() or el.own_writes()):
        return el.with_children([sub(c) for c in el.children]) if el.children else el
    raise TypeError(f"isolate: cannot rename the registers of a {el.kind} element; give its class a "
                    "__flowvm_source__() method (see flowvm.views.source), or register its RENAME entry")


def _maybe(r: Register | None, rename) -> Register | None:
    return rename(r) if r is not None else None


RENAME = KindTable("rename", _rename_other, {
    CALL: _rename_call,
    PRINT: lambda el, rename, sub: PRINT(*_rename_value(el.objs, rename), sep=el.sep),
    REPEAT: lambda el, rename, sub: REPEAT(_rename_value(el.n, rename), sub(el.body), _maybe(el.counter, rename)),
    BUFFER: lambda el, rename, sub: BUFFER(_rename_value(el.n, rename), sub(el.body), _maybe(el.store_to, rename)),
    SWITCH: _rename_switch,
})
"""The element with its registers renamed, by kind: ``fn(el, rename, sub)``, where ``rename(register)`` gives
the new register and ``sub(child)`` the renamed child.  Default: a kind with ``__flowvm_source__`` is
rebuilt from it; one that reads and writes no register itself, over its renamed children."""


def _rename_element(el: Element, rename: Callable[[Register], Register], rename_name: Callable[[str], str] | None,
                    sub: Callable[[Element], Element]) -> Element:
    new = RENAME.of(el)(el, rename, sub)
    if new is el:
        return el
    for name in ("_overrides", "_settings"):
        table = el.__dict__.get(name)
        if table and new is not el:  # a sub-program's dependency_overrides and settings stay with it
            new = copy.copy(new)
            new.__dict__[name] = dict(table)
    scope = el.scope
    if scope is not None:
        if rename_name is not None and scope.shared:
            scope = Scope(scope.namespace, scope.template, frozenset(map(rename_name, scope.shared)))
        new = new.with_scope(scope)
    return new


def isolate(program: Element, namespace: str, shared: Iterable[str] = ()) -> Element:
    """The sub-program with its registers renamed ``namespace.name`` (except shared ones), marked as an instance."""
    if not isinstance(namespace, str) or not namespace.isidentifier():
        raise ValueError(f"isolate: the namespace must be an identifier like 'model_a', got {namespace!r}")
    shared = _names(shared, "isolate")
    if program.scope is not None:  # what a template declares shared stays shared
        shared |= program.scope.shared

    def rename_name(name: str) -> str:
        return name if name in shared else f"{namespace}{SEPARATOR}{name}"

    def rename(r: Register) -> Register:
        new = rename_name(r.name)
        if new == r.name:
            return r
        if r.name in r.file and new not in r.file:
            r.file[new] = _own_copy(r.file[r.name])
        return Register(r.file, new)

    renamed = rename_registers(program, rename, rename_name)
    old = renamed.scope
    if old is None:
        scope = Scope(namespace, None, shared)
    else:
        inner = old.namespace
        scope = Scope(namespace if inner is None else f"{namespace}{SEPARATOR}{inner}", old.template,
                      old.shared | shared)
    return renamed.with_scope(scope)


def _names(shared: Iterable[str] | str, owner: str) -> frozenset:
    """Shared register names: an iterable of str (one str is one name)."""
    names = frozenset([shared] if isinstance(shared, str) else shared)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{owner}: shared register names must be str, got {name!r}")
    return names


def _own_copy(value: Any) -> Any:
    """An instance's own copy of a value its template's register already holds (a list it appends to, a
    model it trains), so that instances do not share it; the value itself when it cannot be copied."""
    try:
        return copy.deepcopy(value)
    except Exception:
        return value


def template(fn: Callable[..., Element] | None = None, *, shared: Iterable[str] = ()):
    """Mark what fn builds as an instance of a template, so that verify reports two colliding instances.

    ``shared`` names registers every instance may write (a common log, say).
    Use as ``@template`` or ``@template(shared=['log'])``.
    """
    shared = _names(shared, "template")

    def decorate(build: Callable[..., Element]):
        name = f"{build.__module__}.{build.__qualname__}"

        @functools.wraps(build)
        def wrapper(*args, **kwargs):
            program = build(*args, **kwargs)
            if not isinstance(program, Element):
                raise TypeError(f"template {name} must return a flowvm element, got {type(program).__name__}")
            inner = program.scope  # the program of another template (or an isolated one): one instance
            if inner is not None:
                return program.with_scope(Scope(inner.namespace, name, inner.shared | shared))
            return program.with_scope(Scope(None, name, shared))

        return wrapper

    return decorate(fn) if fn is not None else decorate


provide("isolate", isolate)  # Element.isolate()
