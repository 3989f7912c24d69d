"""What a compiled form of a fused step read that is not one of its inputs, and the check made before every
call of it.

A compiled form (a child's package, the thread's direct graph) keeps whatever its trace read besides the
values of its inputs as it was then: the calls' constant arguments (``SHIFTS`` in
``CALL(torch.roll, reg('x'), SHIFTS, 0)``), the containers that hold registers (``[reg('a'), reg('b')]``)
and the process state that changes what torch computes (the default dtype and device, grad and inference
mode, autocast, deterministic algorithms, matmul precision, the thread count, oneDNN).  Each such value is

- proven immutable (numbers, strings, dtypes, tuples and frozensets of those, frozen dataclasses, torch's
  own functions): nothing to check;
- or checkable (lists, dicts, sets, numpy arrays of those): a copy is kept when the compile starts and the
  live value is compared with it before every call; while one differs the step runs eagerly;
- or neither (an object of the user's, a function of the user's): ``Reads.capture`` raises ``Unchecked``
  naming it, and the step is left to a form that checks what it reads (dynamo's guards) or stays eager.

Functions are not values here: each compiled form has its own rule for them (the direct form and the plain
package take torch's functions only; a step with modules checks them through its guards).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from typing import Any, Iterator

from ..program.printer import call_text
from ..program.registers import Register
from . import torch_internals
from .checks import torch_function
from .refused import Refused


Unchecked = Refused  # a value a compiled form would read that is neither immutable nor checkable (named)


_SCALARS = frozenset({int, float, complex, bool, str, bytes, type(None), type(Ellipsis), type(NotImplemented),
                      range})


@functools.lru_cache(maxsize=None)
def _torch_scalars() -> frozenset:
    import torch

    return frozenset({torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size, torch.qscheme})


def immutable(value: Any) -> bool:
    """Whether value can never change: numbers, strings, torch's dtypes and devices, tuples, frozensets and
    slices of such values, enum members, frozen dataclasses of such fields, torch's own functions."""
    kind = type(value)
    if kind in _SCALARS or isinstance(value, enum.Enum) or kind in _torch_scalars():
        return True
    parts = _parts(value, kind)
    if parts is not None:
        return all(immutable(v) for v in parts)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _frozen_dataclass(value, kind)
    return isinstance(value, (types.BuiltinFunctionType, types.FunctionType)) and torch_function(value)


def _parts(value: Any, kind: type) -> Any:
    """The values a tuple (or named tuple), frozenset or slice is made of; None for any other value."""
    if isinstance(value, tuple) and (kind is tuple or hasattr(kind, "_fields")):
        return value
    if kind is frozenset:
        return value
    if kind is slice:
        return (value.start, value.stop, value.step)
    return None


def _frozen_dataclass(value: Any, kind: type) -> bool:
    """A frozen dataclass instance with nothing but its fields, each immutable."""
    params = getattr(kind, "__dataclass_params__", None)
    fields = dataclasses.fields(value)
    extra = set(getattr(value, "__dict__", {})) - {f.name for f in fields}
    return bool(params and params.frozen) and not extra and all(immutable(getattr(value, f.name)) for f in fields)


def _ndarray(value: Any) -> bool:
    np = __import__("sys").modules.get("numpy")
    return np is not None and type(value) is np.ndarray and value.dtype != object


def _checkable(value: Any) -> bool:
    """A mutable value whose every part is a register, immutable or checkable itself."""
    if isinstance(value, Register) or immutable(value):
        return True
    kind = type(value)
    if kind is list or isinstance(value, tuple) and (kind is tuple or hasattr(kind, "_fields")):
        return all(_checkable(v) for v in value)
    if kind is dict:
        return all(immutable(k) or isinstance(k, Register) for k in value) and all(_checkable(v) for v in value.values())
    if kind is set:
        return all(immutable(v) for v in value)
    return _ndarray(value)


def snapshot(value: Any) -> Any:
    """A copy of a checkable value (registers kept as they are, never their register file)."""
    kind = type(value)
    if kind is list:
        return [snapshot(v) for v in value]
    if kind is dict:
        return {k: snapshot(v) for k, v in value.items()}
    if kind is set:
        return set(value)
    if isinstance(value, tuple) and not immutable(value):
        items = [snapshot(v) for v in value]
        return kind(*items) if hasattr(kind, "_fields") else tuple(items)
    if _ndarray(value):
        return value.copy()
    return value


def same(live: Any, kept: Any) -> bool:
    """Whether a value is still what snapshot() kept: the same types all through, equal values (a NaN equal
    to a NaN), the same registers."""
    kind = type(live)
    if kind is not type(kept):
        return False
    if isinstance(live, Register):
        return live is kept
    if kind is list or isinstance(live, tuple):
        return len(live) == len(kept) and all(same(a, b) for a, b in zip(live, kept))
    if kind is dict:
        return list(live) == list(kept) and all(same(live[k], kept[k]) for k in live)
    if _ndarray(live):
        return _same_array(live, kept)
    if kind is float or kind is complex:
        return live == kept or (live != live and kept != kept)
    return live == kept


def _same_array(live: Any, kept: Any) -> bool:
    import numpy as np

    return live.dtype == kept.dtype and live.shape == kept.shape and bool(
        np.array_equal(live, kept, equal_nan=live.dtype.kind in "fc"))


def _arguments(calls: Any) -> Iterator[tuple[str, Any]]:
    for i, call in enumerate(calls):
        for j, value in enumerate(call.args):
            yield f"CALL {call_text(call)}: argument {j + 1}", value
        for key, value in call.kwargs.items():
            yield f"CALL {call_text(call)}: argument {key}=", value


def _values(calls: Any) -> list[tuple[str, Any]]:
    """The calls' arguments that must be checked before each call: (where, value) for each mutable one
    (raises Unchecked for one that can be neither proven immutable nor checked)."""
    found = []
    for where, value in _arguments(calls):
        if isinstance(value, Register) or immutable(value):
            continue
        if not _checkable(value):
            raise Unchecked(f"{where} is a {type(value).__name__}, a value of the program that a compiled "
                            f"form would keep as it is now")
        found.append((where, value))
    return found


class _State:
    """The torch settings of the moment: ``holds()`` says whether they are unchanged."""

    def __init__(self):
        import torch

        self.guard = torch_internals.global_state_guard()
        self.values = self._read(torch)

    @staticmethod
    def _read(torch: Any) -> tuple:
        return (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                torch_internals.autocast_enabled(), torch.are_deterministic_algorithms_enabled(),
                torch.get_float32_matmul_precision(), torch.get_num_threads(), torch_internals.mkldnn_enabled()(),
                *(depth() for depth in torch_internals.mode_depths()))

    def source(self, ns: dict) -> list[str]:
        import torch

        ns["_state_modes"] = torch_internals.mode_depths()
        ns["_state_mkldnn"] = torch_internals.mkldnn_enabled()
        parts = [f"_state_modes[0]() == {self.values[-2]}", f"_state_modes[1]() == {self.values[-1]}",
                 f"_state_mkldnn() is {self.values[-3]}"]
        if self.guard is not None:  # the default dtype, grad, inference, autocast, deterministic, matmul, threads
            ns["_state_guard"] = self.guard.check
            return ["_state_guard()"] + parts
        ns["_state_read"], ns["_state_torch"], ns["_state_values"] = self._read, torch, self.values
        return ["_state_read(_state_torch) == _state_values"]

    def changed(self) -> str | None:
        import torch

        names = ("the default dtype", "grad mode", "inference mode", "autocast", "deterministic algorithms",
                 "the float32 matmul precision", "the thread count", "oneDNN (torch.backends.mkldnn.enabled)",
                 "a torch function mode (torch.set_default_device, say)", "a torch dispatch mode")
        now = self._read(torch)
        return next((f"{name}: {a!r} then, {b!r} now" for name, a, b in zip(names, self.values, now) if a != b), None)


class Reads:
    """Everything a compiled form of these calls read besides its inputs, as it was when its compile
    started: the mutable constant arguments (a copy of each) and the torch settings."""

    def __init__(self, values: list[tuple[str, Any]]):
        self.values = [(where, live, snapshot(live)) for where, live in values]
        self.state = _State()

    @classmethod
    def capture(cls, calls: Any) -> "Reads":
        """Reads of these calls now (raises Unchecked naming a value that cannot be checked)."""
        return cls(_values(calls))

    def source(self, ns: dict, prefix: str = "_read") -> list[str]:
        """Python conditions checking that everything read is unchanged, their names put in ns."""
        parts = self.state.source(ns)
        ns[f"{prefix}_same"] = same
        for k, (_, live, kept) in enumerate(self.values):
            ns[f"{prefix}_live{k}"], ns[f"{prefix}_kept{k}"] = live, kept
            parts.append(f"{prefix}_same({prefix}_live{k}, {prefix}_kept{k})")
        return parts

    def holds(self) -> bool:
        ns: dict[str, Any] = {}
        return all(eval(part, ns) for part in self.source(ns))

    def changed(self) -> str | None:
        """What differs now from when the compile started (None when nothing does)."""
        for where, live, kept in self.values:
            if not same(live, kept):
                return f"{where} changed"
        return self.state.changed()
