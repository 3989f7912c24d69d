"""What a run needs from its process beyond its own state: the global random generators and the settings
that change results.  Both are captured as plain data (ints, strings, bytes), so that a copy of a run
loads where the libraries that wrote them are missing (a numpy-only run saved beside torch loads without
torch), and checked before anything is set.

The rule every copy of a driver follows (pickle, cloudpickle, deepcopy, checkpoint): the copy carries the
states of the global generators and the settings of the moment it was made, and sets them when it takes
its first step.  The original never touches them.  ``Driver.resume_with`` chooses what a copy sets.

Global generators: ``random``'s, numpy's legacy global ``RandomState`` (``np.random.rand`` and friends),
torch's CPU generator (``torch.manual_seed``) and, when CUDA is initialized, every CUDA device's.

A copy resumed in a process that has not imported torch (a numpy-only resume must not pay for torch's import)
still sets torch's generator states and settings: when the run, a library or the user imports torch later,
a finder on ``sys.meta_path`` (flowvm.base.torcharrival) sets them as soon as torch's own import ends, as long as the
driver that carries them runs (not finished, not collected).  ``capture_random`` and ``capture_settings`` count
them as this process's until then, so a copy of that copy carries them on.

Settings (only those of libraries the process has imported, or deferred as above), by name:

=================================  ===========================================================
``torch.threads``                  ``torch.get_num_threads()`` (intra-op threads; set at most to the
                                   cores this process may use)
``torch.deterministic``            ``torch.are_deterministic_algorithms_enabled()``
``torch.deterministic_warn_only``  ``torch.is_deterministic_algorithms_warn_only_enabled()``
``torch.float32_matmul_precision`` ``torch.get_float32_matmul_precision()``
``torch.default_dtype``            ``torch.get_default_dtype()``, as its name (``"float32"``)
``torch.cudnn.*``                  cuDNN's ``enabled``, ``benchmark``, ``deterministic``,
                                   ``allow_tf32`` (when CUDA is initialized)
``torch.cuda.matmul.allow_tf32``   (when CUDA is initialized)
=================================  ===========================================================

>>> from flowvm.base.environment import capture_random, check_random
>>> state = capture_random()
>>> check_random(state) == state
True
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from typing import Any

from .errors import CheckpointError, SettingsWarning
from . import torcharrival
from .torcharrival import defer, deferred_part

__all__ = ["capture_random", "check_random", "apply_random", "capture_settings", "check_settings",
           "apply_settings", "SETTINGS", "SettingsWarning"]


# ---------------------------------------------------------------- random states
def capture_random() -> dict:
    """The states of the global generators, as plain data: ``random``'s always, numpy's and torch's when
    imported."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"random": [version, list(internal), gauss]}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    torch = sys.modules.get("torch")
    if torch is None:
        state.update(deferred_part("random"))  # what torch gets when it is imported
    else:
        state["torch"] = bytes(torch.get_rng_state().numpy())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = [bytes(s.numpy()) for s in torch.cuda.get_rng_state_all()]
    return state


def check_random(state: Any, where: Any = "<copy>") -> dict:
    """state as capture_random gives it, after checking that every part would set its generator; also
    reads the form older checkpoints hold (tuples, numpy's array, torch's tensor).  Raises CheckpointError
    naming the generator whose state is malformed.  Sets nothing."""
    if not isinstance(state, dict) or "random" not in state:
        raise CheckpointError(where, f"malformed random state: expected a dict with 'random', got "
                                     f"{type(state).__name__}")
    out: dict[str, Any] = {}
    try:
        version, internal, gauss = state["random"]
        value = (version, tuple(internal), gauss)
        random.Random().setstate(value)
        out["random"] = [version, list(internal), gauss]
    except Exception as err:
        raise CheckpointError(where, f"malformed state of the generator 'random': {err}") from None
    if "numpy" in state:
        try:
            out["numpy"] = _checked_numpy_state(state["numpy"])
        except Exception as err:
            raise CheckpointError(where, f"malformed state of numpy's global generator: {err}") from None
    for name in ("torch", "torch_cuda"):
        if name not in state:
            continue
        try:
            out[name] = _checked_torch_state(name, state[name])
        except Exception as err:
            raise CheckpointError(where, f"malformed state of torch's {'CUDA' if '_' in name else 'CPU'} "
                                         f"generator: {err}") from None
    return out


def _checked_numpy_state(value: Any) -> list:
    import numpy as np

    name, keys, pos, has_gauss, cached = value
    keys = np.asarray(keys)
    if keys.shape != (624,) or keys.dtype.kind not in "iu":
        raise ValueError(f"624 integer keys expected, got an array of shape {keys.shape}")
    np.random.RandomState().set_state((name, keys.astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    return [name, keys.astype(np.uint32).tolist(), int(pos), int(has_gauss), float(cached)]


def _checked_torch_state(name: str, value: Any) -> Any:
    """The state of torch's CPU generator (name "torch") as bytes, or of its CUDA ones as a list of bytes.
    Where torch is not imported (a numpy-only run) they are kept as bytes, never imported for it; set, and
    checked by torch, only if the run imports torch by its first step."""
    if name != "torch":
        return [_torch_state_bytes(s) for s in value]
    data = _torch_state_bytes(value)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.Generator().set_state(_torch_tensor(data))
    return data


def _torch_state_bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
        return bytes(value.numpy())
    raise TypeError(f"bytes expected, got {type(value).__name__}")


def _torch_tensor(data: bytes):
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def apply_random(state: dict, owner: Any = None) -> None:
    """Set the global generators to a state from check_random (all of them, or none on an error).  Where
    torch is not imported, its states are set when it is (see the module docstring) while ``owner`` (a
    driver, held weakly) has not finished; with no owner, until the next apply_random."""
    before = capture_random()
    try:
        _set_random(state)
    except BaseException:
        _set_random(before)
        raise
    if "torch" not in sys.modules:
        defer("random", {k: state[k] for k in ("torch", "torch_cuda") if k in state}, owner)


def _set_random(state: dict) -> None:
    version, internal, gauss = state["random"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch = sys.modules.get("torch")
    if torch is not None:
        set_torch_random(torch, state)


def set_torch_random(torch, state: dict) -> None:
    """Set torch's generators (CPU, and CUDA where available) to their parts of a random state."""
    if "torch" in state:
        torch.set_rng_state(_torch_tensor(state["torch"]))
        if "torch_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([_torch_tensor(s) for s in state["torch_cuda"]])


# --------------------------------------------------------------------- settings
def _cudnn(torch) -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


# name -> (getter, setter, whether present); each takes the torch module
SETTINGS: dict[str, tuple] = {
    "torch.threads": (lambda t: t.get_num_threads(), lambda t, v: t.set_num_threads(v), None),
    "torch.deterministic": (lambda t: t.are_deterministic_algorithms_enabled(),
                            lambda t, v: t.use_deterministic_algorithms(
                                v, warn_only=t.is_deterministic_algorithms_warn_only_enabled()), None),
    "torch.deterministic_warn_only": (lambda t: t.is_deterministic_algorithms_warn_only_enabled(),
                                      lambda t, v: t.use_deterministic_algorithms(
                                          t.are_deterministic_algorithms_enabled(), warn_only=v), None),
    "torch.float32_matmul_precision": (lambda t: t.get_float32_matmul_precision(),
                                       lambda t, v: t.set_float32_matmul_precision(v), None),
    "torch.default_dtype": (lambda t: str(t.get_default_dtype()).removeprefix("torch."),
                            lambda t, v: t.set_default_dtype(getattr(t, v)), None),
    "torch.cudnn.enabled": (lambda t: t.backends.cudnn.enabled,
                            lambda t, v: setattr(t.backends.cudnn, "enabled", v), _cudnn),
    "torch.cudnn.benchmark": (lambda t: t.backends.cudnn.benchmark,
                              lambda t, v: setattr(t.backends.cudnn, "benchmark", v), _cudnn),
    "torch.cudnn.deterministic": (lambda t: t.backends.cudnn.deterministic,
                                  lambda t, v: setattr(t.backends.cudnn, "deterministic", v), _cudnn),
    "torch.cudnn.allow_tf32": (lambda t: t.backends.cudnn.allow_tf32,
                               lambda t, v: setattr(t.backends.cudnn, "allow_tf32", v), _cudnn),
    "torch.cuda.matmul.allow_tf32": (lambda t: t.backends.cuda.matmul.allow_tf32,
                                     lambda t, v: setattr(t.backends.cuda.matmul, "allow_tf32", v), _cudnn),
}
_TYPES = {"torch.threads": int, "torch.float32_matmul_precision": str, "torch.default_dtype": str}
_DTYPES = ("float32", "float64", "float16", "bfloat16")
_PRECISIONS = ("highest", "high", "medium")


def capture_settings() -> dict:
    """This process's values of the settings that change results (those of the libraries imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return dict(deferred_part("settings"))  # what torch gets when it is imported
    return {name: get(torch) for name, (get, _, present) in SETTINGS.items() if present is None or present(torch)}


def check_settings(settings: Any, where: Any = "<copy>") -> dict:
    """settings as a dict of known names and well-typed values; a ValueError (CheckpointError when
    where is a file) names the first one that is not."""
    if not isinstance(settings, dict):
        raise _settings_error(where, f"settings must be a dict, got {type(settings).__name__}")
    for name, value in settings.items():
        if name not in SETTINGS:
            raise _settings_error(where, f"unknown setting {name!r}; known: {', '.join(SETTINGS)}")
        kind = _TYPES.get(name, bool)
        if type(value) is not kind or (kind is int and value < 1):
            raise _settings_error(where, f"setting {name!r} must be {'a positive int' if kind is int else kind.__name__}"
                                         f", got {value!r}")
        allowed = {"torch.default_dtype": _DTYPES, "torch.float32_matmul_precision": _PRECISIONS}.get(name)
        if allowed and value not in allowed:
            raise _settings_error(where, f"setting {name!r} must be one of {', '.join(allowed)}, got {value!r}")
    return dict(settings)


def _settings_error(where, reason):
    return CheckpointError(where, reason) if where != "<settings>" else ValueError(reason)


def cores() -> int:
    """The cores this process may run on: the most torch threads a run's settings set."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def apply_settings(settings: dict, announce: bool = True, owner: Any = None) -> dict:
    """Set this process's settings to these; ``torch.threads`` at most this machine's cores.  Where torch is
    not imported, they are set when it is (see the module docstring), while ``owner`` (a driver, held weakly)
    has not finished.  Returns {name: (process's value, run's value)} for the ones that differed (those set
    now); with announce, a SettingsWarning names them before any is set."""
    torch = sys.modules.get("torch")
    if torch is None:
        defer("settings", {"values": dict(settings), "announce": announce} if settings else {}, owner)
        return {}
    if not settings:
        return {}
    changed, capped = {}, ""
    for name, value in settings.items():
        get, put, present = SETTINGS[name]
        if present is not None and not present(torch):
            continue
        if name == "torch.threads" and value > cores():
            capped = f" (torch.threads {value} capped at this machine's {cores()} cores)"
            value = cores()
        old = get(torch)
        if old != value:
            changed[name] = (old, value)
    if changed and announce:
        said = ", ".join(f"{n}={new!r} (this process had {old!r})" for n, (old, new) in changed.items())
        warnings.warn(f"flowvm: resuming with the settings the run was saved with: {said}{capped}. "
                      "drv.resume_with(settings=False) keeps the process's own.", SettingsWarning, stacklevel=4)
    for name, (_, value) in changed.items():
        SETTINGS[name][1](torch, value)
    return changed


# ----------------------------------------------------------------- the process-wide generators
def global_generator(name: str) -> Any:
    """The process-wide generator object named name ("random", "numpy" or "torch")."""
    if name == "random":
        return random._inst
    if name == "torch":
        import torch

        return torch.default_generator
    import numpy as np

    return np.random.mtrand._rand


def global_generator_name(obj: Any) -> str | None:
    """The name global_generator gives obj, when obj is one of the process-wide generators; else None."""
    if obj is random._inst:
        return "random"
    np = sys.modules.get("numpy")
    if np is not None and obj is np.random.mtrand._rand:
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and obj is torch.default_generator:
        return "torch"
    return None


def _set_deferred(torch, deferred: dict) -> None:
    """Set what a copy deferred for torch (flowvm.base.torcharrival), now that torch is imported."""
    if "random" in deferred:
        set_torch_random(torch, deferred["random"])
    if "settings" in deferred:
        apply_settings(deferred["settings"]["values"], announce=deferred["settings"]["announce"])


torcharrival.setting["apply"] = _set_deferred
