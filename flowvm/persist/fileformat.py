"""The checkpoint file format's constants and its reading side: checking a file (magic, header checksum,
format, size, checksum, signature, in that order, before anything is unpickled) and reading its buffers
straight into the memory the loaded objects will own; ``Digests`` hashes as the bytes go by, for the writer
(flowvm.persist.checkpoint) too.  The layout is described in flowvm/persist/checkpoint.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import queue
import stat
import struct
import sys
import threading
from typing import Any, NamedTuple

from . import storage
from .location import Location
from ..base.errors import CheckpointError
from .headers import check_header
from .pickler import storage_bytes

MAGIC = b"FLOWVM\x89\n"
FORMAT = 2
DIGEST = 32
# Buffers smaller than this stay in the pickle stream: a table entry and a
# separate read cost more than copying them.
OUT_OF_BAND_MIN = 64 * 1024
# Files with at least this many payload bytes are hashed on worker threads.
THREADED_MIN = 8 << 20
# Reads go in pieces of this size, so that hashing one overlaps reading the next.
CHUNK = 4 << 20
BUFFER_KINDS = ("torch", "bytes")



class Digests:
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


class Layout(NamedTuple):
    """Where things are in a checkpoint file, from its (checked) header."""

    header: dict
    head: bytes  # the file's bytes up to the payload: magic, header, header checksum
    buffers: list  # [(nbytes, kind)], in file order, at the start of the payload
    pickle_bytes: int  # the pickle stream's size; it ends the payload
    body_end: int  # where the payload ends and the checksum starts
    size: int  # the file's size


class Verified(NamedTuple):
    """A checked file: its header, its pickle stream and its out-of-band buffers (None if not kept)."""

    header: dict
    stream: Any
    buffers: list | None


def _check_head(fetch, total: int, path) -> Layout:
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
    if head_end + DIGEST > total:
        raise CheckpointError(path, f"truncated or corrupted: a header of {hlen} bytes does not fit in "
                                    f"{total} bytes")
    head = bytes(fetch(head_end + DIGEST))
    if not hmac.compare_digest(hashlib.sha256(head[:head_end]).digest(), head[head_end:]):
        raise CheckpointError(path, "corrupted: header checksum mismatch")
    header, fmt, nbytes, signed = _read_header(head[start: head_end], path)
    buffers = _buffer_table(header, path) if fmt >= 2 else []
    in_buffers = sum(n for n, _ in buffers)
    if in_buffers > nbytes:
        raise CheckpointError(path, f"corrupted: the buffer table ({in_buffers} bytes) does not fit in the "
                                    f"payload ({nbytes} bytes)")
    body_end = head_end + DIGEST + nbytes
    expected = body_end + DIGEST * (2 if signed else 1)
    if total < expected:
        raise CheckpointError(path, f"truncated: {total} bytes, expected {expected}")
    if total > expected:
        raise CheckpointError(path, f"corrupted: {total - expected} unexpected bytes at the end")
    return Layout(header, head, buffers, nbytes - in_buffers, body_end, total)


def _read_header(text: bytes, path) -> tuple[dict, int, int, bool]:
    """(header, format, payload bytes, signed) of a header whose checksum matched, in a format this flowvm
    reads."""
    try:
        header = json.loads(text.decode())
        fmt = header["format"]
        nbytes = header["payload_bytes"]
        signed = header["signed"]
        if not isinstance(fmt, int) or not isinstance(nbytes, int) or not isinstance(signed, bool) or nbytes < 0:
            raise ValueError("bad field types")
    except Exception:
        raise CheckpointError(path, "corrupted: the header cannot be read") from None
    check_header(header, path)
    if fmt > FORMAT:
        raise CheckpointError(path, f"written in format {fmt} by flowvm {header.get('flowvm')}; this flowvm "
                                    f"reads formats up to {FORMAT}: upgrade flowvm to load it")
    if fmt < 1:
        raise CheckpointError(path, f"corrupted: unknown format {fmt}")
    return header, fmt, nbytes, signed


def _buffer_table(header: dict, path) -> list[tuple[int, str]]:
    try:
        table = header["buffers"]
        buffers = [(n, kind) for n, kind in table]
        if not all(type(n) is int and n >= 0 and kind in BUFFER_KINDS for n, kind in buffers):
            raise ValueError("bad buffer entry")
    except Exception:
        raise CheckpointError(path, "corrupted: the header's buffer table cannot be read") from None
    return buffers


def _check_digests(layout: Layout, checksum: bytes, mac: bytes | None, trailer, key: bytes | None, path) -> None:
    """The last checks, in order: the checksum of the whole file, then (with a key) the signature."""
    if not hmac.compare_digest(checksum, bytes(trailer[:DIGEST])):
        raise CheckpointError(path, "corrupted: checksum mismatch")
    if key is not None:
        if not layout.header["signed"]:
            raise CheckpointError(path, "refused: the file is not signed, but a key was given")
        if not hmac.compare_digest(mac, bytes(trailer[DIGEST:])):
            raise CheckpointError(path, "refused: the signature does not match (tampered file or wrong key)")


def _mac_key(layout: Layout, key: bytes | None) -> bytes | None:
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


def verify_bytes(data, path, key: bytes | None, keep: bool = True, keep_stream: bool = False) -> Verified:
    """Check checkpoint bytes held in memory; with keep, copy the buffers out (the objects loaded
    must own writable memory, not views of the caller's bytes)."""
    mv = memoryview(data).cast("B")
    layout = _check_head(lambda n: mv[:n], len(mv), path)
    mac_key = _mac_key(layout, key)
    # in memory there is no I/O to overlap: threads only let the signature and the checksum run together
    digests = Digests(mac_key, threaded=mac_key is not None and layout.body_end >= THREADED_MIN)
    try:
        digests.update(mv[:layout.body_end])
        checksum, mac = digests.result()
    except BaseException:
        digests.close(abort=True)
        raise
    _check_digests(layout, checksum, mac, mv[layout.body_end:], key, path)
    if not keep:
        stream_start = len(layout.head) + sum(n for n, _ in layout.buffers)
        return Verified(layout.header, bytes(mv[stream_start: layout.body_end]) if keep_stream else None, None)
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
    return Verified(layout.header, stream, buffers)


def read_file(path, key: bytes | None, keep: bool = True, keep_stream: bool = False) -> Verified:
    """Read and check a checkpoint file (path: a path, a URL or a Location).

    A local file is read in one pass, straight into the memory the loaded objects will own, and hashed
    as it is read (see Digests); the header is checked before the rest is read.  Other targets are
    read whole through flowvm.persist.storage, then checked in memory.  With keep=False the payload is hashed
    and dropped (read_header)."""
    loc = Location.of(path)
    if loc.path is None:
        return verify_bytes(storage.read_bytes(loc), loc.given, key, keep, keep_stream)
    try:
        f = open(loc.path, "rb")
    except OSError:  # storage says what is wrong, in its own words
        return verify_bytes(storage.read_bytes(loc), loc.given, key, keep, keep_stream)
    with f:
        try:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):  # a pipe or a device: no size to plan the reads with
                return verify_bytes(f.read(), loc.given, key, keep, keep_stream)
            return _read_open_file(f, st.st_size, loc.given, key, keep, keep_stream)
        except OSError as err:
            raise CheckpointError(loc.given, f"cannot read: {err.strerror or err}") from err


def _read_open_file(f, total: int, path, key: bytes | None, keep: bool, keep_stream: bool = False) -> Verified:
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
    threaded = keep and layout.body_end >= THREADED_MIN
    scratch = None if keep else memoryview(bytearray(min(CHUNK, max(layout.body_end - len(layout.head), 1))))
    digests = Digests(mac_key, threaded=threaded)
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
    return Verified(layout.header, stream, buffers if keep else None)


def _read_into(f, view: memoryview | None, nbytes: int, scratch: memoryview | None, digests: Digests, path):
    """Read the next nbytes of f into view (or, without one, piece by piece into scratch), hashing each
    piece once it is read."""
    pos = 0
    while pos < nbytes:
        piece = (view[pos: pos + CHUNK] if view is not None else scratch[: min(len(scratch), nbytes - pos)])
        got = f.readinto(piece)
        if not got:
            raise CheckpointError(path, "truncated: the file shrank while being read")
        digests.update(piece[:got])
        pos += got
