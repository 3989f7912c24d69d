"""The objects a program's elements reach, and their states in a state checkpoint (flowvm.persist.state).

``roots(program)`` lists ``(location, object)`` for every object with state that the elements reach, in
walk order: a CALL's ``fn`` when it is an object, the ``self`` of a bound method (``"0.1:fn.self"``), the
objects among its arguments (``"0.1:args.0"``, ``"0.1:kwargs.model"``, inside lists, tuples, dicts,
``functools.partial`` and ``Depends``), and mutable data held in the fields of other element kinds (a list
a custom leaf appends to).  Functions, classes and modules are code (rebuilt by ``build()``); immutable
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

from ..base.errors import CheckpointError
from ..machine.depends import Depends
from ..program.elements import CALL, Element
from ..program.paths import format_path, walk
from ..program.registers import Register, Registers
from ..base.environment import global_generator_name
from .statedecoder import Decoder, device_name
from .statevalues import MISSING, Encoder, Refused, type_name

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
    if depth > 40 or is_constant(v) or isinstance(v, (Register, Registers)) or _global(v):
        return
    if isinstance(v, Element):
        if id(v) not in kids:  # an element held outside the tree (a FUSED's calls): what it reaches
            _fields(v, loc, ".", out)
        return
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
    if isinstance(v, types.FunctionType):
        owner = _patched_owner(v)  # an optimizer's step wrapped by an LR scheduler
        if owner is not None:
            _visit(owner, f"{loc}.self", strict, kids, out, depth + 1)
        return
    if isinstance(v, _CODE):
        return
    if isinstance(v, tuple):
        for i, x in enumerate(v):
            _visit(x, f"{loc}.{i}", strict, kids, out, depth + 1)
        return
    if type(v) in (list, dict) and not _data(v, 0):
        items = v.items() if type(v) is dict else enumerate(v)
        for k, x in items:
            _visit(x, f"{loc}.{k}" if isinstance(k, (str, int)) else f"{loc}.{k!r:.40}", strict, kids, out, depth + 1)
        return
    if strict or _stateful(v, False):
        out.append((loc, v))


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
    return is_constant(v) or type(v) is bytearray or _array_like(v)


def _array_like(v: Any) -> bool:
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    return (np is not None and isinstance(v, np.ndarray)) or (torch is not None and isinstance(v, torch.Tensor))


def _stateful(v: Any, plain: bool) -> bool:
    """Whether v has a state a file holds: data that can change, a generator, an object with state_dict,
    and (with plain) any other object with attributes."""
    if type(v) in (list, dict, set, bytearray) or _array_like(v) or _generator_kind(v) is not None:
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
def _generator_kind(v: Any) -> str | None:
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
    kind = _generator_kind(v)
    if kind is not None:
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
    if isinstance(v, _CODE):
        name = getattr(v, "__qualname__", None) or getattr(v, "__name__", None) or type_name(v)
        kind = "a class" if isinstance(v, type) else "a module" if isinstance(v, types.ModuleType) else "a function"
        raise Refused(where, f"{kind} ({name})", "a state file holds no code: keep functions in the program (a "
                      "CALL's fn or arguments, which build() makes again), or hold an object whose class has "
                      "state_dict() and load_state_dict() instead")
    if not enc.objects_allowed and (has_state_dict(v) or not _plain(v)):
        raise Refused(where, f"a {type_name(v)}",
                      "registers and a run's frames hold plain data (None, bools, numbers, strings, bytes, "
                      "arrays, tensors, and lists, tuples, dicts and sets of these), random generators and "
                      "objects whose attributes are such data; an object with state_dict() is restored into the "
                      "one the rebuilt program has, so it must be reached by a CALL (its fn, the self of its "
                      "method, or an argument)")
    if has_state_dict(v):
        node = {"state_dict": None, "type": type(v).__qualname__}
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
    if not _plain(v):
        what = "a file handle" if isinstance(v, io.IOBase) else "an object with __slots__" \
            if hasattr(v, "__dict__") and not isinstance(v, _CODE) else "an object without attributes"
        raise Refused(where, f"{what} ({type_name(v)})", HINT)
    node = {"attributes": None, "type": type(v).__qualname__}
    enc.remember(v, node)
    attrs = []
    for name, x in vars(v).items():
        if isinstance(x, _CODE) or (is_constant(x) and not isinstance(x, (type(None), bool, int, float, complex,
                                                                            str, bytes, frozenset))):
            continue  # code and constants: as the rebuilt program has them
        attrs.append([name, enc.value(x, f"{where}/{name}")])
    node["attributes"] = attrs
    return node


def _plain(v: Any) -> bool:
    """Whether v is an object whose state is its attributes (no file handle, no __slots__, not code)."""
    return not (isinstance(v, (io.IOBase, Element)) or isinstance(v, _CODE) or not hasattr(v, "__dict__")
                or any(s not in ("__dict__", "__weakref__") for c in type(v).__mro__ for s in _slots(c)))


def _slots(cls: type) -> tuple:
    s = cls.__dict__.get("__slots__", ())
    return (s,) if isinstance(s, str) else tuple(s)


# ====================================================================== reading
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


def restore_object(dec: Decoder, have: Any, node: dict, where: str) -> Any:
    """Decoder's hook: the state of node restored into have (the rebuilt program's object), returned."""
    kind = next((k for k in ("numpy_generator", "numpy_random_state", "python_random", "torch_generator",
                             "state_dict", "attributes") if k in node), None)
    if kind is None:
        raise dec.error(where, f"malformed node with keys {sorted(node)[:4]}")
    state = node[kind]
    if kind in ("state_dict", "attributes"):
        return _restore_into(dec, have, node, kind, where)
    if _generator_kind(have) != kind:
        have = _new_generator(dec, kind, node, where)
    dec.keep(node, have)
    state = dec.value(state, f"{where}/state")
    try:
        if kind == "numpy_generator":
            have.bit_generator.state = state
        elif kind == "numpy_random_state":
            have.set_state(state)
        elif kind == "python_random":
            version, internal, gauss = state
            have.setstate((version, tuple(internal), gauss))
        else:
            import torch

            have.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except Exception as err:
        raise dec.error(where, f"the saved state does not fit the generator here ({type(err).__name__}: {err})") \
            from None
    return have


def _new_generator(dec: Decoder, kind: str, node: dict, where: str) -> Any:
    if kind == "python_random":
        return random.Random()
    if kind == "torch_generator":
        import torch

        try:
            return torch.Generator(device=torch.device(device_name(node.get("device", "cpu"))))
        except (ValueError, RuntimeError) as err:
            raise dec.error(where, f"a torch generator on {node.get('device')!r:.40}, which this process cannot "
                                   f"make ({str(err).strip()[:120]})") from None
    import numpy as np

    if kind == "numpy_random_state":
        return np.random.RandomState()
    name = node.get("bit_generator")
    if name not in _BIT_GENERATORS:
        raise dec.error(where, f"unknown numpy bit generator {name!r:.40}")
    return np.random.Generator({"PCG64": np.random.PCG64, "PCG64DXSM": np.random.PCG64DXSM,
                                "MT19937": np.random.MT19937, "Philox": np.random.Philox,
                                "SFC64": np.random.SFC64}[name]())


def _restore_into(dec: Decoder, have: Any, node: dict, kind: str, where: str) -> Any:
    saved = node.get("type")
    if type(saved) is not str:
        raise dec.error(where, "malformed object node")
    if kind == "attributes" and (have is MISSING or type(have).__qualname__ != saved or not _plain(have)):
        cls = (dec.classes or {}).get(saved)  # an object the run made (a result): of a class the caller names
        if cls is None:
            here = "does not have" if have is MISSING else f"has a {type_name(have)} there"
            raise dec.error(where, f"the saved run holds a {saved} here, which the rebuilt program {here}; to "
                                   f"rebuild it from its attributes, name its class: load_state(..., "
                                   f"classes=[{saved}]) (a state file makes objects of the classes you name only)")
        try:
            have = cls.__new__(cls)
        except Exception as err:
            raise dec.error(where, f"cannot make a {saved} without its constructor ({type(err).__name__}: "
                                   f"{err})") from None
    if have is MISSING or not has_state_dict(have) and kind == "state_dict":
        here = "nothing" if have is MISSING else f"a {type_name(have)} without load_state_dict()"
        raise dec.error(where, f"the saved run has a {saved} here; the rebuilt program has {here} to restore it into")
    if type(have).__qualname__ != saved:
        raise dec.error(where, f"the saved run has a {saved} here; the rebuilt program has a {type_name(have)}")
    dec.keep(node, have)
    if kind == "attributes":
        _restore_attributes(dec, have, node["attributes"], where)
        return have
    state = dec.value(node["state_dict"], f"{where}/state_dict")
    try:
        have.load_state_dict(state)
    except Exception as err:
        raise dec.error(where, f"{saved}.load_state_dict refused the saved state ({type(err).__name__}: "
                               f"{str(err).strip()[:300]})") from None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(have, torch.nn.Module):
        grads = dec.value(node["grads"], f"{where}/grad") if "grads" in node else {}
        for name, p in have.named_parameters():
            g = grads.get(name)
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype)
        flags = dict((n, f) for n, f in node.get("training", []) if type(f) is bool)
        for name, m in have.named_modules():
            if name in flags:
                m.training = flags[name]
    return have


def _restore_attributes(dec: Decoder, have: Any, pairs: Any, where: str) -> None:
    """Set the saved attributes on have: never one its class defines (a method, a property: the file
    would shadow the object's code), and, where have already holds the attribute, only a value of the same
    kind (an array stays an array, an object's own generator is not swapped for a global one)."""
    if type(pairs) is not list:
        raise dec.error(where, "malformed attributes")
    cls = type(have)
    for pair in pairs:
        if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not str or not pair[0].isidentifier() \
                or pair[0].startswith("__"):
            raise dec.error(where, f"malformed attribute {pair!r:.60}")
        name, x = pair
        old = have.__dict__.get(name, MISSING)
        if old is MISSING and hasattr(cls, name):
            raise dec.error(f"{where}/{name}", f"the file sets {name!r} on a {type_name(have)}, whose class "
                                               f"defines it ({type_name(getattr(cls, name, None))}): refused")
        value = dec.restore(old, x, f"{where}/{name}")
        if old is not MISSING and not _same_kind(old, value):
            raise dec.error(f"{where}/{name}", f"the file puts a {type_name(value)} where the rebuilt program's "
                                               f"{type_name(have)} holds a {type_name(old)}")
        have.__dict__[name] = value


def _same_kind(old: Any, new: Any) -> bool:
    """Whether an attribute may go from old (the rebuilt program's) to new (the file's)."""
    import numbers

    if old is None or new is None or type(old) is type(new):
        return global_generator_name(new) is None or global_generator_name(old) is not None
    plain_number = (lambda v: isinstance(v, numbers.Number) and type(v) is not bool and not _array_like(v))
    return plain_number(old) and plain_number(new)


def check_program_objects(dec: Decoder, saved: list, program: Element, path: Any) -> None:
    """Restore the saved objects' states into the program's own, location by location (see roots)."""
    here = dict(roots(program))
    for item in saved:
        if type(item) is not list or len(item) != 2 or type(item[0]) is not str:
            raise CheckpointError(path, "malformed: the objects table cannot be read")
        loc, node = item
        where = f"objects/{loc}"
        have = here.get(loc, MISSING)
        if type(node) is dict and "ref" in node:
            shared = dec.value(node, where)
            if have is not MISSING and have is not shared:
                raise CheckpointError(path, f"{where}: the saved run used one object here and at an earlier "
                                            "location; the rebuilt program has two different objects")
            continue
        if have is MISSING:
            if type(node) is dict and any(k in node for k in ("state_dict", "attributes")):
                raise CheckpointError(path, f"{where}: the saved run has a {node.get('type')} here, which the "
                                            "rebuilt program does not reach")
            dec.value(node, where)  # data the rebuilt program no longer holds here: only its references count
            continue
        got = dec.restore(have, node, where)
        if got is not have:
            raise CheckpointError(path, f"{where}: the saved state does not fit the rebuilt program's "
                                        f"{type_name(have)} here ({_shape(have)} vs {_shape(got)})")


def _shape(v: Any) -> str:
    shape = getattr(v, "shape", None)
    return f"{type_name(v)} of shape {tuple(shape)} and dtype {v.dtype}" if shape is not None else type_name(v)
