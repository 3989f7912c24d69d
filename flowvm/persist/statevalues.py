"""The values of a state checkpoint (flowvm.persist.state): plain data as JSON, every tensor and numpy
array as a safetensors tensor.

``Encoder.value(v, where)`` turns a value into a JSON node and puts its tensors and arrays in
``Encoder.table`` (name -> dtype, shape, ...) and ``Encoder.data`` (name -> the tensor or array written);
``flowvm.persist.statedecoder.Decoder`` turns nodes back into values.  ``where`` names the place in words and
paths (``registers/history/3``): in refusals, in errors, and as the tensors' names in the file.

A node is JSON: ``null``, ``true``/``false``, a string, an int of at most 2**53 in size, a finite float,
an array (a list), or an object with one tag key (and ``"id"`` when the value is referred to again)::

    {"int": "123456789012345678901"}      {"float": "nan" | "inf" | "-inf" | "bits:7ff8000000000001"}
    {"tuple": [...]}   {"list": [...], "id": 3}   {"dict": [[key, value], ...]}   {"set": [...]}
    {"frozenset": [...]}   {"bytes": "<base64>"}   {"bytearray": "<base64>"}   {"complex": [re, im]}
    {"ndarray": "registers/x"}   {"numpy_scalar": "<f8", "hex": "000000000000f83f"}
    {"tensor": "registers/w", "device": "cpu", "requires_grad": true, "grad": {...}, "parameter": true}
    {"torch_dtype": "float32"}   {"torch_device": "cuda:0"}   {"torch_size": [2, 3]}
    {"global_generator": "numpy"}   {"ref": 3}   and the objects' nodes (flowvm.persist.stateobjects)

The tensor table gives each tensor's ``kind`` ("numpy" or "torch"), ``dtype`` (numpy's ``dtype.str``, or
torch's name), ``shape``, and ``raw: true`` when safetensors has no such dtype and the file holds the bytes as
a uint8 vector (complex128, strings, big-endian arrays, ...); ``order: "F"`` restores a Fortran-ordered
array.  Two nodes naming one tensor are views of one piece of memory (a module's weights reached twice).

Decoding never imports, looks up or calls anything a file names: dtypes and generator kinds are looked up
in fixed tables, object type names are only compared and printed.
"""

from __future__ import annotations

import base64
import bisect
import math
import re
import struct
import sys
from collections import OrderedDict
from typing import Any, Callable

from ..base.autograd import holds_live_graph
from ..base.environment import global_generator_name
from ..base.errors import Refused


MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()  # no counterpart to restore into
BIG = 2 ** 53  # ints beyond this are written as strings: JSON readers in other languages keep them exact

# what safetensors stores as it is; any other dtype is written raw (its bytes as a uint8 vector)
SAFE_NUMPY = {"|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8", "<c8"}
SAFE_TORCH = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
              "bfloat16", "float32", "float64", "complex64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
              "float8_e5m2fnuz")
TORCH_DTYPES = SAFE_TORCH + ("complex128", "complex32", "float8_e8m0fnu", "qint8", "quint8", "qint32")
# numpy dtypes a file may name (checked before numpy parses them): no objects, no structured dtypes
_NUMPY_DTYPE = re.compile(r"[<>|=]?(b1|[iu][1248]|f(2|4|8|12|16)|c(8|16|24|32)|[US]\d{1,9}|[mM]8(\[\d{0,9}[a-zA-Z]{1,2}\])?)")
_GLOBALS = ("random", "numpy", "torch")
_CONSTANT_NODES = ("int", "float", "bytes", "complex", "numpy_scalar", "torch_dtype", "torch_device", "torch_size",
                   "global_generator", "tuple", "frozenset")


def type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ in ("builtins", None) else f"{t.__module__}.{t.__qualname__}"


def _torch():
    return sys.modules.get("torch")


def torch_dtypes() -> dict:
    """torch's dtypes by name (from the fixed list above; a name this torch lacks is left out)."""
    torch = _torch()
    return {} if torch is None else {n: getattr(torch, n) for n in TORCH_DTYPES if hasattr(torch, n)}


def numpy_dtype(text: Any, where: str = "") -> Any:
    import numpy as np

    if not isinstance(text, str) or _NUMPY_DTYPE.fullmatch(text) is None:
        raise ValueError(f"not a numpy dtype this format allows: {text!r:.40}")
    return np.dtype(text)


def _float_text(x: float) -> str:
    if x != x:
        bits = struct.pack(">d", x).hex()
        return "nan" if bits == "7ff8000000000000" else f"bits:{bits}"
    return "inf" if x > 0 else "-inf"


def _float_value(text: str) -> float:
    if text in ("nan", "inf", "-inf"):
        return float(text)
    if text.startswith("bits:") and len(text) == 21:
        return struct.unpack(">d", bytes.fromhex(text[5:]))[0]
    raise ValueError(f"bad float {text!r:.40}")


def _step(where: str, key: Any) -> str:
    text = key if isinstance(key, str) else str(key) if type(key) in (int, bool) or key is None else repr(key)
    return f"{where}/{text[:60]}"


# ====================================================================== writing
class Encoder:
    """Values to JSON nodes, tensors and arrays to the tensor table; shared and cyclic containers once.

    ``objects(encoder, value, where)`` encodes what is not plain data (flowvm.persist.stateobjects), or
    raises Refused; while ``objects_allowed`` is False (registers, frames) only objects already met elsewhere
    (as references) and generators are taken."""

    def __init__(self, objects: Callable[["Encoder", Any, str], dict] | None = None):
        self.objects = objects
        self.objects_allowed = True
        self.table: dict[str, dict] = {}
        self.data: dict[str, Any] = {}
        self._ids: dict[int, list] = {}  # id(value) -> [node, node id or None]
        self._keep: list = []  # values whose ids are in use
        self._lists: dict[int, int] = {}  # id(first node of a list met again) -> its node id
        self._views: dict[tuple, str] = {}  # the memory a tensor or array views -> its name
        self._starts: list[int] = []  # the memory written so far, as sorted disjoint ranges [start, end)
        self._ends: list[int] = []
        self.next_id = 0
        self.graphs: list[str] = []  # where tensors with a live autograd graph were met (flowvm.base.autograd)

    # -- references
    def remember(self, value: Any, node: Any) -> None:
        self._ids[id(value)] = [node, None]
        self._keep.append(value)

    def _ref(self, value: Any) -> dict:
        entry = self._ids[id(value)]
        if entry[1] is None:
            entry[1] = self.next_id
            self.next_id += 1
            if isinstance(entry[0], list):
                self._lists[id(entry[0])] = entry[1]
            else:
                entry[0]["id"] = entry[1]
        return {"ref": entry[1]}

    def seen(self, value: Any) -> bool:
        return id(value) in self._ids

    def finish(self, document: Any) -> Any:
        """The document with the first node of every list met again marked with its id."""
        if not self._lists:
            return document

        def fix(node):
            if isinstance(node, list):
                items = [fix(x) for x in node]
                n = self._lists.get(id(node))
                if n is not None:
                    node[:] = items
                    return {"list": node, "id": n}
                node[:] = items
                return node
            if isinstance(node, dict):
                for k, v in node.items():
                    node[k] = fix(v)
            return node

        return fix(document)

    # -- values
    def value(self, v: Any, where: str) -> Any:
        t = type(v)
        if v is None or t is bool or t is str:
            return v
        if t is int:
            return v if -BIG <= v <= BIG else {"int": str(v)}
        if t is float:
            return v if math.isfinite(v) else {"float": _float_text(v)}
        if id(v) in self._ids:
            return self._ref(v)
        plain = _PLAIN.get(t)
        if plain is not None:
            return plain(self, v, where)
        node = self._library_value(v, t, where)
        if node is not None:
            return node
        name = global_generator_name(v)
        if name is not None:
            return {"global_generator": name}
        if self.objects is None:
            raise Refused(where, f"a {type_name(v)}")
        return self.objects(self, v, where)

    def _list(self, v: list, where: str) -> list:
        node: list = []
        self.remember(v, node)
        node.extend(self.value(x, _step(where, i)) for i, x in enumerate(v))
        return node

    def _tuple(self, v: tuple, where: str) -> dict:
        return {"tuple": [self.value(x, _step(where, i)) for i, x in enumerate(v)]}

    def _dict(self, v: dict, where: str) -> dict:
        node: dict = {"dict": None}
        self.remember(v, node)
        node["dict"] = [[self.value(k, f"{where} (a key)"), self.value(x, _step(where, k))] for k, x in v.items()]
        meta = getattr(v, "_metadata", None)  # torch's state_dict versions
        if type(v) is OrderedDict:
            node["ordered"] = True
        if type(meta) is dict:
            node["torch_metadata"] = self.value(meta, f"{where}/_metadata")
        return node

    def _set(self, v: set | frozenset, where: str) -> dict:
        items = [self.value(x, _step(where, i)) for i, x in enumerate(v)]
        if type(v) is frozenset:
            return {"frozenset": items}
        node = {"set": items}
        self.remember(v, node)
        return node

    def _bytes(self, v: bytes, where: str) -> dict:
        return {"bytes": base64.b64encode(v).decode()}

    def _bytearray(self, v: bytearray, where: str) -> dict:
        node = {"bytearray": base64.b64encode(v).decode()}
        self.remember(v, node)
        return node

    def _complex(self, v: complex, where: str) -> dict:
        return {"complex": [self.value(v.real, where), self.value(v.imag, where)]}

    def _library_value(self, v: Any, t: type, where: str) -> Any:
        """The node of a numpy or torch value (None for anything else)."""
        np = sys.modules.get("numpy")
        if np is not None:
            if t is np.ndarray:
                return self.array(v, where)
            if isinstance(v, np.generic):
                return self.numpy_scalar(v, where)
            if isinstance(v, np.ndarray):
                raise Refused(where, f"a {type_name(v)} (a subclass of numpy's ndarray)",
                              "store a plain array (np.asarray)")
        torch = _torch()
        if torch is None:
            return None
        if isinstance(v, torch.Tensor):
            return self.tensor(v, where)
        if t is torch.dtype:
            return {"torch_dtype": str(v).removeprefix("torch.")}
        if t is torch.device:
            return {"torch_device": str(v)}
        if t is torch.Size:
            return {"torch_size": list(v)}
        return None

    def numpy_scalar(self, v: Any, where: str) -> dict:
        dtype = v.dtype
        if dtype.kind not in "biufcUSmM" or dtype.hasobject:
            raise Refused(where, f"a numpy scalar of dtype {dtype}")
        import numpy as np

        return {"numpy_scalar": dtype.str, "hex": np.asarray(v).tobytes().hex()}

    def array(self, a: Any, where: str) -> dict:
        dtype = a.dtype
        if dtype.hasobject or dtype.kind not in "biufcUSmM" or dtype.itemsize == 0:
            raise Refused(where, f"a numpy array of dtype {dtype}",
                          "a state file holds arrays of numbers, booleans, strings and dates")
        node = {"ndarray": None}
        self.remember(a, node)
        info: dict = {"kind": "numpy", "dtype": dtype.str, "shape": list(a.shape)}
        order_f = a.ndim > 1 and not a.flags.c_contiguous and a.flags.f_contiguous
        if order_f:
            info["order"] = "F"
        key = ("numpy", a.__array_interface__["data"][0], a.shape, a.strides, dtype.str)
        name = self._views.get(key)
        if name is None:
            import numpy as np

            data = a if a.flags.c_contiguous else np.array(a, order="C")  # (ascontiguousarray makes 0-d 1-d)
            if data is a and self._overlaps(data.__array_interface__["data"][0], data.nbytes):
                data = data.copy()  # safetensors refuses arrays sharing memory: this one gets its own
            if dtype.str not in SAFE_NUMPY:
                info["raw"] = True
                data = data.reshape(-1).view(np.uint8)
            name = self._add(where, info, data)
            self._views[key] = name
        node["ndarray"] = name
        return node

    def tensor(self, t: Any, where: str) -> dict:
        torch = _torch()
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise Refused(where, f"a {type_name(t)} (a tensor subclass)", "store a plain tensor")
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
            raise Refused(where, f"a {t.layout} {'quantized ' if t.is_quantized else ''}tensor on {t.device}",
                          "a state file holds dense tensors (tensor.to_dense())")
        node: dict = {"tensor": None, "device": str(t.device)}
        self.remember(t, node)
        if t.requires_grad:
            node["requires_grad"] = True
            if t.grad_fn is not None and holds_live_graph(t):
                self.graphs.append(where)
        if type(t) is torch.nn.Parameter:
            node["parameter"] = True
        if t.is_leaf and t.grad is not None:
            node["grad"] = self.value(t.grad, f"{where}/grad")
        d = t.detach()
        key = ("torch", d.untyped_storage().data_ptr(), d.storage_offset(), tuple(d.shape), d.stride(), d.dtype,
               str(d.device))
        name = self._views.get(key)
        if name is None:
            name = self._views[key] = self._tensor_data(d, where)
        node["tensor"] = name
        return node

    def _tensor_data(self, d: Any, where: str) -> str:
        """The name of a (detached) tensor's data in the file, added: a contiguous CPU copy where needed,
        as bytes where safetensors has no such dtype."""
        torch = _torch()
        dtype = str(d.dtype).removeprefix("torch.")
        if dtype not in TORCH_DTYPES:
            raise Refused(where, f"a tensor of dtype {dtype}")
        info = {"kind": "torch", "dtype": dtype, "shape": list(d.shape)}
        data = d if d.device.type == "cpu" else d.cpu()
        if not data.is_contiguous():
            data = data.contiguous()
        elif data is d and self._overlaps(data.data_ptr(), data.numel() * data.element_size()):
            data = data.clone()  # safetensors refuses tensors sharing memory: this one gets its own
        if dtype not in SAFE_TORCH:
            info["raw"] = True
            data = data.reshape(-1).view(torch.uint8)
        return self._add(where, info, data)

    def _overlaps(self, start: int, nbytes: int) -> bool:
        """Whether [start, start + nbytes) overlaps memory written so far (else it is noted as written)."""
        if nbytes == 0:
            return False
        end = start + nbytes
        k = bisect.bisect_right(self._starts, start)
        if (k and self._ends[k - 1] > start) or (k < len(self._starts) and self._starts[k] < end):
            return True
        self._starts.insert(k, start)
        self._ends.insert(k, end)
        return False

    def _add(self, where: str, info: dict, data: Any) -> str:
        name, n = where, 1
        while name in self.table:
            n += 1
            name = f"{where}#{n}"
        self.table[name] = info
        self.data[name] = data
        self._keep.append(data)
        return name


# the plain values' types (exactly) -> how Encoder.value encodes them
_PLAIN = {list: Encoder._list, tuple: Encoder._tuple, dict: Encoder._dict, OrderedDict: Encoder._dict,
          set: Encoder._set, frozenset: Encoder._set, bytes: Encoder._bytes, bytearray: Encoder._bytearray,
          complex: Encoder._complex}
