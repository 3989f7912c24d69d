"""How every copy of a run is pickled and unpickled: pickle, cloudpickle, deepcopy and checkpoint files
all go through ``Pickler`` (see its docstring for the rules exact resume needs) and ``Unpickler`` (which
finds moved names through ``flowvm.pickled.LEGACY_NAMES``).

Functions that cloudpickle writes by value (lambdas, closures, functions of ``__main__``) are bytecode,
which only the Python minor version that wrote it can run: a pickle holding some records that version
(``Pickler.bytecode``), and a copy refuses to load under another one (``check_bytecode``).
"""

from __future__ import annotations

import io
import pickle
import random
import sys
import types
import warnings
import weakref
from typing import Any

import cloudpickle

from ..pickled import stable
from ..program.elements import provide
from ..base import environment
from ..base.environment import check_random, check_settings
from ..base.autograd import holds_live_graph
from ..base.errors import CheckpointError, CopyWarning
from .refusals import LiveGraph, copy_refused
from .streamnames import names_in  # noqa: F401  (flowvm.persist.pickler.names_in)

@stable("flowvm.pickled")
def global_generator(name: str) -> Any:
    """The process-wide generator object named name ("random", "numpy" or "torch"); its pickled name stays."""
    return environment.global_generator(name)


class _WithoutGrad:
    """Pickles as its tensor would, leaving out the tensor's .grad."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __reduce_ex__(self, protocol):
        return self.tensor.__reduce_ex__(protocol)


@stable("flowvm.pickled")
def with_grad(tensor, grad):
    tensor.grad = grad
    return tensor


@stable("flowvm.pickled")
def set_lbfgs_state(opt, state) -> None:
    opt.__setstate__(state)
    opt._params = opt.param_groups[0]["params"]
    opt._numel_cache = None


@stable("flowvm.pickled")
def rebuild_driver(state: dict):
    """A copy of a driver, from Driver.__getstate__; its saved random states and settings are checked
    here (a malformed one is a CheckpointError naming the generator or setting) and set by its first
    step."""
    from ..machine import metrics
    from ..machine.driver import DRIVERS, Driver

    resume = state.get("_resume")
    if resume is not None:
        if not isinstance(resume, dict):
            raise CheckpointError("<copy>", f"malformed resume state: {type(resume).__name__}")
        state["_resume"] = {"random": None if resume.get("random") is None else check_random(resume["random"]),
                            "settings": check_settings(resume.get("settings", {})),
                            "announce": bool(resume.get("announce", True))}
    drv = Driver.__new__(Driver)
    drv.__dict__.update(state)
    metrics.attach(drv)  # a watched run's step records its points again
    DRIVERS.add(drv)
    return drv


class Pickler(cloudpickle.Pickler):
    """How every copy of a driver is made (pickle, cloudpickle, deepcopy, checkpoints):
    cloudpickle (lambdas and closures by value) plus the rules that exact resume and fast copies need.

    - The global generators behind random.random, np.random.rand, ... are written
      as references wherever they occur (in a partial, as an argument, as a
      register's value).  By value, a loaded program would draw from private
      copies, out of step with the restored global generators.
    - A leaf tensor's .grad is kept (torch's own pickling drops it), so a run cut
      between backward() and the optimizer's step() resumes exactly.
    - A CPU torch storage is written as a ``pickle.PickleBuffer`` over its own
      memory (protocol 5): out of band when a ``buffer_callback`` takes it (a
      checkpoint file), else in the stream, with no ``torch.save`` into a
      BytesIO.  Tensors viewing one storage reference one pickled storage, so
      they share it again when loaded.
    """

    def __init__(self, file, protocol=None, buffer_callback=None):
        # cloudpickle's table is a ChainMap, looked up (in Python) for every
        # object; the same entries in a plain dict cost a C lookup.  The C
        # pickler reads the table when it is initialised.
        self.dispatch_table = dict(cloudpickle.Pickler.dispatch_table)
        # The PickleBuffers made for torch storages, by id: the buffer_callback
        # tells them from others (a loader allocates their memory with torch).
        # Holding them keeps the ids unique while the pickle is written.
        self.storage_buffers: dict[int, pickle.PickleBuffer] = {}
        # Whether a finished run is being written: its tensors' autograd graphs are no longer needed.
        self.finished_run = False
        # A code object written means a function pickled by value: note the Python that can run it
        # (in a list the hook holds, not the pickler: no reference cycle through the pickler's buffers).
        self._bytecode: list[str] = []
        seen, reduce_code = self._bytecode, self.dispatch_table[types.CodeType]

        def code(obj):
            if not seen:
                seen.append(python_minor())
            return reduce_code(obj)

        self.dispatch_table[types.CodeType] = code
        super().__init__(file, protocol=protocol, buffer_callback=buffer_callback)

    @property
    def bytecode(self) -> str | None:
        """The Python minor version ("3.11") whose bytecode the pickle holds, or None."""
        return self._bytecode[0] if self._bytecode else None

    def reducer_override(self, obj):
        # Called for every object written: keep the common case (elements,
        # containers, plain values) to a type lookup.
        t = type(obj)
        try:
            rule = _RULES[t]
        except KeyError:
            rule = _RULES[t] = _rule_for(t)
        if rule is not None:
            reduced = rule(self, obj)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


def _rule_for(t: type):
    """The special reduction for objects of type t, or None (decided once per type); called as
    rule(pickler, obj)."""
    from ..machine.driver import Driver

    if t is Driver:
        return _reduce_driver_state
    if issubclass(t, random.Random) or (t.__module__ or "").startswith("numpy.random"):
        return _with_obj(_reduce_generator)
    if t is types.FunctionType:
        return _with_obj(_reduce_patched_method)
    torch = sys.modules.get("torch")
    return None if torch is None else _torch_rule_for(t, torch)


def _torch_rule_for(t: type, torch) -> Any:
    """_rule_for of torch's types: tensors, storages, generators, optimizers, data loaders."""
    if issubclass(t, torch.Tensor):
        return _reduce_tensor
    if t is torch.storage.TypedStorage:
        return _reduce_typed_storage
    if t is torch.UntypedStorage:
        return _reduce_untyped_storage
    if t is torch.Generator:
        return _with_obj(_reduce_generator)
    if issubclass(t, torch.optim.LBFGS):
        return _with_obj(_reduce_lbfgs)
    if issubclass(t, torch.optim.Optimizer):
        return _with_obj(_reduce_optimizer)
    if any((c.__module__ or "").startswith(("torch.utils.data", "torchdata")) for c in t.__mro__):
        from ..base.loaders import reduction_for  # DataLoader iterators refused, StatefulDataLoader's state kept

        loader_rule = reduction_for(t)
        return None if loader_rule is None else _with_obj(loader_rule)
    return None


def _reduce_driver_state(pickler, drv):
    # A finished run takes no more steps: the autograd graphs it holds are left out (their values kept).
    pickler.finished_run = pickler.finished_run or drv.done
    return rebuild_driver, (drv.__getstate__(),)


def _with_obj(reduce):
    return lambda pickler, obj: reduce(obj)


_RULES: dict = {}


def _reduce_typed_storage(pickler, storage):
    # The typed view is rebuilt around its untyped storage, which pickle
    # memoizes: every tensor on one storage refers to the same pickled one.
    untyped = storage._untyped_storage  # (TypedStorage.device warns that the class is deprecated)
    if pickler.proto < 5 or untyped.device.type != "cpu":
        return NotImplemented  # torch's own pickling
    return rebuild_typed_storage, (untyped, storage.dtype)


def _reduce_untyped_storage(pickler, storage):
    if pickler.proto < 5 or storage.device.type != "cpu":
        return NotImplemented  # torch's own pickling
    buf = pickle.PickleBuffer(storage_bytes(storage))
    pickler.storage_buffers[id(buf)] = buf
    return rebuild_storage, (buf, sys.byteorder)


class _StorageMemory:
    """A CPU torch storage's memory as numpy sees it (``np.asarray`` of this is a uint8 array over it,
    with no copy), holding the storage alive.  ``tensor.numpy()`` would do as much but marks the
    storage as never resizable again."""

    def __init__(self, storage):
        self.storage = storage
        self.__array_interface__ = {"data": (storage.data_ptr(), False), "shape": (storage.nbytes(),),
                                    "typestr": "|u1", "version": 3}


def storage_bytes(storage):
    import numpy as np

    return np.asarray(_StorageMemory(storage))


# rebuild_typed_storage and rebuild_storage are named in every saved file that holds a CPU tensor:
# keep their names.
@stable("flowvm.pickled")
def rebuild_typed_storage(untyped, dtype):
    import torch

    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


@stable("flowvm.pickled")
def rebuild_storage(data, byteorder: str):
    """A CPU torch UntypedStorage from what _reduce_untyped_storage wrote: the storage a checkpoint's
    loader read the bytes into (used as it is), or the bytes themselves (copied into memory torch
    allocates, so that the storage can be resized as any other)."""
    import torch

    if byteorder != sys.byteorder:
        raise CheckpointError("<copy>", f"holds torch tensors written on a {byteorder}-endian machine; this "
                                        f"one is {sys.byteorder}-endian, and they cannot be converted")
    if isinstance(data, torch.UntypedStorage):
        return data
    src = memoryview(data).cast("B")
    out = torch.UntypedStorage(src.nbytes, device="cpu")
    memoryview(storage_bytes(out))[:] = src
    return out


def _reduce_generator(obj):
    name = environment.global_generator_name(obj)
    return (global_generator, (name,)) if name is not None else NotImplemented


def _reduce_tensor(pickler, obj):
    if obj.grad_fn is not None and not pickler.finished_run and holds_live_graph(obj):
        raise LiveGraph(obj)
    if getattr(obj, "_backward_hooks", None) or getattr(obj, "_post_accumulate_grad_hooks", None):
        _warn_dropped("gradient hooks registered on a tensor (Tensor.register_hook and the like)")
    if obj.is_leaf and obj.grad is not None:
        return with_grad, (_WithoutGrad(obj), obj.grad)
    return NotImplemented


def _reduce_optimizer(obj):
    if any(getattr(obj, name, None) for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")):
        _warn_dropped("step hooks registered on an optimizer (register_step_pre_hook/post_hook)")
    return NotImplemented


def _warn_dropped(what: str) -> None:
    warnings.warn(f"flowvm: a copy of this run leaves out the {what}: torch does not pickle them, so the "
                  "copy would run without them. Register such hooks in a CALL of the program (so that "
                  "the copy runs it too), or keep the run in this process.", CopyWarning, stacklevel=2)


def _reduce_patched_method(fn):
    """A method that a library patched onto an optimizer (an LR scheduler wraps ``opt.step`` in a closure
    holding a weak reference): written as the optimizer's method, which pickles."""
    if getattr(fn, "__wrapped__", None) is None or not fn.__closure__:
        return NotImplemented
    torch = sys.modules.get("torch")
    if torch is None:
        return NotImplemented
    for cell in fn.__closure__:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, weakref.ref):
            owner = value()
            if isinstance(owner, torch.optim.Optimizer) and owner.__dict__.get(fn.__name__) is fn:
                return getattr, (owner, fn.__name__)
    return NotImplemented


def _reduce_lbfgs(obj):
    # torch pickles an optimizer's defaults, state and groups only; LBFGS
    # also needs its parameter list back, or its next step fails.
    func, args, state, *rest = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return func, args, state, None, None, set_lbfgs_state


def pickle_bytes(obj: Any) -> bytes:
    """obj pickled as in a checkpoint (cloudpickle, global generators by reference)."""
    return pickle_with_python(obj)[0]


def pickle_with_python(obj: Any) -> tuple[bytes, str | None]:
    """obj pickled as pickle_bytes does, and the Python version its bytecode needs (None: none held)."""
    buf = io.BytesIO()
    pickler = Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dump(obj)
    return buf.getvalue(), pickler.bytecode


@stable("flowvm.pickled")
def load_driver_bytes(data: bytes, bytecode: str | None = None):
    """A driver from the bytes its __reduce_ex__ wrote (how pickle, cloudpickle and deepcopy copy one)."""
    check_bytecode(bytecode, "<copy>")
    return Unpickler(io.BytesIO(data)).load()


def python_minor() -> str:
    return "{}.{}".format(*sys.version_info[:2])


def check_bytecode(bytecode: str | None, where: Any) -> None:
    """Refuse a pickle holding bytecode of another Python minor version (its functions could crash)."""
    if bytecode is not None and bytecode != python_minor():
        raise CheckpointError(where, f"holds functions saved as Python {bytecode} bytecode (lambdas, closures, "
                                     f"functions defined in __main__ or a notebook), which Python "
                                     f"{python_minor()} cannot run: resume it with Python {bytecode}, or define "
                                     "those functions in a module so that they are saved by name")


class Unpickler(pickle.Unpickler):
    """Unpickles copies of runs: a name that moved is found through flowvm.pickled.LEGACY_NAMES."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("flowvm"):
            from ..pickled import find_class

            module, name = find_class(module, name)
        return super().find_class(module, name)




def reduce_driver(drv) -> tuple:
    """How a Driver reduces for any outer pickler (pickle, cloudpickle, copy.deepcopy): its state written by
    Pickler, so that every kind of copy keeps the same things."""
    try:
        data, bytecode = pickle_with_python(drv)
    except Exception as err:
        raise copy_refused(err, drv, pickle_bytes) from err
    return load_driver_bytes, (data,) if bytecode is None else (data, bytecode)


def copy_problem(drv):
    """Driver.copyable(): the CopyError a copy of drv made now would raise (a live autograd graph), or None:
    drv pickled with its large buffers left out."""
    try:
        Pickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=_out_of_band).dump(drv)
    except LiveGraph as err:
        return copy_refused(err, drv, pickle_bytes)
    return None


class _Discard:
    def write(self, data) -> int:
        return len(data)


def _out_of_band(buf) -> bool:
    return False  # large buffers are left out: not written at all


provide("copy_driver", reduce_driver)  # Driver.__reduce_ex__
provide("copy_problem", copy_problem)  # Driver.copyable
