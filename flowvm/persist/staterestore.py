"""Restoring the objects of a state checkpoint (flowvm.persist.state) into those the rebuilt program has: the
reading half of flowvm.persist.stateobjects, whose docstring says what each object's state is.  A state goes
into the object the program has at the same location (``load_state_dict``, ``bit_generator.state = ...``,
attributes set, arrays and tensors copied into those there); objects are made anew only for generators of a
fixed list of kinds and for classes the caller of load_state names (``classes=``), never from a name in the
file alone."""

from __future__ import annotations

import numbers
import random
import sys
from typing import Any

from ..base.errors import CheckpointError
from ..program.elements import Element
from .statedecoder import Decoder, device_name
from ..base.environment import global_generator_name
from .stateobjects import array_like, generator_kind, has_state_dict, plain_object, roots
from .statevalues import MISSING, type_name

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
    if generator_kind(have) != kind:
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
    if kind == "attributes" and (have is MISSING or type(have).__qualname__ != saved or not plain_object(have)):
        have = _made(dec, have, saved, where)
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
        _restore_module_flags(dec, have, node, where)
    return have


def _made(dec: Decoder, have: Any, saved: str, where: str) -> Any:
    """An object the run made (a result), made anew: of a class the caller names (classes=), else refused."""
    cls = (dec.classes or {}).get(saved)
    if cls is None:
        here = "does not have" if have is MISSING else f"has a {type_name(have)} there"
        raise dec.error(where, f"the saved run holds a {saved} here, which the rebuilt program {here}; to "
                               f"rebuild it from its attributes, name its class: load_state(..., "
                               f"classes=[{saved}]) (a state file makes objects of the classes you name only)")
    try:
        return cls.__new__(cls)
    except Exception as err:
        raise dec.error(where, f"cannot make a {saved} without its constructor ({type(err).__name__}: "
                               f"{err})") from None


def _restore_module_flags(dec: Decoder, module: Any, node: dict, where: str) -> None:
    """A torch module's gradients and train/eval flags, as saved."""
    grads = dec.value(node["grads"], f"{where}/grad") if "grads" in node else {}
    for name, p in module.named_parameters():
        g = grads.get(name)
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype)
    flags = dict((n, f) for n, f in node.get("training", []) if type(f) is bool)
    for name, m in module.named_modules():
        if name in flags:
            m.training = flags[name]


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
    plain_number = (lambda v: isinstance(v, numbers.Number) and type(v) is not bool and not array_like(v))
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
