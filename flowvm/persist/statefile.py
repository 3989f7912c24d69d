"""The file side of state checkpoints (flowvm.persist.state): writing a safetensors file atomically, and
reading one back with its checks, in order: safetensors can read it, it has flowvm's metadata, its format,
its tensors are those its table lists (dtype and shape), the checksum, then the signature.

The checksum is a hash of the metadata (but the checksum and the signature themselves) and of the hashes of
every 4 MiB piece of every tensor's bytes, in name order: a hash list, so that the pieces are hashed on every
core, while a save has yet to write (the checksum goes in the header safetensors writes first) and while a load
copies the next pieces.  An unsigned file (format 2 on) uses XXH3-128 (``flowvm.xxh3``): it detects corruption
(truncation, flipped bits) at memory speed, and an unsigned checksum of any kind proves nothing against
someone who rewrites the file, who can compute it again.  A signed file uses SHA-256 (``flowvm.sha256``) and
an HMAC-SHA256 of the same bytes (``flowvm.hmac``), which only the key's holders can compute.  Format 3
saves frames' slots by name (flowvm.persist.state); format 2 files (flowvm 0.3) hold them as lists and format 1
files (flowvm 0.2) hold the SHA-256 checksum; both load as before.  A load copies
every tensor out of the mapped file into memory of its own (allocated as the run's own tensors and arrays
were: the alignment of the data can change the last bits of some kernels' results) and checks the copy, so
that what is restored is what was checked, whatever happens to the file afterwards.

Writing: safetensors writes a temporary file beside its target and renames it (without flushing it to disk),
so a local save gives it a private directory beside the target (named as flowvm.persist.storage names its
temporary files, and removed by the next save of the target when its process was killed), flushes the file,
gives it the permissions of the file it replaces (or those the umask gives a new one), and renames it over
the target.  A URL gets the file's bytes through flowvm.persist.storage.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from . import storage
from .location import Location
from ..base.errors import CheckpointError
from ..base.version import __version__
from .fileformat import Digests
from .headers import check_header
from .statetensors import MAX_DIMS, PIECE, ST_DTYPES, bytes_of, read_tensors

FORMAT = 3
SHA, XXH, MAC = "flowvm.sha256", "flowvm.xxh3", "flowvm.hmac"
PARTS = ("header", "program", "tensors", "objects", "registers", "run", "environment")


def write(path: Any, table: dict, data: dict, metadata: dict) -> None:
    """Write the tensors (name -> CPU tensor or array) and the metadata to path, atomically."""
    import warnings

    if any(info["kind"] == "torch" for info in table.values()):
        import torch
        from safetensors.torch import save, save_file

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.from_numpy of a read-only array warns
            tensors = {n: d if table[n]["kind"] == "torch" else torch.from_numpy(d) for n, d in data.items()}
    else:
        from safetensors.numpy import save, save_file

        tensors = data
    loc = Location.of(path)
    if loc.path is None:
        with storage.open_write(loc) as f:
            f.write(save(tensors, metadata=metadata))
        return
    storage.check_target(loc)
    storage.write_local_with(loc.path, lambda name: save_file(tensors, name, metadata=metadata), loc.given)


# ====================================================================== checking
def views_of(table: dict, data: dict) -> dict:
    return {name: bytes_of(data[name]) for name in table}


def _pieces(view: memoryview) -> list:
    return [view[i: i + PIECE] for i in range(0, len(view), PIECE)] or [view]


def checksum_name(signed: bool) -> str:
    """The metadata key of the checksum a new file gets: SHA-256 when signed, else XXH3-128."""
    return SHA if signed else XXH


def piece_hash(checksum: str):
    """The function hashing one piece of a tensor's bytes for the checksum named checksum."""
    if checksum == SHA:
        return _sha256
    import xxhash

    return xxhash.xxh3_128_digest


def _sha256(view) -> bytes:
    return hashlib.sha256(view).digest()


def digests(metadata: dict, table: dict, views: dict, key: bytes | None, hashed: dict | None = None,
            checksum: str | None = None):
    """(checksum, signature or None) of the metadata and the tensors' bytes (views: name -> bytes;
    hashed: name -> their pieces' hashes, when already computed); checksum: its name (SHA or XXH; by
    default the one checksum_name gives)."""
    checksum = checksum or checksum_name(key is not None)
    if hashed is None:
        hashed = _hash_views(views, checksum)
    parts = [b"flowvm-state\0"]
    for name in sorted(metadata):
        if name not in (SHA, XXH, MAC):
            parts += [_framed(name), _framed(metadata[name])]
    for name in sorted(table):
        view = views[name]
        parts += [_framed(name), struct.pack(">Q", view if type(view) is int else len(view)), *hashed[name]]
    if checksum == XXH:
        return piece_hash(XXH)(b"".join(parts)), None
    digests = Digests(key, threaded=False)
    digests.update(b"".join(parts))
    return digests.result()


def _hash_views(views: dict, checksum: str) -> dict:
    """name -> the hashes of its view's pieces (on every core for SHA-256 and enough bytes)."""
    one = piece_hash(checksum)
    total = sum(len(v) for v in views.values())
    if checksum == SHA and total >= 2 * PIECE and (os.cpu_count() or 1) > 1:
        with ThreadPoolExecutor(min(os.cpu_count() or 1, 16), thread_name_prefix="flowvm-state-hash") as pool:
            futures = {n: [pool.submit(one, p) for p in _pieces(v)] for n, v in views.items()}
            return {n: [f.result() for f in fs] for n, fs in futures.items()}
    return {n: [one(p) for p in _pieces(v)] for n, v in views.items()}  # XXH3: at memory speed, no threads


def _framed(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return struct.pack(">Q", len(data)) + data


class Loaded(NamedTuple):
    """A checked state file: its header, its metadata's parts (parsed), its tensor table and tensors."""

    header: dict
    parts: dict
    table: dict
    tensors: dict | None


def read_state(path: Any, key: bytes | None = None, verify: bool = True, keep: bool | int = True) -> Loaded:
    """Read and check a state file (see the module docstring for the order of the checks); with keep, its
    tensors are copied into memory of their own (else only hashed; keep=N: those of at most N bytes)."""
    loc = Location.of(path)
    if loc.path is not None:
        return _read_local(str(loc.path), loc.given, key, verify, keep)
    data = storage.read_bytes(loc)
    with tempfile.TemporaryDirectory(prefix="flowvm-state-") as tmp:
        name = os.path.join(tmp, "state.safetensors")
        with open(name, "wb") as f:
            f.write(data)
        return _read_local(name, loc.given, key, verify, keep)


def _read_local(name: str, path: Any, key: bytes | None, verify: bool, keep: bool | int) -> Loaded:
    try:
        size = os.path.getsize(name)
    except OSError:
        storage.read_start(path, 1)  # says why, in storage's words
        raise CheckpointError(path, "cannot read the file") from None
    if size == 0:
        raise CheckpointError(path, "empty file, not a flowvm state checkpoint")
    metadata, entries = _safetensors_header(name, size, path)
    checksum = _checksum_of(metadata, path)
    table = _tensor_table(metadata, set(entries), path)
    tensors, views, hashed = read_tensors(name, path, table, entries, keep, piece_hash(checksum))
    found, mac = digests(metadata, table, views, key, hashed, checksum)
    if not hmac.compare_digest(found.hex(), metadata[checksum]):
        raise CheckpointError(path, "corrupted: checksum mismatch")
    header, parts = _parts(metadata, path)
    check_header(header, path)
    _check_signature(header["signed"], mac, metadata, key, verify, path)
    return Loaded(header, parts, table, tensors)


def _checksum_of(metadata: dict, path: Any) -> str:
    """The name of the file's checksum, once its format is one this flowvm reads and its parts are there."""
    if "flowvm.format" not in metadata:
        raise CheckpointError(path, "not a flowvm state checkpoint (a safetensors file without flowvm's metadata)")
    fmt = metadata["flowvm.format"]
    if not (fmt.isascii() and fmt.isdigit() and len(fmt) < 10) or int(fmt) < 1:
        raise CheckpointError(path, f"corrupted: unknown format {fmt!r:.20}")
    if int(fmt) > FORMAT:
        raise CheckpointError(path, f"written in state format {fmt}; this flowvm (version {__version__}) reads "
                                    f"formats up to {FORMAT}: upgrade flowvm to load it")
    missing = [p for p in PARTS if f"flowvm.{p}" not in metadata]
    checksum = SHA if SHA in metadata or int(fmt) == 1 else XXH
    if missing or checksum not in metadata:
        raise CheckpointError(path, f"corrupted: the metadata lacks {', '.join(missing) or 'the checksum'}")
    return checksum


def _tensor_table(metadata: dict, names: set, path: Any) -> dict:
    """The tensor table, which must list the file's tensors (names), no more, no fewer."""
    try:
        table = json.loads(metadata["flowvm.tensors"])
        if type(table) is not dict or not all(type(v) is dict and v.get("kind") in ("numpy", "torch")
                                              for v in table.values()):
            raise ValueError("not a table")
    except (ValueError, RecursionError):
        raise CheckpointError(path, "corrupted: the tensor table cannot be read") from None
    if set(table) != names:
        raise CheckpointError(path, "corrupted: the file's tensors are not those its tensor table lists")
    return table


def _parts(metadata: dict, path: Any) -> tuple[dict, dict]:
    """(header, the other parts by name) parsed (after the checksum matched)."""
    try:
        header = json.loads(metadata["flowvm.header"])
        parts = {p: json.loads(metadata[f"flowvm.{p}"]) for p in PARTS if p not in ("header", "tensors")}
        if type(header["signed"]) is not bool:
            raise ValueError("signed")
    except (ValueError, KeyError, TypeError, RecursionError):
        raise CheckpointError(path, "corrupted: the metadata cannot be read") from None
    return header, parts


def _check_signature(signed: bool, mac: bytes | None, metadata: dict, key: bytes | None, verify: bool,
                     path: Any) -> None:
    if key is not None:
        if not signed:
            raise CheckpointError(path, "refused: the file is not signed, but a key was given")
        if mac is None or not hmac.compare_digest(mac.hex(), metadata.get(MAC, "")):
            raise CheckpointError(path, "refused: the signature does not match (tampered file or wrong key)")
    elif signed and verify:
        raise CheckpointError(path, "refused: the file is signed; give its key (key=...), or pass verify=False "
                                    "to load it without checking the signature")


MAX_HEADER = 100_000_000  # bytes of a safetensors header, at most (safetensors' own limit)


def _safetensors_header(name: str, size: int, path: Any) -> tuple[dict, dict]:
    """(metadata, name -> (dtype, shape, begin, end) with the offsets from the file's start) of a safetensors
    file of size bytes, each size checked against the file's before anything is allocated by it."""
    bad = (lambda why: CheckpointError(path, f"truncated or corrupted: not a safetensors file flowvm reads ({why})"))
    with open(name, "rb", buffering=0) as f:
        first = f.read(8)
        if len(first) < 8:
            raise bad(f"{size} bytes")
        (n,) = struct.unpack("<Q", first)
        if n > min(size - 8, MAX_HEADER):
            raise bad(f"a header of {n} bytes in a file of {size}")
        text = f.read(n)
    try:
        header = json.loads(text)
        if type(header) is not dict:
            raise ValueError("the header is not an object")
        metadata = header.pop("__metadata__", None) or {}
        if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
            raise ValueError("its metadata is not an object of strings")
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise bad(str(err)[:120]) from None
    entries, data = {}, 8 + n
    for key, v in header.items():
        try:
            dtype, shape, begin, end = _entry(v, size - data)
        except (TypeError, KeyError, ValueError) as err:
            raise bad(f"tensor {key!r:.80}: {str(err)[:80]}") from None
        entries[key] = (dtype, shape, data + begin, data + end)
    return metadata, entries


def _entry(v: Any, room: int) -> tuple:
    """(dtype, shape, begin, end) of a tensor's entry in a safetensors header, its data within room bytes."""
    dtype, shape, (begin, end) = v["dtype"], v["shape"], v["data_offsets"]
    if dtype not in ST_DTYPES or type(shape) is not list or len(shape) > MAX_DIMS \
            or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError("dtype or shape")
    if not (type(begin) is int and type(end) is int and 0 <= begin <= end <= room):
        raise ValueError(f"its data [{begin}, {end}) lies outside the file")
    return dtype, shape, begin, end
