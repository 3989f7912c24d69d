"""Turn a simple leaf element into a fast zero-argument Python function.

The driver calls simple leaves (CALL, PRINT, and other kinds that set
``simple_leaf`` and define ``leaf_for(registers)``) through these closures.  They are caches: stored on
the element under a ``_c_`` name, keyed by the register file they read, never
pickled, and rebuilt on first use after loading.
"""

from __future__ import annotations

import keyword

from typing import Any, Callable

from ..program.protocol import store_source
from ..program.elements import CALL, PRINT, Element
from ..program.kinds import KindTable
from ..program.registers import Register, has_registers, resolve


def leaf_function(el: Element, regs: dict) -> Callable[[], Any]:
    """The compiled form of a simple leaf (a CALL, a PRINT, a fused step), bound to the register file regs."""
    cached = el.__dict__.get("_c_leaf")
    if cached is not None and cached[0] is regs:
        return cached[1]
    fn = _build(el, regs)
    el.__dict__["_c_leaf"] = (regs, fn)
    return fn


def _arg_source(value: Any, name: str, ns: dict) -> str:
    """Python source for one argument: a register lookup, a resolved container, or a constant."""
    if isinstance(value, Register):
        return f"R[{value.name!r}]"
    ns[name] = value
    if has_registers(value):
        return f"resolve({name}, R)"
    return name


def _call_source(el: CALL, ns: dict) -> str:
    ns["fn"] = el.fn
    parts = [_arg_source(a, f"a{i}", ns) for i, a in enumerate(el.args)]
    for i, (key, value) in enumerate(el.kwargs.items()):
        if key.isidentifier() and not keyword.iskeyword(key):
            parts.append(f"{key}={_arg_source(value, f'k{i}', ns)}")
        else:  # a keyword that is not an identifier can only be passed through **
            ns[f"kw{i}"] = {key: value}
            parts.append(f"**resolve(kw{i}, R)")
    call = f"fn({', '.join(parts)})"
    if el.store_to is None:
        return f"def leaf():\n    return {call}\n"
    return f"def leaf():\n    v = {call}\n    {store_source(el.store_to)} = v\n    return v\n"


def _print_source(el: PRINT, ns: dict) -> str:
    ns["objs"] = el.objs
    ns["sep"] = el.sep
    return "def leaf():\n    print(*resolve(objs, R), sep=sep)\n"


LEAF_SOURCE = KindTable("leaf source", lambda el, ns: None, {CALL: _call_source, PRINT: _print_source})
"""The source of a simple leaf's function, by kind: ``fn(el, ns)`` returns the text of ``def leaf(): ...``
and puts the names it uses in ns (``R`` is the register file, ``resolve`` fills registers in).  Default:
None, for a simple leaf kind that makes its own function with ``leaf_for(registers)``."""


def _build(el: Element, regs: dict) -> Callable[[], Any]:
    ns: dict[str, Any] = {"R": regs, "resolve": resolve}
    src = LEAF_SOURCE.of(el)(el, ns)
    if src is None:
        if not el.simple_leaf:  # pragma: no cover - guarded by the driver
            raise TypeError(f"{el.kind} is not a simple leaf element")
        return el.leaf_for(regs)
    exec(compile(src, f"<flowvm {el.kind}>", "exec"), ns)
    return ns["leaf"]
