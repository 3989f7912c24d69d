"""The objects a program's elements reach, and their states in a state checkpoint (flowvm.persist.state).

``roots(program)`` lists ``(location, object)`` for every object with state that the elements reach, in
walk order: a CALL's ``fn`` when it is an object, the ``self`` of a bound method (``"0.1:fn.self"``), the
objects among its arguments (``"0.1:args.0"``, ``"0.1:kwargs.model"``, inside lists, tuples, dicts,
``functools.partial`` and ``Depends``), and mutable data held in the fields of other element kinds (a list
a custom leaf appends to).  Functions, classes, modules and objects whose class says ``__flowvm_code__ = True``
(a ``@flowvm.program`` statement) are code (rebuilt by ``build()``); immutable
constants (numbers, strings, paths, enums, frozen dataclasses, ...) are the program's constants, which a
user may change on resume; the global random generators are part of the environment.

An object's state is, in this order of preference:

- ``{"state_dict": ..., "type": "Adam"}``: anything with ``state_dict()`` and ``load_state_dict()``
  (torch modules, with their parameters' gradients and train/eval flags, optimizers, LR schedulers,
  ``flowvm.Batches``, the bundled programs' classes);
- ``{"numpy_generator": state, "bit_generator": "PCG64"}``, ``{"numpy_random_state": ...}``,
  ``{"python_random": ...}``, ``{"torch_generator": ..., "device": "cpu"}``: random generators;
- ``{"attributes": [[name, value], ...], "type": "Lloyd"}``: any other object, whose attributes must all be
  values a state file holds (or objects of these kinds, or code, or immutable constants: those two are
  kept as the rebuilt program has them).

Anything else (a file handle, a lock, an object with ``__slots__``) is refused with its location.  Loading
restores each state into the object the rebuilt program has at the same location (``load_state_dict``,
``bit_generator.state = ...``, attributes set, arrays and tensors copied into those there).  Objects are made
anew only for generators of a fixed list of kinds and, for an object the run made and left in a register or a
frame (a fitted model a CALL returned: attributes only), of a class the caller of load_state names
(``classes=``): never from a name in the file alone.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import fractions
import functools
import io
import pathlib
import random
import sys
import types
from typing import Any

from ..machine.depends import Depends
from ..program.elements import CALL, Element
from ..program.paths import format_path, walk
from ..program.registers import Register, Registers
from ..base.environment import global_generator_name
from .statevalues import Encoder, Refused, type_name

HINT = ("give its class state_dict() and load_state_dict() (a dict of numbers, strings, arrays and tensors), "
        "or save the run with flowvm.save (a pickle)")
_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, range, slice, type(Ellipsis), pathlib.PurePath,
              enum.Enum, decimal.Decimal, fractions.Fraction, datetime.date, datetime.time, datetime.timedelta,
              frozenset)
_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.MethodWrapperType,
         types.WrapperDescriptorType, types.MethodDescriptorType, types.ClassMethodDescriptorType,
         functools.partial, type, types.ModuleType, staticmethod, classmethod, property)


# ====================================================================== what the elements reach
def roots(program: Element) -> list[tuple[str, Any]]:
    """(location, object) for every object with state that the program's elements reach, in walk order."""
    out: list[tuple[str, Any]] = []
    for path, el in walk(program):
        _fields(el, format_path(path) or "<root>", ":", out)
    return out


def _fields(el: Element, loc: str, sep: str, out: list) -> None:
    strict = isinstance(el, CALL)  # what a CALL reaches must be saved or refused; other kinds' fields are settings
    kids = {id(c) for c in el.children}
    for name, value in el.__dict__.items():
        if name.startswith("_") or name == "scope":
            continue
        if strict and name in ("args", "kwargs"):  # the CALL's own containers: what is in them
            for k, x in (value.items() if isinstance(value, dict) else enumerate(value)):
                _visit(x, f"{loc}{sep}{name}.{k}", strict, kids, out, 1)
        else:
            _visit(value, f"{loc}{sep}{name}", strict, kids, out, 0)


def _visit(v: Any, loc: str, strict: bool, kids: set, out: list, depth: int) -> None:
    if depth > 40 or _inert(v):
        return
    if isinstance(v, Element):
        if id(v) not in kids:  # an element held outside the tree (a FUSED's calls): what it reaches
            _fields(v, loc, ".", out)
        return
    if isinstance(v, (Depends, functools.partial, types.MethodType, types.BuiltinMethodType, types.FunctionType)):
        return _visit_callable(v, loc, strict, kids, out, depth)
    if _is_code(v):
        return
    if isinstance(v, tuple) or type(v) in (list, dict) and not _data(v, 0):
        items = v.items() if type(v) is dict else enumerate(v)  # a tuple's items, each; a list's of more than data
        for k, x in items:
            _visit(x, f"{loc}.{k}" if isinstance(k, (str, int)) else f"{loc}.{k!r:.40}", strict, kids, out, depth + 1)
        return
    if strict or _stateful(v, False):
        out.append((loc, v))


def _is_code(v: Any) -> bool:
    """Code: rebuilt by build(), never a state (a @flowvm.program's statement says so: ``__flowvm_code__``)."""
    return isinstance(v, _CODE) or getattr(type(v), "__flowvm_code__", False)


def _inert(v: Any) -> bool:
    """A value that holds no state of the run: a constant, a register, a global random generator."""
    return is_constant(v) or isinstance(v, (Register, Registers)) or _global(v)


def _visit_callable(v: Any, loc: str, strict: bool, kids: set, out: list, depth: int) -> None:
    """What a Depends, a partial, a method or a function reaches: its arguments, its self."""
    if isinstance(v, Depends):
        return _visit(v.dependency, f"{loc}.dependency", strict, kids, out, depth + 1)
    if isinstance(v, functools.partial):
        _visit(v.func, f"{loc}.func", strict, kids, out, depth + 1)
        for i, x in enumerate(v.args):
            _visit(x, f"{loc}.args.{i}", strict, kids, out, depth + 1)
        for k, x in v.keywords.items():
            _visit(x, f"{loc}.kwargs.{k}", strict, kids, out, depth + 1)
        return
    if isinstance(v, types.MethodType):
        return _visit(v.__self__, f"{loc}.self", strict, kids, out, depth + 1)
    if isinstance(v, types.BuiltinMethodType):  # list.append of a list, a Generator's method: only data
        owner = getattr(v, "__self__", None)
        if owner is not None and not isinstance(owner, (type, types.ModuleType)) and not _global(owner) \
                and _stateful(owner, False):
            out.append((f"{loc}.self", owner))
        return
    owner = _patched_owner(v)  # a function: an optimizer's step wrapped by an LR scheduler
    if owner is not None:
        _visit(owner, f"{loc}.self", strict, kids, out, depth + 1)


def is_constant(v: Any) -> bool:
    """An immutable value of the program (kept as the rebuilt program has it)."""
    if isinstance(v, _CONSTANTS) or (dataclasses.is_dataclass(v) and not isinstance(v, type)
                                     and v.__dataclass_params__.frozen):
        return True
    np = sys.modules.get("numpy")
    if np is not None and isinstance(v, (np.generic, np.dtype)):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, (torch.dtype, torch.device, torch.Size))


def _global(v: Any) -> bool:
    from ..base.environment import global_generator_name

    return global_generator_name(v) is not None


def _data(v: Any, depth: int) -> bool:
    """Whether v is plain data through and through (no element, register, code or object inside)."""
    if depth > 40:
        return False
    if type(v) in (list, tuple, set, frozenset):
        return all(_data(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(_data(k, depth + 1) and _data(x, depth + 1) for k, x in v.items())
    if isinstance(v, (Element, Register, Registers, Depends)) or isinstance(v, _CODE):
        return False
    return is_constant(v) or type(v) is bytearray or array_like(v)


def array_like(v: Any) -> bool:
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    return (np is not None and isinstance(v, np.ndarray)) or (torch is not None and isinstance(v, torch.Tensor))


def _stateful(v: Any, plain: bool) -> bool:
    """Whether v has a state a file holds: data that can change, a generator, an object with state_dict,
    and (with plain) any other object with attributes."""
    if type(v) in (list, dict, set, bytearray) or array_like(v) or generator_kind(v) is not None:
        return True
    if has_state_dict(v):
        return True
    return plain and hasattr(v, "__dict__")


def has_state_dict(v: Any) -> bool:
    t = type(v)
    return callable(getattr(t, "state_dict", None)) and callable(getattr(t, "load_state_dict", None))


def _patched_owner(fn: types.FunctionType) -> Any:
    from .pickler import _reduce_patched_method

    reduced = _reduce_patched_method(fn)
    return reduced[1][0] if reduced is not NotImplemented else None


# ====================================================================== writing
def generator_kind(v: Any) -> str | None:
    t = type(v)
    if isinstance(v, random.Random) and t.getstate is not random.SystemRandom.getstate:
        return "python_random"
    np = sys.modules.get("numpy")
    if np is not None and t is np.random.Generator:
        return "numpy_generator"
    if np is not None and t is np.random.RandomState:
        return "numpy_random_state"
    torch = sys.modules.get("torch")
    if torch is not None and t is torch.Generator:
        return "torch_generator"
    return None


def encode_object(enc: Encoder, v: Any, where: str) -> dict:
    """The node of an object (Encoder's hook for what is not plain data), or Refused."""
    kind = generator_kind(v)
    if kind is not None:
        return _encode_generator(enc, v, kind, where)
    _refuse_unheld(enc, v, where)
    if has_state_dict(v):
        return _encode_state_dict(enc, v, where)
    return _encode_attributes(enc, v, where)


def _refuse_unheld(enc: Encoder, v: Any, where: str) -> None:
    """Refused for code, and for objects where only plain data is held (registers, frames)."""
    if isinstance(v, _CODE):
        name = getattr(v, "__qualname__", None) or getattr(v, "__name__", None) or type_name(v)
        kind = "a class" if isinstance(v, type) else "a module" if isinstance(v, types.ModuleType) else "a function"
        raise Refused(where, f"{kind} ({name})", "a state file holds no code: keep functions in the program (a "
                      "CALL's fn or arguments, which build() makes again), or hold an object whose class has "
                      "state_dict() and load_state_dict() instead")
    if not enc.objects_allowed and (has_state_dict(v) or not plain_object(v)):
        raise Refused(where, f"a {type_name(v)}",
                      "registers and a run's frames hold plain data (None, bools, numbers, strings, bytes, "
                      "arrays, tensors, and lists, tuples, dicts and sets of these), random generators and "
                      "objects whose attributes are such data; an object with state_dict() is restored into the "
                      "one the rebuilt program has, so it must be a register's own value (Registers(model=net)) "
                      "or be reached by a CALL (its fn, the self of its method, or an argument)")


def _encode_attributes(enc: Encoder, v: Any, where: str) -> dict:
    """An object whose state is its attributes (code and constants are kept as the rebuilt program has them)."""
    if not plain_object(v):
        what = "a file handle" if isinstance(v, io.IOBase) else "an object with __slots__" \
            if hasattr(v, "__dict__") and not isinstance(v, _CODE) else "an object without attributes"
        raise Refused(where, f"{what} ({type_name(v)})", HINT)
    node: dict = {"attributes": None, "type": type(v).__qualname__}
    enc.remember(v, node)
    attrs = []
    for name, x in vars(v).items():
        if isinstance(x, _CODE) or (is_constant(x) and not isinstance(x, (type(None), bool, int, float, complex,
                                                                            str, bytes, frozenset))):
            continue  # code and constants: as the rebuilt program has them
        attrs.append([name, enc.value(x, f"{where}/{name}")])
    node["attributes"] = attrs
    return node


def _encode_generator(enc: Encoder, v: Any, kind: str, where: str) -> dict:
    node: dict = {kind: None}
    enc.remember(v, node)
    if kind == "numpy_generator":
        node["bit_generator"] = type(v.bit_generator).__name__
        node[kind] = enc.value(v.bit_generator.state, f"{where}/state")
    elif kind == "numpy_random_state":
        node[kind] = enc.value(v.get_state(legacy=False), f"{where}/state")
    elif kind == "python_random":
        node[kind] = enc.value(v.getstate(), f"{where}/state")
    else:
        node[kind] = enc.value(bytes(v.get_state().numpy()), f"{where}/state")
        node["device"] = str(v.device)
    return node


def _encode_state_dict(enc: Encoder, v: Any, where: str) -> dict:
    """An object with state_dict(): its state, and a torch module's gradients and train/eval flags."""
    node: dict = {"state_dict": None, "type": type(v).__qualname__}
    enc.remember(v, node)
    try:
        state = v.state_dict()
    except Exception as err:
        raise Refused(where, f"a {type_name(v)} whose state_dict() raised {type(err).__name__}: {err}") from err
    allowed, enc.objects_allowed = enc.objects_allowed, False
    try:
        node["state_dict"] = enc.value(state, f"{where}/state_dict")
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(v, torch.nn.Module):
            grads = {n: p.grad for n, p in v.named_parameters() if p.grad is not None}
            if grads:
                node["grads"] = enc.value(grads, f"{where}/grad")
            node["training"] = [[n, m.training] for n, m in v.named_modules()]
    finally:
        enc.objects_allowed = allowed
    return node


def plain_object(v: Any) -> bool:
    """Whether v is an object whose state is its attributes (no file handle, no __slots__, not code)."""
    return not (isinstance(v, (io.IOBase, Element)) or isinstance(v, _CODE) or not hasattr(v, "__dict__")
                or any(s not in ("__dict__", "__weakref__") for c in type(v).__mro__ for s in _slots(c)))


def _slots(cls: type) -> tuple:
    s = cls.__dict__.get("__slots__", ())
    return (s,) if isinstance(s, str) else tuple(s)
