"""Checkpoint files: a half-run driver plus the global random-number states.

File layout (all integers big-endian)::

    MAGIC (8 bytes) | header length (4) | header (JSON, UTF-8) | payload (pickle)
    | SHA-256 of everything before it (32) | HMAC-SHA256 of the same bytes (32, signed files only)

The header records the format version, the flowvm and Python versions that
wrote the file, the payload size and whether it is signed.  ``load`` checks,
in order: the magic, the header, the format version, the size, the checksum
and (with a key) the signature, and only then unpickles anything.

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
import struct
import sys
import tempfile
import time
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


def _payload(driver, path) -> bytes:
    try:
        return cloudpickle.dumps({"driver": driver, "rng": capture_rng()}, protocol=pickle.HIGHEST_PROTOCOL)
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
    body = MAGIC + struct.pack(">I", len(header)) + header + payload
    out = body + hashlib.sha256(body).digest()
    if key is not None:
        out += hmac.new(key, body, hashlib.sha256).digest()
    return out


def save(driver, path: str | os.PathLike, key: bytes | str | None = None, meta: dict | None = None) -> Path:
    """Write driver (and the global RNG states) to path atomically; sign it with key if given.

    ``meta`` is a JSON-serializable dict stored in the header (read it back
    with read_header without unpickling anything).

    The file is written to a temporary file beside path, flushed to disk and
    renamed over path, so a crash leaves either the old or the new file.
    """
    path = Path(path)
    data = _encode(driver, key, path, meta)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
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


def read_header(path: str | os.PathLike) -> dict:
    """The header of a checkpoint file, after checking it is complete and uncorrupted."""
    data = Path(path).read_bytes()
    header, _ = _check(data, path, None)
    return header


def _check(data: bytes, path, key: bytes | None) -> tuple[dict, bytes]:
    if len(data) < len(MAGIC) + 4:
        if MAGIC.startswith(data[: len(MAGIC)]):
            raise CheckpointError(path, f"truncated: only {len(data)} bytes")
        raise CheckpointError(path, "not a flowvm checkpoint (no flowvm magic header)")
    if data[: len(MAGIC)] != MAGIC:
        raise CheckpointError(path, "not a flowvm checkpoint (no flowvm magic header)")
    (hlen,) = struct.unpack(">I", data[len(MAGIC): len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if start + hlen > len(data):
        raise CheckpointError(path, f"truncated or corrupted: header of {hlen} bytes runs past the end of the file")
    try:
        header = json.loads(data[start: start + hlen].decode())
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
    body_end = start + hlen + nbytes
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
    return header, data[start + hlen: body_end]


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
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(path, "no such file") from None
    except IsADirectoryError:
        raise CheckpointError(path, "is a directory, not a checkpoint file") from None
    return loads(data, key, restore_random, path)
