"""Checkpoint files: a half-run driver, with the global random states and settings it resumes with.

File layout (all integers big-endian)::

    MAGIC (8 bytes) | header length (4) | header (JSON, UTF-8) | SHA-256 of the bytes so far (32)
    | payload: buffer 0 | buffer 1 | ... | pickle stream
    | SHA-256 of everything before it (32) | HMAC-SHA256 of the same bytes (32, signed files only)

The header records the format version, the flowvm and Python versions that
wrote the file, the payload size, whether it is signed and (format 2) the
buffer table ``"buffers": [[nbytes, kind], ...]``: one entry per buffer, in
file order, kind ``"torch"`` (the bytes of a CPU torch storage) or ``"bytes"``
(any other, e.g. a numpy array's data).  The buffers start the payload, back
to back; the pickle stream (protocol 5) fills the rest, and its NEXT_BUFFER
opcodes take the buffers in order.  Format 1 is the same file without a
buffer table: the whole payload is the pickle stream.  The part up to the
header's own checksum is the same in every format version, so any flowvm can
tell a newer file from a damaged one.  ``load`` checks, in order: the magic,
the header checksum, the format version, the size, the checksum of the whole
file and (with a key) the signature, and only then unpickles anything.

Why buffers: large arrays and tensor storages go "out of band" (PEP 574), so
their bytes never pass through the pickle stream.  Numpy arrays hand the
pickler a ``PickleBuffer`` over their memory at protocol 5; ``flowvm.persist.pickler``
does the same for CPU torch storages (torch's own pickling runs
``torch.save`` into a BytesIO, two copies of the data).  Saving writes each
buffer to the file straight from the object's memory; everything the header
needs (the payload size, the buffer table) is known once the pickler has run,
before anything is written.  Loading checks the header, then reads each
buffer straight into the memory the loaded object will own (a torch storage's
into memory torch allocates, so that it stays resizable) and unpickles with
those buffers: no second copy either way.  Buffers under 64 KiB stay in the
pickle stream.  Both checksums are computed as the bytes go to or come from
the file, never over a concatenated copy; on large files a worker thread does
the hashing (hashlib releases the GIL), so that with a spare core it overlaps
the I/O.

Security: unpickling runs code chosen by whoever wrote the file.  Never load
an unsigned checkpoint from a source you do not trust; pass ``key`` to both
``save`` and ``load`` so that only files signed with that key are accepted.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import platform
import struct
import time
from typing import Any


from . import storage
from .location import Location
from ..base.environment import check_random
from ..base.errors import CheckpointError
from .fileformat import (FORMAT, MAGIC, OUT_OF_BAND_MIN, THREADED_MIN, Digests, Verified, read_file,  # noqa: F401
                         verify_bytes)
from ..base.version import __version__
from .refusals import LiveGraph, copy_refused
from .pickler import CopyWarning, Pickler, Unpickler, check_bytecode, names_in, pickle_bytes  # noqa: F401  (flowvm.persist.checkpoint.CopyWarning)

def _key_bytes(key: bytes | str | None) -> bytes | None:
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise TypeError("key must be non-empty bytes or str")
    return bytes(key)


class _OutOfBand:
    """The buffer_callback of a checkpoint's pickler: takes the large contiguous buffers out of the
    pickle stream (no copy) and remembers them, with their kind, in the order the stream uses them."""

    def __init__(self):
        self.storage_buffers: dict[int, pickle.PickleBuffer] = {}  # the pickler's (see flowvm.persist.pickler)
        self.buffers: list[tuple[memoryview, str]] = []

    def __call__(self, buf: pickle.PickleBuffer):
        try:
            raw = buf.raw()
        except BufferError:  # not contiguous: in the stream, as pickle would write it
            return True
        if raw.nbytes < OUT_OF_BAND_MIN:
            return True
        self.buffers.append((raw, "torch" if id(buf) in self.storage_buffers else "bytes"))
        return False  # out of band


def _payload(driver, path) -> tuple[io.BytesIO, list[tuple[memoryview, str]], str | None]:
    """The driver's pickle stream, its out-of-band buffers (views of the objects' own memory) and the
    Python version of the bytecode it holds (None: none)."""
    stream = io.BytesIO()
    out_of_band = _OutOfBand()
    try:
        pickler = Pickler(stream, protocol=5, buffer_callback=out_of_band)
        # shared: a callback holding the pickler would be a reference cycle through the buffers'
        # memoryviews, which the cyclic garbage collector cannot clear safely
        pickler.storage_buffers = out_of_band.storage_buffers
        pickler.dump({"driver": driver})
    except LiveGraph as err:
        raise copy_refused(err, driver, pickle_bytes, path) from None
    except Exception as err:
        raise copy_refused(err, driver, pickle_bytes, path) from err
    return stream, out_of_band.buffers, pickler.bytecode


def dumps(driver, key: bytes | str | None = None, meta: dict | None = None) -> bytes:
    """The bytes of a checkpoint file for driver (see save)."""
    out = io.BytesIO()
    _write(out, driver, key, "<bytes>", meta)
    return out.getvalue()


def _write(f, driver, key, path, meta=None) -> None:
    """Write the checkpoint file for driver to the binary file f: the header, the out-of-band buffers
    straight from the objects' memory, the pickle stream and the digests, hashed as they go."""
    from ..machine.driver import Driver

    if not isinstance(driver, Driver):
        raise TypeError(f"save expects a flowvm Driver (prog.start()), got {type(driver).__name__}")
    key = _key_bytes(key)
    stream, buffers, bytecode = _payload(driver, path)
    pickled = stream.getbuffer()
    payload_bytes = sum(raw.nbytes for raw, _ in buffers) + pickled.nbytes
    header = json.dumps({
        "format": FORMAT, "flowvm": __version__, "python": platform.python_version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": driver.steps, "done": driver.done,
        "program": driver.program.kind, "payload_bytes": payload_bytes, "signed": key is not None, "meta": meta or {},
        "buffers": [[raw.nbytes, kind] for raw, kind in buffers],
        "settings": driver.copy_environment()["settings"],  # what it resumes with (plain data, for show)
        **({"bytecode": bytecode} if bytecode else {}),  # the Python whose bytecode the payload holds
    }).encode()
    head = MAGIC + struct.pack(">I", len(header)) + header
    head += hashlib.sha256(head).digest()
    threaded = payload_bytes >= THREADED_MIN
    digests = Digests(key, threaded=threaded)
    try:
        for piece in (head, *(raw for raw, _ in buffers), pickled):
            digests.update(piece)
            f.write(piece)
        if threaded:
            _flush_to_disk(f)
        checksum, mac = digests.result()
    except BaseException:
        digests.close(abort=True)
        raise
    f.write(checksum)
    if mac is not None:
        f.write(mac)


def _flush_to_disk(f) -> None:
    """Flush what is written so far of a local file to disk while the digests are still being computed:
    the disk works while the hashing threads do, and the final fsync (storage.open_write's) has only
    the digests left to write."""
    try:
        fd = f.fileno()
    except (AttributeError, OSError, ValueError):  # not a local file (io.UnsupportedOperation is an OSError)
        return
    f.flush()
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:
        os.fsync(fd)


def save(driver, path: str | os.PathLike, key: bytes | str | None = None, meta: dict | None = None):
    """Write driver (with the global random states and settings of this moment) to path atomically;
    sign it with key if given.

    ``meta`` is a JSON-serializable dict stored in the header (read it back
    with read_header without unpickling anything).

    A reader never sees a partly written file under path: the file is written to a temporary file
    beside it, flushed to disk and renamed over path, so a crash leaves either the old or the new file
    (see flowvm.persist.storage).  Large arrays and tensors go to the file from their own memory: saving
    needs little memory beyond the pickle of the rest.
    """
    loc = Location.of(path)
    with storage.open_write(loc) as f:
        _write(f, driver, key, loc.given, meta)
    return loc.saved


def read_header(path: str | os.PathLike, key: bytes | str | None = None) -> dict:
    """The header of a checkpoint file, after checking it is complete and uncorrupted.

    With key, the signature is checked too: only then can the header's ``meta``
    be trusted (it is covered by the signature, not by the checksum alone).
    """
    return read_file(Location.of(path), _key_bytes(key), keep=False).header


def references(path: str | os.PathLike, key: bytes | str | None = None) -> list[tuple[str, str]]:
    """The (module, name) pairs of the classes and functions a checkpoint names, which loading it would
    import and call: read from the checked file without unpickling anything."""
    return sorted(names_in(read_file(Location.of(path), _key_bytes(key), keep=False, keep_stream=True).stream))


def loads(data: bytes, key: bytes | str | None = None, restore_random: bool = True, path: Any = "<bytes>",
          restore_settings: bool = True, verify: bool = True):
    """The driver in checkpoint bytes (see load)."""
    key = _key_bytes(key)
    return _unpickle(verify_bytes(data, path, key), path, key, restore_random, restore_settings, verify)


def _unpickle(checked: Verified, path, key: bytes | None, restore_random: bool, restore_settings: bool,
              verify: bool):
    header = checked.header
    if header["signed"] and key is None and verify:
        raise CheckpointError(path, "refused: the file is signed; give its key (key=...), or pass "
                                    "verify=False to load it without checking the signature")
    check_bytecode(header.get("bytecode"), path)
    buffers = iter(checked.buffers)
    try:
        state = Unpickler(io.BytesIO(checked.stream), buffers=buffers).load()
        if next(buffers, None) is not None:
            raise pickle.UnpicklingError("the buffer table lists more buffers than the pickle stream uses")
    except CheckpointError as err:
        raise CheckpointError(path, err.reason) from None
    except ModuleNotFoundError as err:
        raise CheckpointError(path, f"the saved run needs the module {err.name!r}, which cannot be imported "
                                    f"here: not installed, or not on sys.path (written by flowvm {header.get('flowvm')} on Python "
                                    f"{header.get('python')})") from err
    except Exception as err:
        raise CheckpointError(path, f"cannot unpickle the saved run ({type(err).__name__}: {err}); "
                                    f"it was written by flowvm {header.get('flowvm')} on Python "
                                    f"{header.get('python')}") from err
    from ..machine.driver import Driver

    driver = state.get("driver") if isinstance(state, dict) else None
    if not isinstance(driver, Driver):
        raise CheckpointError(path, f"unpickles to a {type(state).__name__}{' without a driver' if isinstance(state, dict) else ''}"
                                    ": the file holds no flowvm run")
    if driver.saved_environment is None and "rng" in state:  # written before copies carried their own states
        driver.saved_environment = {"random": check_random(state["rng"], path), "settings": {}, "announce": True}
    return driver.resume_with(random=restore_random, settings=restore_settings)


def load(path: str | os.PathLike, key: bytes | str | None = None, restore_random: bool = True,
         restore_settings: bool = True, verify: bool = True):
    """Load a driver saved by save.

    Like every copy of a run, the loaded driver sets the global random generators and the settings that
    change results (see flowvm.base.environment) to those the run was saved with when it takes its first
    step, and says which settings differed from this process's; ``restore_random=False`` or
    ``restore_settings=False`` keeps this process's (``Driver.resume_with`` chooses later).  Loading
    changes nothing in the process.

    With key, the file must carry a valid signature made with that key; it is checked before anything
    is unpickled.  A signed file is refused without its key, unless ``verify=False``.  Loading an
    unsigned file from an untrusted source runs arbitrary code, as with any pickle.
    """
    key, loc = _key_bytes(key), Location.of(path)
    return _unpickle(read_file(loc, key), loc.given, key, restore_random, restore_settings, verify)
