"""How to_source (flowvm.views.source) writes values: constants as literals, registers, elements, importable
objects by name.  ``write_value(writer, v)`` looks the writer up by the value's exact type first (the
literals), then tries the wider kinds in order (named tuples, numpy, torch, callables and modules)."""

from __future__ import annotations

import functools
import importlib
import math
import sys
import types
from typing import Any, Callable

from ..program.elements import Element
from ..program.registers import Register

def import_of(obj: Any) -> tuple[str, str] | None:
    """(module, dotted attribute path) from which obj can be imported, or None."""
    if isinstance(obj, types.ModuleType):
        return (obj.__name__, "")
    owner = getattr(obj, "__self__", None)
    bound = owner is not None and not isinstance(owner, types.ModuleType)
    modules, attrs = _places(obj, owner if bound else None)
    for mod_name in modules:
        found = _lookup(mod_name, attrs, obj, bound)
        if found is not None:
            return (mod_name, found)
    return None


def _places(obj: Any, owner: Any) -> tuple[list, list]:
    """The modules obj may be found in and the attribute paths it may have there, most likely first."""
    modules = [getattr(obj, "__module__", None)]
    if owner is not None:
        modules.append(type(owner).__module__)
    attrs = [getattr(obj, "__qualname__", None), getattr(obj, "__name__", None)]
    objclass = getattr(obj, "__objclass__", None)  # a method descriptor: str.upper, torch.Tensor.add
    if isinstance(objclass, type) and isinstance(getattr(obj, "__name__", None), str):
        if objclass.__module__ == "torch._C" and objclass.__name__ == "TensorBase":
            modules.insert(0, "torch")  # written as torch.Tensor.NAME, the name users know
            attrs.insert(0, f"Tensor.{obj.__name__}")
        modules.append(objclass.__module__)
    return [m for m in modules if isinstance(m, str)], [a for a in attrs if isinstance(a, str) and "<" not in a]


def _lookup(mod_name: str, attrs: list, obj: Any, bound: bool) -> str | None:
    """The first of attrs that names obj in module mod_name (None when none does, or it does not import)."""
    try:
        module = importlib.import_module(mod_name)
    except Exception:
        return None
    for attr in attrs:
        found: Any = module
        try:
            for part in attr.split("."):
                found = getattr(found, part)
        except AttributeError:
            continue
        if found is obj or (bound and found == obj):
            return attr
    return None


def _float(w, v: float) -> str:
    return repr(v) if math.isfinite(v) else f"float({repr(v)!r})"


def _tuple(w, v: tuple) -> str:
    items = [w.value(x) for x in v]
    return w.seq("(", items, ",)" if len(items) == 1 else ")")


def _set(w, v) -> str:
    items = sorted(w.value(x) for x in v)
    return f"{type(v).__name__}({w.seq('[', items, ']')})"


def _partial(w, v: functools.partial) -> str:
    args = [w.ref(v.func)] + [w.value(a) for a in v.args] + [f"{k}={w.value(x)}" for k, x in v.keywords.items()]
    return w.call("functools.partial", args)


def _register(w, v: Register) -> str:
    if w.file is None:
        w.file = v.file
    elif v.file is not w.file:  # pragma: no cover - start() rejects such programs
        raise w.error("registers of two register files")
    return f"{w.reg_name}({v.name!r})"


def _depends(w, v) -> str:
    w.flowvm.add("Depends")
    extra = ", use_cache=False" if not v.use_cache else ""
    return f"Depends({w.ref(v.dependency)}{extra})"


def _array(w, v) -> str:
    text = w.call("numpy.array", [w.value(v.tolist()), f"dtype={str(v.dtype)!r}"])
    return text + (f".reshape({v.shape!r})" if v.size == 0 else "")


def _tensor(w, v) -> str:
    text = w.call("torch.tensor", [w.value(v.detach().tolist()), f"dtype={v.dtype}"])
    text += f".reshape({tuple(v.shape)!r})" if v.numel() == 0 else ""
    return text + (".requires_grad_()" if v.requires_grad else "")


BY_TYPE: dict[type, Callable[[Any, Any], str]] = {
    type(None): lambda w, v: "None", bool: lambda w, v: repr(v), str: lambda w, v: repr(v),
    bytes: lambda w, v: repr(v), int: lambda w, v: repr(v), float: _float,
    complex: lambda w, v: f"complex({w.value(v.real)}, {w.value(v.imag)})",
    list: lambda w, v: w.seq("[", [w.value(x) for x in v], "]"), tuple: _tuple,
    dict: lambda w, v: w.seq("{", [f"{w.value(k)}: {w.value(x)}" for k, x in v.items()], "}"),
    set: _set, frozenset: _set, functools.partial: _partial,
}


def _numeric(v) -> bool:
    return v.dtype.kind in "biufc"


def _kinds() -> list[tuple[Callable[[Any], bool], Callable[[Any, Any], str]]]:
    """(test, writer) for the values written by what they are rather than their exact type, in order."""
    from ..machine.depends import Depends

    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    out = [
        (lambda v: isinstance(v, (bool, str, bytes)), lambda w, v: repr(v)),
        (lambda v: isinstance(v, Element), lambda w, v: w.element(v, w.child_paths.get(id(v), w.path))),
        (lambda v: isinstance(v, Register), _register),
        (lambda v: isinstance(v, Depends), _depends),
        (lambda v: isinstance(v, tuple) and hasattr(v, "_fields"),
         lambda w, v: w.call(w.ref(type(v)), [w.value(x) for x in v])),
        (lambda v: isinstance(v, functools.partial), _partial),
    ]
    if np is not None:
        out.append((lambda v: isinstance(v, np.ndarray) and _numeric(v), _array))
        out.append((lambda v: isinstance(v, np.generic) and _numeric(v),
                    lambda w, v: f"numpy.{type(v).__name__}({w.value(v.item())})"))
    if torch is not None:
        out.append((lambda v: isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.is_complex(), _tensor))
    out.append((lambda v: callable(v) or isinstance(v, types.ModuleType) or hasattr(type(v), "__flowvm_value_source__"),
                lambda w, v: w.ref(v)))  # (ref writes a value that says how: __flowvm_value_source__)
    return out


def write_value(w, v: Any) -> str:
    """Source for v (w: the writer, for names, imports and layout); SourceError for a value with none."""
    writer = BY_TYPE.get(type(v))
    if writer is not None:
        return writer(w, v)
    for test, writer in _kinds():
        if test(v):
            return writer(w, v)
    raise w.error(f"{describe_value(v)} has no source form; pass names={{'name': obj}} to to_source "
                  "(and the same names to from_source)")


def describe_value(obj: Any) -> str:
    """What obj is, in words, for errors: ``f (function)``, ``a Model value <Model ...>``."""
    from ..program.printer import fn_name

    if callable(obj):
        return f"{fn_name(obj)} ({type(obj).__name__})"
    return f"a {type(obj).__name__} value {obj!r:.40}"
