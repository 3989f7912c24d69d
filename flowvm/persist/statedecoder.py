"""Reading the values of a state checkpoint back (the node grammar is in flowvm.persist.statevalues).

``Decoder.restore(have, node, where)`` turns a node back into a value, into ``have`` in place where it can
(an array or tensor of the same shape and dtype, a list, a dict, an object: see flowvm.persist.stateobjects);
``Decoder.value(node, where)`` makes a new one.  Nothing is imported, looked up by a name from the file or
called, but the few constructors of plain values, numpy and torch: dtypes and global generators are found in
fixed tables, and objects go to the ``objects`` hook.
"""

from __future__ import annotations

import base64
import re
import warnings
from collections import OrderedDict
from typing import Any, Callable

from ..base.errors import CheckpointError, CopyWarning
from ..base.environment import global_generator
from .statevalues import _GLOBALS, MISSING, _float_value, _step, numpy_dtype, torch_dtypes

class Decoder:
    """JSON nodes back to values.  ``tensors``: name -> the loaded (checked, owned) tensor or array;
    ``objects``: how object nodes are restored (flowvm.persist.stateobjects), given the value to restore
    into (MISSING: none); ``classes``: the classes whose objects it may make (by ``__qualname__``)."""

    def __init__(self, table: dict, tensors: dict, path: Any, objects: Callable | None = None,
                 classes: dict | None = None):
        self.table, self.tensors, self.path, self.objects = table, tensors, path, objects
        self.classes = classes  # qualified name -> a class the caller allows objects of to be made
        self.memo: dict[int, Any] = {}
        self._used: set[str] = set()
        self._moved: set[str] = set()

    def error(self, where: str, reason: str) -> CheckpointError:
        return CheckpointError(self.path, f"{where}: {reason}")

    def value(self, node: Any, where: str) -> Any:
        return self.restore(MISSING, node, where)

    def keep(self, node: dict, value: Any) -> Any:
        n = node.get("id")
        if n is not None:
            if type(n) is not int or n in self.memo:
                raise self.error(where="<state>", reason=f"malformed: bad node id {n!r:.20}")
            self.memo[n] = value
        return value

    def restore(self, have: Any, node: Any, where: str) -> Any:
        t = type(node)
        if node is None or t is bool or t is str or t is int:
            return node
        if t is float:
            return node
        if t is list:
            return self._list(have, node, None, where)
        if t is not dict or not node:
            raise self.error(where, f"malformed node {node!r:.60}")
        try:
            return self._tagged(have, node, where)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, RuntimeError,
                ArithmeticError) as err:  # (torch raises RuntimeError for what it refuses)
            raise self.error(where, f"malformed node ({type(err).__name__}: {str(err)[:200]})") from None
        except RecursionError:
            raise self.error(where, "malformed: values nested too deeply") from None

    def _tagged(self, have: Any, node: dict, where: str) -> Any:
        for tag, decode in _TAGGED:  # in this order: a node with two tags is read by the first
            if tag in node:
                return decode(self, have, node, where)
        if self.objects is None:
            raise self.error(where, f"malformed node with keys {sorted(node)[:4]}")
        return self.objects(self, have, node, where)

    def _ref(self, have: Any, node: dict, where: str) -> Any:
        n = node["ref"]
        if type(n) is not int or n not in self.memo:
            raise self.error(where, f"malformed: a reference to an unknown value ({n!r:.20})")
        return self.memo[n]

    def _tuple(self, have: Any, node: dict, where: str) -> tuple:
        items = node["tuple"]
        like = have if type(have) is tuple and len(have) == len(items) else None
        return tuple(self.restore(like[i] if like else MISSING, x, _step(where, i)) for i, x in enumerate(items))

    def _set(self, have: Any, node: dict, where: str) -> set:
        value = self.keep(node, set())
        value.update(self.value(x, where) for x in node["set"])
        return value

    def _complex(self, have: Any, node: dict, where: str) -> complex:
        re_, im = (self.value(x, where) for x in node["complex"])
        return complex(float(re_), float(im))

    def _numpy_scalar(self, have: Any, node: dict, where: str) -> Any:
        import numpy as np

        dtype = numpy_dtype(node["numpy_scalar"])
        data = bytes.fromhex(_checked_str(node["hex"]))
        return np.frombuffer(data, dtype=dtype, count=1)[0].copy() if len(data) == dtype.itemsize \
            else _bad(f"{len(data)} bytes for a {dtype} scalar")

    def _torch_dtype(self, have: Any, node: dict, where: str) -> Any:
        dtypes = torch_dtypes()
        name = node["torch_dtype"]
        if name not in dtypes:
            raise self.error(where, f"unknown torch dtype {name!r:.40}")
        return dtypes[name]

    def _global_generator(self, have: Any, node: dict, where: str) -> Any:
        name = node["global_generator"]
        if name not in _GLOBALS:
            raise self.error(where, f"unknown global generator {name!r:.40}")
        return global_generator(name)

    def _list(self, have: Any, items: Any, node: dict | None, where: str) -> list:
        if type(items) is not list:
            raise self.error(where, "malformed list")
        value = have if type(have) is list else []
        if node is not None:
            self.keep(node, value)
        new = [self.restore(value[i] if i < len(value) and value is have else MISSING, x, _step(where, i))
               for i, x in enumerate(items)]
        value[:] = new
        return value

    def _dict(self, have: Any, node: dict, where: str) -> dict:
        kind = OrderedDict if node.get("ordered") is True or "torch_metadata" in node else dict
        value = have if type(have) is kind else kind()
        self.keep(node, value)
        pairs = node["dict"]
        if type(pairs) is not list:
            raise self.error(where, "malformed dict")
        new = []
        for pair in pairs:
            k, v = pair
            key = self.value(k, f"{where} (a key)")
            old = value.get(key, MISSING) if value is have else MISSING
            new.append((key, self.restore(old, v, _step(where, key))))
        value.clear()
        value.update(new)
        if "torch_metadata" in node:
            value._metadata = self.value(node["torch_metadata"], f"{where}/_metadata")
        return value

    def _loaded(self, name: Any, where: str) -> tuple[Any, dict]:
        if type(name) is not str or name not in self.tensors:
            raise self.error(where, f"names a tensor the file does not hold ({name!r:.60})")
        return self.tensors[name], self.table[name]

    def _array(self, have: Any, node: dict, where: str) -> Any:
        import numpy as np

        base, info = self._loaded(node["ndarray"], where)
        if info["kind"] != "numpy":
            raise self.error(where, f"tensor {node['ndarray']!r} is not a numpy array")
        if isinstance(have, np.ndarray) and type(have) is np.ndarray and have.shape == base.shape \
                and have.dtype == base.dtype and have.flags.writeable:
            np.copyto(have, base)
            return self.keep(node, have)
        first = node["ndarray"] not in self._used
        self._used.add(node["ndarray"])
        return self.keep(node, base if first else base.view())

    def _tensor(self, have: Any, node: dict, where: str) -> Any:
        import torch

        name = node["tensor"]
        base, info = self._loaded(name, where)
        if info["kind"] != "torch":
            raise self.error(where, f"tensor {name!r} is not a torch tensor")
        requires_grad = node.get("requires_grad", False) is True
        grad = node.get("grad")
        if isinstance(have, torch.Tensor) and have.shape == base.shape and have.dtype == base.dtype:
            self.keep(node, have)
            with torch.no_grad():
                have.copy_(base)
            if have.is_leaf:
                have.requires_grad_(requires_grad)
                have.grad = None if grad is None else self._grad_for(have, grad, where)
            return have
        first = name not in self._used
        self._used.add(name)
        value = base if first else base.view(base.shape)
        device = device_name(node.get("device", "cpu"))
        if device != "cpu":
            value = self._to_device(value, device, name)
        if node.get("parameter") is True:
            value = torch.nn.Parameter(value, requires_grad=requires_grad)
        elif requires_grad:
            value.requires_grad_(True)
        self.keep(node, value)
        if grad is not None:
            value.grad = self._grad_for(value, grad, where)
        return value

    def _grad_for(self, t: Any, node: Any, where: str) -> Any:
        g = self.value(node, f"{where}/grad")
        return g.to(t.device) if g.device != t.device else g

    def _to_device(self, value: Any, device: str, name: str) -> Any:
        import torch

        try:
            target = torch.device(device)
            if target.type == "cuda" and (not torch.cuda.is_available() or (target.index or 0) >= torch.cuda.device_count()):
                raise RuntimeError("not available")
            return value.to(target)
        except Exception:
            if device not in self._moved:
                self._moved.add(device)
                warnings.warn(f"flowvm: the state file {self.path} holds tensors saved on {device}, which this "
                              f"process does not have; they are loaded on the CPU", CopyWarning, stacklevel=4)
            return value


_DEVICE = re.compile(r"(cpu|cuda|mps|xpu)(:[0-9]{1,4})?")


def device_name(value: Any) -> str:
    """A device a file names, if it is one a run's tensors can be on (never "meta": no data)."""
    if type(value) is not str or _DEVICE.fullmatch(value) is None:
        raise ValueError(f"not a device a state file may name: {value!r:.40}")
    return value


def _checked_str(value: Any, limit: int = 1 << 31) -> str:
    if type(value) is not str or len(value) > limit:
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _bad(reason: str):
    raise ValueError(reason)


def _torch_device(dec: Decoder, have: Any, node: dict, where: str) -> Any:
    import torch

    return torch.device(device_name(node["torch_device"]))


def _torch_size(dec: Decoder, have: Any, node: dict, where: str) -> Any:
    import torch

    return torch.Size([int(x) for x in node["torch_size"]])


# a tagged node's tags, in the order they are looked for, and how each is read
_TAGGED = (
    ("ref", Decoder._ref),
    ("list", lambda dec, have, node, where: dec._list(have, node["list"], node, where)),
    ("dict", lambda dec, have, node, where: dec._dict(have, node, where)),
    ("tuple", Decoder._tuple),
    ("int", lambda dec, have, node, where: int(_checked_str(node["int"], 5000))),
    ("float", lambda dec, have, node, where: _float_value(node["float"])),
    ("set", Decoder._set),
    ("frozenset", lambda dec, have, node, where: frozenset(dec.value(x, where) for x in node["frozenset"])),
    ("bytes", lambda dec, have, node, where: base64.b64decode(_checked_str(node["bytes"]), validate=True)),
    ("bytearray", lambda dec, have, node, where: dec.keep(
        node, bytearray(base64.b64decode(_checked_str(node["bytearray"]), validate=True)))),
    ("complex", Decoder._complex),
    ("ndarray", lambda dec, have, node, where: dec._array(have, node, where)),
    ("numpy_scalar", Decoder._numpy_scalar),
    ("tensor", lambda dec, have, node, where: dec._tensor(have, node, where)),
    ("torch_dtype", Decoder._torch_dtype),
    ("torch_device", _torch_device),
    ("torch_size", _torch_size),
    ("global_generator", Decoder._global_generator),
)
