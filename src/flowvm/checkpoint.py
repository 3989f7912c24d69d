"""Checkpoint files: a half-run driver plus the global random-number states.

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
pickler a ``PickleBuffer`` over their memory at protocol 5; ``flowvm.pickler``
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
import hmac
import io
import json
import os
import pickle
import platform
import queue
import stat
import struct
import sys
import threading
import time
from typing import Any, NamedTuple

import cloudpickle

from . import storage
from .environment import check_random
from .errors import CheckpointError
from .version import __version__
from .pickler import CopyWarning, Pickler, Unpickler, check_bytecode, names_in, storage_bytes  # noqa: F401  (flowvm.checkpoint.CopyWarning)

MAGIC = b"FLOWVM\x89\n"
FORMAT = 2
_DIGEST = 32
# Buffers smaller than this stay in the pickle stream: a table entry and a
# separate read cost more than copying them.
_OUT_OF_BAND_MIN = 64 * 1024
# Files with at least this many payload bytes are hashed on worker threads.
_THREADED_MIN = 8 << 20
# Reads go in pieces of this size, so that hashing one overlaps reading the next.
_CHUNK = 4 << 20
_BUFFER_KINDS = ("torch", "bytes")


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
        self.storage_buffers: dict[int, pickle.PickleBuffer] = {}  # the pickler's (see flowvm.pickler)
        self.buffers: list[tuple[memoryview, str]] = []

    def __call__(self, buf: pickle.PickleBuffer):
        try:
            raw = buf.raw()
        except BufferError:  # not contiguous: in the stream, as pickle would write it
            return True
        if raw.nbytes < _OUT_OF_BAND_MIN:
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
    except Exception as err:
        culprit = ""
        for name, value in dict(driver.registers).items():
            try:
                cloudpickle.dumps(value)
            except Exception:
                culprit = f" register {name!r} holds an unpicklable {type(value).__name__};"
                break
        raise CheckpointError(path, f"cannot pickle the driver:{culprit} {type(err).__name__}: {err}") from err
    return stream, out_of_band.buffers, pickler.bytecode


class _Digests:
    """SHA-256 and (with a key) HMAC-SHA256 of a stream of bytes.

    Threaded, each digest is updated on its own worker thread, in the order the pieces were given;
    hashlib releases the GIL while it hashes, so that, given a spare core, hashing runs alongside the
    caller's file I/O (and the checksum alongside the signature).  The pieces are memoryviews, not
    copies: the caller must leave their memory unchanged until result() or close() returns.
    """

    def __init__(self, key: bytes | None, threaded: bool):
        self._hashes = [hashlib.sha256()]
        if key is not None:
            self._hashes.append(hmac.new(key, digestmod=hashlib.sha256))
        self._queues: list[queue.SimpleQueue] = []
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._abort = False
        if threaded:
            for h in self._hashes:
                q: queue.SimpleQueue = queue.SimpleQueue()
                t = threading.Thread(target=self._work, args=(h, q), name="flowvm-checkpoint-hash", daemon=True)
                t.start()
                self._queues.append(q)
                self._threads.append(t)

    def update(self, data) -> None:
        if self._queues:
            for q in self._queues:
                q.put(data)
        else:
            for h in self._hashes:
                h.update(data)

    def result(self) -> tuple[bytes, bytes | None]:
        """(the SHA-256 digest, the HMAC or None)."""
        self.close()
        if self._error is not None:
            raise self._error
        digests = [h.digest() for h in self._hashes]
        return digests[0], (digests[1] if len(digests) > 1 else None)

    def close(self, abort: bool = False) -> None:
        """Stop the workers (at once with abort, else once they have hashed everything given)."""
        self._abort = self._abort or abort
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        self._queues, self._threads = [], []

    def _work(self, h, q: queue.SimpleQueue) -> None:
        while (data := q.get()) is not None:
            if self._abort or self._error is not None:
                continue
            try:
                h.update(data)
            except BaseException as err:  # re-raised by result()
                self._error = err


def dumps(driver, key: bytes | str | None = None, meta: dict | None = None) -> bytes:
    """The bytes of a checkpoint file for driver (see save)."""
    out = io.BytesIO()
    _write(out, driver, key, "<bytes>", meta)
    return out.getvalue()


def _write(f, driver, key, path, meta=None) -> None:
    """Write the checkpoint file for driver to the binary file f: the header, the out-of-band buffers
    straight from the objects' memory, the pickle stream and the digests, hashed as they go."""
    from .driver import Driver

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
        "settings": driver._resume_for_copy()["settings"],  # what it resumes with (plain data, for show)
        **({"bytecode": bytecode} if bytecode else {}),  # the Python whose bytecode the payload holds
    }).encode()
    head = MAGIC + struct.pack(">I", len(header)) + header
    head += hashlib.sha256(head).digest()
    threaded = payload_bytes >= _THREADED_MIN
    digests = _Digests(key, threaded=threaded)
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
    (see flowvm.storage).  Large arrays and tensors go to the file from their own memory: saving
    needs little memory beyond the pickle of the rest.
    """
    with storage.open_write(path) as f:
        _write(f, driver, key, path, meta)
    return storage.saved_location(path)


def read_header(path: str | os.PathLike, key: bytes | str | None = None) -> dict:
    """The header of a checkpoint file, after checking it is complete and uncorrupted.

    With key, the signature is checked too: only then can the header's ``meta``
    be trusted (it is covered by the signature, not by the checksum alone).
    """
    return _read(path, _key_bytes(key), keep=False).header


def references(path: str | os.PathLike, key: bytes | str | None = None) -> list[tuple[str, str]]:
    """The (module, name) pairs of the classes and functions a checkpoint names, which loading it would
    import and call: read from the checked file without unpickling anything."""
    return sorted(names_in(_read(path, _key_bytes(key), keep=False, keep_stream=True).stream))


class _Layout(NamedTuple):
    """Where things are in a checkpoint file, from its (checked) header."""

    header: dict
    head: bytes  # the file's bytes up to the payload: magic, header, header checksum
    buffers: list  # [(nbytes, kind)], in file order, at the start of the payload
    pickle_bytes: int  # the pickle stream's size; it ends the payload
    body_end: int  # where the payload ends and the checksum starts
    size: int  # the file's size


class _Verified(NamedTuple):
    """A checked file: its header, its pickle stream and its out-of-band buffers (None if not kept)."""

    header: dict
    stream: Any
    buffers: list | None


def _check_head(fetch, total: int, path) -> _Layout:
    """The layout of a file of total bytes, after the checks that need its first bytes only (in order:
    the magic, the header checksum, the format version, the size); fetch(n) returns its first
    min(n, total) bytes."""
    if total == 0:
        raise CheckpointError(path, "empty file, not a flowvm checkpoint")
    start = len(MAGIC) + 4
    first = fetch(start)
    if first[: len(MAGIC)] != MAGIC[: len(first)]:
        raise CheckpointError(path, "not a flowvm checkpoint (no flowvm magic header)")
    if total < start:
        raise CheckpointError(path, f"truncated: only {total} bytes")
    (hlen,) = struct.unpack(">I", first[len(MAGIC): start])
    head_end = start + hlen
    if head_end + _DIGEST > total:
        raise CheckpointError(path, f"truncated or corrupted: a header of {hlen} bytes does not fit in "
                                    f"{total} bytes")
    head = bytes(fetch(head_end + _DIGEST))
    if not hmac.compare_digest(hashlib.sha256(head[:head_end]).digest(), head[head_end:]):
        raise CheckpointError(path, "corrupted: header checksum mismatch")
    try:
        header = json.loads(head[start: head_end].decode())
        fmt = header["format"]
        nbytes = header["payload_bytes"]
        signed = header["signed"]
        if not isinstance(fmt, int) or not isinstance(nbytes, int) or not isinstance(signed, bool) or nbytes < 0:
            raise ValueError("bad field types")
    except Exception:
        raise CheckpointError(path, "corrupted: the header cannot be read") from None
    if fmt > FORMAT:
        raise CheckpointError(path, f"written in format {fmt} by flowvm {header.get('flowvm')}; this flowvm "
                                    f"reads formats up to {FORMAT}: upgrade flowvm to load it")
    if fmt < 1:
        raise CheckpointError(path, f"corrupted: unknown format {fmt}")
    buffers = _buffer_table(header, path) if fmt >= 2 else []
    in_buffers = sum(n for n, _ in buffers)
    if in_buffers > nbytes:
        raise CheckpointError(path, f"corrupted: the buffer table ({in_buffers} bytes) does not fit in the "
                                    f"payload ({nbytes} bytes)")
    body_end = head_end + _DIGEST + nbytes
    expected = body_end + _DIGEST * (2 if signed else 1)
    if total < expected:
        raise CheckpointError(path, f"truncated: {total} bytes, expected {expected}")
    if total > expected:
        raise CheckpointError(path, f"corrupted: {total - expected} unexpected bytes at the end")
    return _Layout(header, head, buffers, nbytes - in_buffers, body_end, total)


def _buffer_table(header: dict, path) -> list[tuple[int, str]]:
    try:
        table = header["buffers"]
        buffers = [(n, kind) for n, kind in table]
        if not all(type(n) is int and n >= 0 and kind in _BUFFER_KINDS for n, kind in buffers):
            raise ValueError("bad buffer entry")
    except Exception:
        raise CheckpointError(path, "corrupted: the header's buffer table cannot be read") from None
    return buffers


def _check_digests(layout: _Layout, checksum: bytes, mac: bytes | None, trailer, key: bytes | None, path) -> None:
    """The last checks, in order: the checksum of the whole file, then (with a key) the signature."""
    if not hmac.compare_digest(checksum, bytes(trailer[:_DIGEST])):
        raise CheckpointError(path, "corrupted: checksum mismatch")
    if key is not None:
        if not layout.header["signed"]:
            raise CheckpointError(path, "refused: the file is not signed, but a key was given")
        if not hmac.compare_digest(mac, bytes(trailer[_DIGEST:])):
            raise CheckpointError(path, "refused: the signature does not match (tampered file or wrong key)")


def _mac_key(layout: _Layout, key: bytes | None) -> bytes | None:
    # The signature is computed only where it will be checked.
    return key if key is not None and layout.header["signed"] else None


def _new_buffer(nbytes: int, kind: str):
    """(what the unpickler gets for a buffer, a writable byte view of its memory), uninitialised.

    A torch storage's bytes go into a new UntypedStorage, which becomes the loaded one (allocated by
    torch, so it can be resized as any other); other buffers into a numpy byte array (no zero-filling
    pass, unlike a bytearray)."""
    import numpy as np

    if kind == "torch":
        try:
            import torch
        except ImportError:  # the unpickler names the missing module
            pass
        else:
            # (not torch.empty: with deterministic algorithms on, it fills the memory first)
            s = torch.UntypedStorage(nbytes, device="cpu")
            _advise_huge_pages(s.data_ptr(), nbytes)
            return s, memoryview(storage_bytes(s))
    view = memoryview(np.empty(nbytes, dtype=np.uint8))
    return view, view


_MADV_HUGEPAGE = 14  # Linux, x86-64 and arm64
_HUGE_PAGE = 2 << 20
_madvise: Any = None


def _advise_huge_pages(address: int, nbytes: int) -> None:
    """Ask Linux to back the whole 2 MiB pages of fresh memory [address, address + nbytes) with
    transparent huge pages, as numpy does for its large arrays: reading a file into the memory then
    takes one page fault per 2 MiB instead of one per 4 KiB, and the faults of fresh 4 KiB pages cost
    more than the copy from the page cache.  A hint: where it is not available it does nothing."""
    global _madvise
    if nbytes < 2 * _HUGE_PAGE:
        return
    if _madvise is None:
        _madvise = False
        if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
                _madvise = fn
            except (OSError, AttributeError):
                pass
    if _madvise:
        start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
        end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if end > start:
            _madvise(start, end - start, _MADV_HUGEPAGE)  # an error (e.g. EINVAL) just leaves 4 KiB pages


def _verify_bytes(data, path, key: bytes | None, keep: bool = True, keep_stream: bool = False) -> _Verified:
    """Check checkpoint bytes held in memory; with keep, copy the buffers out (the objects loaded
    must own writable memory, not views of the caller's bytes)."""
    mv = memoryview(data).cast("B")
    layout = _check_head(lambda n: mv[:n], len(mv), path)
    mac_key = _mac_key(layout, key)
    # in memory there is no I/O to overlap: threads only let the signature and the checksum run together
    digests = _Digests(mac_key, threaded=mac_key is not None and layout.body_end >= _THREADED_MIN)
    try:
        digests.update(mv[:layout.body_end])
        checksum, mac = digests.result()
    except BaseException:
        digests.close(abort=True)
        raise
    _check_digests(layout, checksum, mac, mv[layout.body_end:], key, path)
    if not keep:
        stream_start = len(layout.head) + sum(n for n, _ in layout.buffers)
        return _Verified(layout.header, bytes(mv[stream_start: layout.body_end]) if keep_stream else None, None)
    pos = len(layout.head)
    buffers = []
    for n, kind in layout.buffers:
        obj, view = _new_buffer(n, kind)
        view[:] = mv[pos: pos + n]
        buffers.append(obj)
        pos += n
    stream = mv[pos: layout.body_end]
    if not isinstance(data, bytes):  # a mutable buffer could change under the unpickler
        stream = bytes(stream)
    return _Verified(layout.header, stream, buffers)


def _local_file(target) -> str | bytes | None:
    """target as a local file name, or None for a target storage handles otherwise (a URL)."""
    if isinstance(target, str) and "://" in target:
        return None
    if isinstance(target, (str, bytes, os.PathLike)):
        return os.fspath(target)
    return None


def _read(path, key: bytes | None, keep: bool = True, keep_stream: bool = False) -> _Verified:
    """Read and check a checkpoint file.

    A local file is read in one pass, straight into the memory the loaded objects will own, and hashed
    as it is read (see _Digests); the header is checked before the rest is read.  Other targets are
    read whole through flowvm.storage, then checked in memory.  With keep=False the payload is hashed
    and dropped (read_header)."""
    name = _local_file(path)
    if name is None:
        return _verify_bytes(storage.read_bytes(path), path, key, keep, keep_stream)
    try:
        f = open(name, "rb")
    except OSError:  # storage says what is wrong, in its own words
        return _verify_bytes(storage.read_bytes(path), path, key, keep, keep_stream)
    with f:
        try:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):  # a pipe or a device: no size to plan the reads with
                return _verify_bytes(f.read(), path, key, keep, keep_stream)
            return _read_open_file(f, st.st_size, path, key, keep, keep_stream)
        except OSError as err:
            raise CheckpointError(path, f"cannot read: {err.strerror or err}") from err


def _read_open_file(f, total: int, path, key: bytes | None, keep: bool, keep_stream: bool = False) -> _Verified:
    prefix = bytearray()

    def fetch(n):
        n = min(n, total)
        while len(prefix) < n:
            more = f.read(n - len(prefix))
            if not more:
                raise CheckpointError(path, f"truncated: the file shrank to {len(prefix)} bytes while being read")
            prefix.extend(more)
        return bytes(prefix[:n])

    layout = _check_head(fetch, total, path)
    f.seek(len(layout.head))
    mac_key = _mac_key(layout, key)
    # read_header keeps nothing: one scratch piece, reused, so no threads (they would still be hashing it)
    threaded = keep and layout.body_end >= _THREADED_MIN
    scratch = None if keep else memoryview(bytearray(min(_CHUNK, max(layout.body_end - len(layout.head), 1))))
    digests = _Digests(mac_key, threaded=threaded)
    try:
        digests.update(layout.head)
        buffers = []
        for n, kind in layout.buffers:
            if keep:
                obj, view = _new_buffer(n, kind)
                buffers.append(obj)
            else:
                view = None
            _read_into(f, view, n, scratch, digests, path)
        if keep or keep_stream:
            stream, view = _new_buffer(layout.pickle_bytes, "bytes")
        else:
            stream = view = None
        _read_into(f, view, layout.pickle_bytes, scratch, digests, path)
        checksum, mac = digests.result()
    except BaseException:
        digests.close(abort=True)
        raise
    trailer = f.read(layout.size - layout.body_end)
    if len(trailer) < layout.size - layout.body_end:
        raise CheckpointError(path, "truncated: the file shrank while being read")
    _check_digests(layout, checksum, mac, trailer, key, path)
    return _Verified(layout.header, stream, buffers if keep else None)


def _read_into(f, view: memoryview | None, nbytes: int, scratch: memoryview | None, digests: _Digests, path):
    """Read the next nbytes of f into view (or, without one, piece by piece into scratch), hashing each
    piece once it is read."""
    pos = 0
    while pos < nbytes:
        piece = (view[pos: pos + _CHUNK] if view is not None else scratch[: min(len(scratch), nbytes - pos)])
        got = f.readinto(piece)
        if not got:
            raise CheckpointError(path, "truncated: the file shrank while being read")
        digests.update(piece[:got])
        pos += got


def loads(data: bytes, key: bytes | str | None = None, restore_random: bool = True, path: Any = "<bytes>",
          restore_settings: bool = True, verify: bool = True):
    """The driver in checkpoint bytes (see load)."""
    key = _key_bytes(key)
    return _unpickle(_verify_bytes(data, path, key), path, key, restore_random, restore_settings, verify)


def _unpickle(checked: _Verified, path, key: bytes | None, restore_random: bool, restore_settings: bool,
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
    from .driver import Driver

    driver = state.get("driver") if isinstance(state, dict) else None
    if not isinstance(driver, Driver):
        raise CheckpointError(path, f"unpickles to a {type(state).__name__}{' without a driver' if isinstance(state, dict) else ''}"
                                    ": the file holds no flowvm run")
    if driver._resume is None and "rng" in state:  # written before copies carried their own states
        driver._resume = {"random": check_random(state["rng"], path), "settings": {}, "announce": True}
    return driver.resume_with(random=restore_random, settings=restore_settings)


def load(path: str | os.PathLike, key: bytes | str | None = None, restore_random: bool = True,
         restore_settings: bool = True, verify: bool = True):
    """Load a driver saved by save.

    Like every copy of a run, the loaded driver sets the global random generators and the settings that
    change results (see flowvm.environment) to those the run was saved with when it takes its first
    step, and says which settings differed from this process's; ``restore_random=False`` or
    ``restore_settings=False`` keeps this process's (``Driver.resume_with`` chooses later).  Loading
    changes nothing in the process.

    With key, the file must carry a valid signature made with that key; it is checked before anything
    is unpickled.  A signed file is refused without its key, unless ``verify=False``.  Loading an
    unsigned file from an untrusted source runs arbitrary code, as with any pickle.
    """
    key = _key_bytes(key)
    return _unpickle(_read(path, key), path, key, restore_random, restore_settings, verify)
