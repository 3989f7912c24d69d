"""Helpers for testing flowvm programs: run them several ways and compare.

``assert_same_run(build)`` is the differential test every program should pass:
the registers, result and step count are the same whether the program runs
straight through or is stopped at step k, copied (pickle, cloudpickle,
deepcopy or a checkpoint) and resumed.
"""

from __future__ import annotations

import copy
import pickle
import random
from typing import Any, Callable, Iterable

import cloudpickle

from .persist.checkpoint import dumps as checkpoint_dumps
from .persist.checkpoint import loads as checkpoint_loads
from .machine.driver import Driver
from .program.elements import Element
from .base.environment import apply_random, capture_random

COPIERS: dict[str, Callable[[Driver], Driver]] = {
    "pickle": lambda d: pickle.loads(pickle.dumps(d)),
    "cloudpickle": lambda d: pickle.loads(cloudpickle.dumps(d)),
    "deepcopy": copy.deepcopy,
    "checkpoint": lambda d: checkpoint_loads(checkpoint_dumps(d)),
}


def same(a: Any, b: Any) -> bool:
    """Exact equality that also understands numpy arrays and torch tensors (bit for bit, NaNs equal), and
    plain objects without an ``__eq__`` of their own (by their attributes)."""
    array = _same_arrays(a, b)
    if array is not None:
        return array
    if isinstance(a, (list, tuple, dict)):
        return _same_items(a, b)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if type(a) is type(b) and _plain_object(a):
        return a is b or same(vars(a), vars(b))  # a plain object (a fitted model): its attributes
    return type(a) is type(b) and a == b


def _same_items(a: list | tuple | dict, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def _plain_object(a: Any) -> bool:
    """An object without an ``__eq__`` of its own, compared by its attributes."""
    return type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__") and not isinstance(a, type) \
        and not callable(a)


def _same_arrays(a: Any, b: Any) -> bool | None:
    """same(a, b) when a is a tensor or a numpy array or scalar; None for anything else."""
    import sys

    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        if torch.equal(a, b):
            return True
        return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else False
    if np is not None and isinstance(a, (np.ndarray, np.generic)):
        return (isinstance(b, (np.ndarray, np.generic)) and np.shape(a) == np.shape(b)
                and np.asarray(a).dtype == np.asarray(b).dtype
                and np.array_equal(a, b, equal_nan=np.asarray(a).dtype.kind in "fc"))
    return None


def outcome(driver: Driver) -> dict:
    """What a finished run produced: result, step count and a copy of the registers."""
    return {"result": driver.result, "steps": driver.steps, "registers": dict(driver.registers)}


def diff(expected: dict, got: dict, steps: bool = True) -> list[str]:
    """What differs between two outcomes (empty when they are the same); steps=False ignores step counts."""
    problems = []
    if not same(expected["result"], got["result"]):
        problems.append(f"result {got['result']!r:.80} != {expected['result']!r:.80}")
    if steps and expected["steps"] != got["steps"]:
        problems.append(f"steps {got['steps']} != {expected['steps']}")
    er, gr = expected["registers"], got["registers"]
    for name in sorted(set(er) | set(gr)):
        if name not in gr or name not in er or not same(er[name], gr[name]):
            problems.append(f"register {name!r}: {gr.get(name, '<missing>')!r:.80} != {er.get(name, '<missing>')!r:.80}")
    return problems


def assert_same_run(build: Callable[[], Element], cuts: Iterable[int] | None = None,
                    copiers: Iterable[str] = tuple(COPIERS), seed: int = 0, steps: bool | None = None) -> dict:
    """Check that stopping at step k, copying and resuming changes nothing.

    ``build`` returns a fresh program (with fresh registers and seeded random
    generators) each time it is called.  The copy goes on after the global generators were moved
    elsewhere, as in a fresh process: it must set the states it was copied with itself.  The original
    goes on from the states it reached at step k.  ``cuts`` defaults to a few step counts
    spread over the run.  Step counts are compared too, unless ``steps=False``
    or (by default) the program holds leaves that poll work running elsewhere
    (POPEN, SPAWN), whose step counts depend on timing.  Returns the
    uninterrupted outcome.
    """
    program = build()
    if steps is None:
        from .program.paths import walk

        steps = not any(el.polls for _, el in walk(program))
    reference = program.start()
    reference.run()
    expected = outcome(reference)
    again = build().start()
    again.run()
    problems = diff(expected, outcome(again), steps)
    if problems:
        raise AssertionError("two uninterrupted runs of build() differ, so resumed runs cannot be compared: "
                             "seed the global random generators inside build() (random.seed, "
                             "numpy.random.seed, torch.manual_seed) and keep its CALLs deterministic:\n  "
                             + "\n  ".join(problems))
    total = expected["steps"]
    if cuts is None:
        rng = random.Random(seed)
        cuts = sorted({0, total, *(rng.randint(0, total) for _ in range(3))})
    for k in cuts:
        for name in copiers:
            original = build().start()
            original.run(max_steps=k)
            at_k = capture_random()
            clone = COPIERS[name](original)
            for who, drv in (("copy", clone), ("original", original)):
                if who == "copy":
                    _scramble_random()  # as in another process: the copy sets its own states
                else:
                    apply_random(at_k)
                drv.run()
                problems = diff(expected, outcome(drv), steps)
                if problems:
                    raise AssertionError(f"the {who} resumed after {k} steps via {name} differs from an "
                                         f"uninterrupted run:\n  " + "\n  ".join(problems))
    return expected


def _scramble_random() -> None:
    """Move every global generator to a state unrelated to the run's."""
    import sys

    random.seed(0x5EED)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(0x5EED)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0x5EED)


def digest(value: Any) -> str:
    """A SHA-256 of value's exact contents: equal digests mean equal values bit for bit (floats by their
    bits, arrays and tensors by dtype, shape and bytes), whatever process or machine computed them.
    Takes None, bools, numbers, strings, bytes, numpy arrays and scalars, torch tensors, lists, tuples
    and dicts of these (a Registers file too), and objects (by class name) through their ``state_dict()``
    or, lacking one, their attributes (a fitted model)."""
    import hashlib

    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h, value: Any) -> None:
    import struct

    if value is None or isinstance(value, (bool, int, str)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, float):
        h.update(b"float:" + struct.pack(">d", value))
    elif isinstance(value, (bytes, bytearray)):
        h.update(f"bytes:{len(value)}:".encode() + bytes(value))
    elif not _feed_array(h, value):
        _feed_container(h, value)


def _feed_array(h, value: Any) -> bool:
    """Feed a tensor or a numpy array or scalar; False for anything else."""
    import sys

    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
        h.update(f"tensor:{t.dtype}:{tuple(t.shape)}:".encode() + raw.numpy().tobytes())
    elif np is not None and isinstance(value, (np.ndarray, np.generic)):
        a = np.ascontiguousarray(value)
        if a.dtype.hasobject:
            h.update(f"objects:{a.shape}:".encode())
            for item in a.ravel():
                _feed(h, item)
        else:
            h.update(f"array:{a.dtype.str}:{a.shape}:".encode() + a.tobytes())
    else:
        return False
    return True


def _feed_container(h, value: Any) -> None:
    if isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}:{len(value)}[".encode())
        for item in value:
            _feed(h, item)
        h.update(b"]")
    elif isinstance(value, dict):
        h.update(f"dict:{len(value)}{{".encode())
        for key in sorted(value, key=repr):
            _feed(h, key)
            _feed(h, value[key])
        h.update(b"}")
    elif callable(getattr(value, "state_dict", None)):
        h.update(f"object:{type(value).__qualname__}:state_dict".encode())
        _feed(h, value.state_dict())
    elif hasattr(value, "__dict__") and not callable(value) and not isinstance(value, type):
        h.update(f"object:{type(value).__qualname__}:".encode())
        _feed(h, vars(value))
    else:
        raise TypeError(f"digest: cannot digest a {type(value).__name__}; give it numbers, strings, arrays, "
                        "tensors, lists, tuples and dicts of these, or objects with state_dict() or plain "
                        "attributes of these")
