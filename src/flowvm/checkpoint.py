"""Checkpoint files: a half-run driver plus the global random-number states.

File layout (all integers big-endian)::

    MAGIC (8 bytes) | header length (4) | header (JSON, UTF-8) | SHA-256 of the bytes so far (32)
    | payload (pickle)
    | SHA-256 of everything before it (32) | HMAC-SHA256 of the same bytes (32, signed files only)

The header records the format version, the flowvm and Python versions that
wrote the file, the payload size and whether it is signed.  The part up to
the header's own checksum is the same in every format version, so any
flowvm can tell a newer file from a damaged one.  ``load`` checks, in order:
the magic, the header checksum, the format version, the size, the checksum
of the whole file and (with a key) the signature, and only then unpickles
anything.

Security: unpickling runs code chosen by whoever wrote the file.  Never load
an unsigned checkpoint from a source you do not trust; pass ``key`` to both
``save`` and ``load`` so that only files signed with that key are accepted.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import pickle
import platform
import random
import secrets
import stat
import struct
import sys
import time
import types
import warnings
import weakref
from pathlib import Path
from typing import Any

import cloudpickle

from .errors import CheckpointError

MAGIC = b"FLOWVM\x89\n"
FORMAT = 1
_DIGEST = 32


def capture_rng() -> dict:
    """The global random states of ``random``, numpy and torch (those imported)."""
    state: dict[str, Any] = {"random": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Set the global random states captured by capture_rng."""
    random.setstate(state["random"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
        if "torch_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["torch_cuda"])


def _key_bytes(key: bytes | str | None) -> bytes | None:
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise TypeError("key must be non-empty bytes or str")
    return bytes(key)


def global_generator(name: str) -> Any:
    """The process-wide generator object named name ("random", "numpy" or "torch")."""
    if name == "random":
        return random._inst
    if name == "torch":
        import torch

        return torch.default_generator
    import numpy as np

    return np.random.mtrand._rand


def _global_generator_name(obj: Any) -> str | None:
    if obj is random._inst:
        return "random"
    np = sys.modules.get("numpy")
    if np is not None and obj is np.random.mtrand._rand:
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and obj is torch.default_generator:
        return "torch"
    return None


class _WithoutGrad:
    """Pickles as its tensor would, leaving out the tensor's .grad."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __reduce_ex__(self, protocol):
        return self.tensor.__reduce_ex__(protocol)


def with_grad(tensor, grad):
    tensor.grad = grad
    return tensor


def _set_lbfgs_state(opt, state) -> None:
    opt.__setstate__(state)
    opt._params = opt.param_groups[0]["params"]
    opt._numel_cache = None


def rebuild_driver(state: dict):
    from .driver import _DRIVERS, Driver

    drv = Driver.__new__(Driver)
    drv.__dict__.update(state)
    _DRIVERS.add(drv)
    return drv


class _Pickler(cloudpickle.Pickler):
    """How every copy of a driver is made (pickle, cloudpickle, deepcopy, checkpoints):
    cloudpickle (lambdas and closures by value) plus two rules that exact resume needs.

    - The global generators behind random.random, np.random.rand, ... are written
      as references wherever they occur (in a partial, as an argument, as a
      register's value).  By value, a loaded program would draw from private
      copies, out of step with the restored global generators.
    - A leaf tensor's .grad is kept (torch's own pickling drops it), so a run cut
      between backward() and the optimizer's step() resumes exactly.
    """

    def __init__(self, file, protocol=None, buffer_callback=None):
        # cloudpickle's table is a ChainMap, looked up (in Python) for every
        # object; the same entries in a plain dict cost a C lookup.  The C
        # pickler reads the table when it is initialised.
        self.dispatch_table = dict(cloudpickle.Pickler.dispatch_table)
        super().__init__(file, protocol=protocol, buffer_callback=buffer_callback)

    def reducer_override(self, obj):
        # Called for every object written: keep the common case (elements,
        # containers, plain values) to a type lookup.
        t = type(obj)
        try:
            rule = _RULES[t]
        except KeyError:
            rule = _RULES[t] = _rule_for(t)
        if rule is not None:
            reduced = rule(obj)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


def _rule_for(t: type):
    """The special reduction for objects of type t, or None (decided once per type)."""
    from .driver import Driver

    if t is Driver:
        return lambda drv: (rebuild_driver, (drv.__getstate__(),))
    if issubclass(t, random.Random) or (t.__module__ or "").startswith("numpy.random"):
        return _reduce_generator
    if t is types.FunctionType:
        return _reduce_patched_method
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(t, torch.Tensor):
        return _reduce_tensor
    if torch is not None and t is torch.Generator:
        return _reduce_generator
    if torch is not None and issubclass(t, torch.optim.LBFGS):
        return _reduce_lbfgs
    if torch is not None and issubclass(t, torch.optim.Optimizer):
        return _reduce_optimizer
    return None


_RULES: dict = {}


def _reduce_generator(obj):
    name = _global_generator_name(obj)
    return (global_generator, (name,)) if name is not None else NotImplemented


def _reduce_tensor(obj):
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


class CopyWarning(UserWarning):
    """A copy of a run (pickle, checkpoint) leaves out something the run uses."""


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
    return func, args, state, None, None, _set_lbfgs_state


def pickle_bytes(obj: Any) -> bytes:
    """obj pickled as in a checkpoint (cloudpickle, global generators by reference)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def load_driver_bytes(data: bytes):
    return pickle.loads(data)


def _payload(driver, path) -> bytes:
    try:
        return pickle_bytes({"driver": driver, "rng": capture_rng()})
    except Exception as err:
        culprit = ""
        for name, value in dict(driver.registers).items():
            try:
                cloudpickle.dumps(value)
            except Exception:
                culprit = f" register {name!r} holds an unpicklable {type(value).__name__};"
                break
        raise CheckpointError(path, f"cannot pickle the driver:{culprit} {type(err).__name__}: {err}") from err


def dumps(driver, key: bytes | str | None = None, meta: dict | None = None) -> bytes:
    """The bytes of a checkpoint file for driver (see save)."""
    return _encode(driver, key, "<bytes>", meta)


def _encode(driver, key, path, meta=None) -> bytes:
    from . import __version__
    from .driver import Driver

    if not isinstance(driver, Driver):
        raise TypeError(f"save expects a flowvm Driver (prog.start()), got {type(driver).__name__}")
    key = _key_bytes(key)
    payload = _payload(driver, path)
    header = json.dumps({
        "format": FORMAT, "flowvm": __version__, "python": platform.python_version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": driver.steps, "done": driver.done,
        "program": driver.program.kind, "payload_bytes": len(payload), "signed": key is not None, "meta": meta or {},
    }).encode()
    head = MAGIC + struct.pack(">I", len(header)) + header
    body = head + hashlib.sha256(head).digest() + payload
    out = body + hashlib.sha256(body).digest()
    if key is not None:
        out += hmac.new(key, body, hashlib.sha256).digest()
    return out


def _remove_orphaned_temporaries(path: Path) -> None:
    """Remove temporary files that saves of path left behind when their process was killed mid-save
    (their names carry the saving process's id; those of live processes are left alone)."""
    prefix, suffix = f".{path.name}.", ".tmp"
    try:
        names = [n for n in os.listdir(path.parent) if n.startswith(prefix) and n.endswith(suffix)]
    except OSError:
        return
    for name in names:
        pid_text = name[len(prefix):-len(suffix)].partition("-")[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # alive (or another user's): perhaps saving right now
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.unlink(path.parent / name)
        except OSError:
            pass


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new temporary file beside path, with the permissions path has (a new file: those the umask
    gives, as open() would), to be renamed over it."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = None
    _remove_orphaned_temporaries(path)
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
        except FileExistsError:
            continue
        if mode is not None:
            os.fchmod(fd, mode)
        return fd, tmp
    raise FileExistsError(f"no free temporary name beside {path}")


def save(driver, path: str | os.PathLike, key: bytes | str | None = None, meta: dict | None = None) -> Path:
    """Write driver (and the global RNG states) to path atomically; sign it with key if given.

    ``meta`` is a JSON-serializable dict stored in the header (read it back
    with read_header without unpickling anything).

    The file is written to a temporary file beside path, flushed to disk and
    renamed over path, so a crash leaves either the old or the new file.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise CheckpointError(path, "is a directory; give a file name to save to")
    if not directory.is_dir():
        raise CheckpointError(path, f"cannot save: no directory {directory}")
    data = _encode(driver, key, path, meta)
    try:
        fd, tmp = _create_temporary(path)
    except OSError as err:
        raise CheckpointError(path, f"cannot save: {err.strerror or err} in {directory}") from err
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return path


def read_header(path: str | os.PathLike, key: bytes | str | None = None) -> dict:
    """The header of a checkpoint file, after checking it is complete and uncorrupted.

    With key, the signature is checked too: only then can the header's ``meta``
    be trusted (it is covered by the signature, not by the checksum alone).
    """
    header, _ = _check(_read(path), path, _key_bytes(key))
    return header


def _read(path) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(path, "no such file") from None
    except IsADirectoryError:
        raise CheckpointError(path, "is a directory, not a checkpoint file") from None
    except PermissionError:
        raise CheckpointError(path, "permission denied") from None


def _check(data: bytes, path, key: bytes | None) -> tuple[dict, bytes]:
    if not data:
        raise CheckpointError(path, "empty file, not a flowvm checkpoint")
    if data[: len(MAGIC)] != MAGIC[: len(data)]:
        raise CheckpointError(path, "not a flowvm checkpoint (no flowvm magic header)")
    start = len(MAGIC) + 4
    if len(data) < start:
        raise CheckpointError(path, f"truncated: only {len(data)} bytes")
    (hlen,) = struct.unpack(">I", data[len(MAGIC): start])
    head_end = start + hlen
    if head_end + _DIGEST > len(data):
        raise CheckpointError(path, f"truncated or corrupted: a header of {hlen} bytes does not fit in "
                                    f"{len(data)} bytes")
    if not hmac.compare_digest(hashlib.sha256(data[:head_end]).digest(), data[head_end: head_end + _DIGEST]):
        raise CheckpointError(path, "corrupted: header checksum mismatch")
    try:
        header = json.loads(data[start: head_end].decode())
        fmt = header["format"]
        nbytes = header["payload_bytes"]
        signed = header["signed"]
        if not isinstance(fmt, int) or not isinstance(nbytes, int) or not isinstance(signed, bool):
            raise ValueError("bad field types")
    except Exception:
        raise CheckpointError(path, "corrupted: the header cannot be read") from None
    if fmt > FORMAT:
        raise CheckpointError(path, f"written in format {fmt} by flowvm {header.get('flowvm')}; this flowvm "
                                    f"reads formats up to {FORMAT}: upgrade flowvm to load it")
    if fmt < 1:
        raise CheckpointError(path, f"corrupted: unknown format {fmt}")
    payload_start = head_end + _DIGEST
    body_end = payload_start + nbytes
    expected = body_end + _DIGEST * (2 if signed else 1)
    if len(data) < expected:
        raise CheckpointError(path, f"truncated: {len(data)} bytes, expected {expected}")
    if len(data) > expected:
        raise CheckpointError(path, f"corrupted: {len(data) - expected} unexpected bytes at the end")
    body = data[:body_end]
    if not hmac.compare_digest(hashlib.sha256(body).digest(), data[body_end: body_end + _DIGEST]):
        raise CheckpointError(path, "corrupted: checksum mismatch")
    if key is not None:
        if not signed:
            raise CheckpointError(path, "refused: the file is not signed, but a key was given")
        mac = hmac.new(key, body, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, data[body_end + _DIGEST:]):
            raise CheckpointError(path, "refused: the signature does not match (tampered file or wrong key)")
    return header, data[payload_start: body_end]


def loads(data: bytes, key: bytes | str | None = None, restore_random: bool = True, path: Any = "<bytes>"):
    """The driver in checkpoint bytes (see load)."""
    header, payload = _check(data, path, _key_bytes(key))
    try:
        state = pickle.load(io.BytesIO(payload))
        driver, rng = state["driver"], state["rng"]
    except Exception as err:
        raise CheckpointError(path, f"cannot unpickle the saved run ({type(err).__name__}: {err}); "
                                    f"it was written by flowvm {header.get('flowvm')} on Python "
                                    f"{header.get('python')}") from err
    from .driver import Driver

    if not isinstance(driver, Driver) or not isinstance(rng, dict) or "random" not in rng:
        raise CheckpointError(path, f"holds a {type(driver).__name__}, not a saved flowvm run")
    if restore_random:
        restore_rng(rng)
    return driver


def load(path: str | os.PathLike, key: bytes | str | None = None, restore_random: bool = True):
    """Load a driver saved by save; also restore the global RNG states (unless restore_random=False).

    With key, the file must carry a valid signature made with that key; it is
    checked before anything is unpickled.  Without key, a signed file is
    loaded after its checksum is checked.  Loading an unsigned file from an
    untrusted source runs arbitrary code, as with any pickle.
    """
    return loads(_read(path), key, restore_random, path)
