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
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from . import storage
from ..base.errors import CheckpointError
from ..base.version import __version__
from .fileformat import Digests
from .headers import check_header
from .pickler import storage_bytes
from .statevalues import numpy_dtype, torch_dtypes

FORMAT = 3
PIECE = 4 << 20  # bytes hashed as one piece of the hash list
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
    local = storage.local_path(path)
    if local is None:
        with storage.open_write(path) as f:
            f.write(save(tensors, metadata=metadata))
        return
    storage.check_target(path)
    storage.write_local_with(Path(local), lambda name: save_file(tensors, name, metadata=metadata), path)


# ====================================================================== checking
def _bytes_of(x: Any) -> memoryview:
    """A byte view of a CPU contiguous tensor or array (no copy)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return memoryview(x.reshape(-1).view(np.uint8))
    n = x.numel() * x.element_size()
    if n == 0:
        return memoryview(b"")
    start = x.storage_offset() * x.element_size()
    return memoryview(storage_bytes(x.untyped_storage())[start: start + n])


def views_of(table: dict, data: dict) -> dict:
    return {name: _bytes_of(data[name]) for name in table}


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
        one = piece_hash(checksum)
        total = sum(len(v) for v in views.values())
        if checksum == SHA and total >= 2 * PIECE and (os.cpu_count() or 1) > 1:
            with ThreadPoolExecutor(min(os.cpu_count() or 1, 16), thread_name_prefix="flowvm-state-hash") as pool:
                futures = {n: [pool.submit(one, p) for p in _pieces(v)] for n, v in views.items()}
                hashed = {n: [f.result() for f in fs] for n, fs in futures.items()}
        else:  # XXH3 hashes at memory speed: threads would cost more than they save
            hashed = {n: [one(p) for p in _pieces(v)] for n, v in views.items()}
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
    local = storage.local_path(path)
    if local is not None:
        return _read_local(str(local), path, key, verify, keep)
    data = storage.read_bytes(path)
    with tempfile.TemporaryDirectory(prefix="flowvm-state-") as tmp:
        name = os.path.join(tmp, "state.safetensors")
        with open(name, "wb") as f:
            f.write(data)
        return _read_local(name, path, key, verify, keep)


def _read_local(name: str, path: Any, key: bytes | None, verify: bool, keep: bool | int) -> Loaded:
    try:
        size = os.path.getsize(name)
    except OSError:
        storage.read_start(path, 1)  # says why, in storage's words
        raise CheckpointError(path, "cannot read the file") from None
    if size == 0:
        raise CheckpointError(path, "empty file, not a flowvm state checkpoint")
    metadata, entries = _safetensors_header(name, size, path)
    names = set(entries)
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
    try:
        table = json.loads(metadata["flowvm.tensors"])
        if type(table) is not dict or not all(type(v) is dict and v.get("kind") in ("numpy", "torch")
                                              for v in table.values()):
            raise ValueError("not a table")
    except (ValueError, RecursionError):
        raise CheckpointError(path, "corrupted: the tensor table cannot be read") from None
    if set(table) != names:
        raise CheckpointError(path, "corrupted: the file's tensors are not those its tensor table lists")
    tensors, views, hashed = _read_tensors(name, path, table, entries, keep, piece_hash(checksum))
    found, mac = digests(metadata, table, views, key, hashed, checksum)
    if not hmac.compare_digest(found.hex(), metadata[checksum]):
        raise CheckpointError(path, "corrupted: checksum mismatch")
    try:
        header = json.loads(metadata["flowvm.header"])
        parts = {p: json.loads(metadata[f"flowvm.{p}"]) for p in PARTS if p not in ("header", "tensors")}
        signed = header["signed"]
        if type(signed) is not bool:
            raise ValueError("signed")
    except (ValueError, KeyError, TypeError, RecursionError):
        raise CheckpointError(path, "corrupted: the metadata cannot be read") from None
    check_header(header, path)
    if key is not None:
        if not signed:
            raise CheckpointError(path, "refused: the file is not signed, but a key was given")
        if mac is None or not hmac.compare_digest(mac.hex(), metadata.get(MAC, "")):
            raise CheckpointError(path, "refused: the signature does not match (tampered file or wrong key)")
    elif signed and verify:
        raise CheckpointError(path, "refused: the file is signed; give its key (key=...), or pass verify=False "
                                    "to load it without checking the signature")
    return Loaded(header, parts, table, tensors)


# safetensors' dtype names -> (numpy's dtype.str, torch's name); None: numpy has no such dtype
_ST_DTYPES = {"BOOL": ("|b1", "bool"), "U8": ("|u1", "uint8"), "I8": ("|i1", "int8"), "I16": ("<i2", "int16"),
              "U16": ("<u2", "uint16"), "I32": ("<i4", "int32"), "U32": ("<u4", "uint32"), "I64": ("<i8", "int64"),
              "U64": ("<u8", "uint64"), "F16": ("<f2", "float16"), "BF16": (None, "bfloat16"),
              "F32": ("<f4", "float32"), "F64": ("<f8", "float64"), "C64": ("<c8", "complex64"),
              "F8_E4M3": (None, "float8_e4m3fn"), "F8_E5M2": (None, "float8_e5m2"),
              "F8_E4M3FNUZ": (None, "float8_e4m3fnuz"), "F8_E5M2FNUZ": (None, "float8_e5m2fnuz")}
MAX_DIMS = 64


def _read_tensors(name: str, path: Any, table: dict, entries: dict, keep: bool | int, one):
    """(tensors as restored or None, their byte views (without keep: their sizes), their pieces' hashes by one).

    Each tensor's dtype and shape, from the file's header, are checked against the table; with keep, it is
    read piece by piece from the file into memory of its own by worker threads (``preadv``: no page faults on
    a mapping of the file, and the new memory's first-touch faults on every core), each piece hashed by the
    thread that read it.  Without keep, the pieces go through one scratch buffer: memory stays bounded
    whatever the file declares."""
    torch_file = any(info["kind"] == "torch" for info in table.values())
    # show (keep: a size): where torch is not imported, torch's tensors are read as numpy arrays, torch never
    # imported (one whose dtype numpy lacks is hashed, not kept, as a large one is)
    as_numpy = torch_file and keep is not True and keep is not False and "torch" not in sys.modules
    import numpy as np

    if torch_file and keep is not False and not as_numpy:
        try:
            import torch  # noqa: F401
        except ImportError:
            raise CheckpointError(path, "holds torch tensors: install torch to load it") from None

    out, views, futures, hashed = {}, {}, {}, {}
    with ThreadPoolExecutor(min(os.cpu_count() or 1, 16), thread_name_prefix="flowvm-state-read") as pool, \
            open(name, "rb", buffering=0) as raw:
        scratch = None if keep is True else memoryview(bytearray(PIECE))
        for tname in sorted(table):
            info = table[tname]
            st_dtype, shape, begin, end = entries[tname]
            try:
                expect = _stored(info, torch_file)
                nbytes = _nbytes(info)
            except Exception as err:
                raise CheckpointError(path, f"corrupted: tensor {tname!r:.80}'s entry in the tensor table cannot be "
                                            f"read ({type(err).__name__}: {str(err)[:120]})") from None
            dtype = _ST_DTYPES[st_dtype]
            by_torch = torch_file and (info["kind"] == "torch" or info.get("raw"))
            got = (dtype[1] if by_torch else dtype[0], shape)
            if got != expect:
                raise CheckpointError(path, f"corrupted: tensor {tname!r:.80} is {got}, its table says {expect}")
            if end - begin != nbytes:
                raise CheckpointError(path, f"corrupted: tensor {tname!r:.80} has {end - begin} bytes in the "
                                            f"file, {nbytes} by its dtype and shape")
            numpy_kind = as_numpy and info["kind"] == "torch"
            readable = not numpy_kind or not info.get("raw") and dtype[0] is not None
            if readable and (keep is True or keep is not False and nbytes <= keep):
                own = np.empty(shape, dtype=dtype[0]) if numpy_kind else _empty(info, torch_file and not as_numpy)
                view = _bytes_of(own)
                futures[tname] = [pool.submit(_read_piece, raw, view[i: i + PIECE], begin + i, one)
                                  for i in range(0, len(view), PIECE)] or [pool.submit(one, view)]
                out[tname] = own
                views[tname] = view
            else:
                try:
                    hashed[tname] = [_read_piece(raw, scratch[: min(PIECE, nbytes - i)], begin + i, one)
                                     for i in range(0, nbytes, PIECE)] or [one(b"")]
                except EOFError:
                    raise CheckpointError(path, "truncated: the file ends inside a tensor's data") from None
                views[tname] = nbytes
        try:
            hashed.update({n: [x.result() for x in fs] for n, fs in futures.items()})
        except EOFError:
            raise CheckpointError(path, "truncated: the file ends inside a tensor's data") from None
    if keep is False:
        return None, views, hashed
    return {n: own if as_numpy and table[n]["kind"] == "torch" else _final(own, table[n], torch_file and not as_numpy)
            for n, own in out.items()}, views, hashed  # once read


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
            dtype, shape, (begin, end) = v["dtype"], v["shape"], v["data_offsets"]
            if dtype not in _ST_DTYPES or type(shape) is not list or len(shape) > MAX_DIMS \
                    or not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError("dtype or shape")
            if not (type(begin) is int and type(end) is int and 0 <= begin <= end <= size - data):
                raise ValueError(f"its data [{begin}, {end}) lies outside the file")
        except (TypeError, KeyError, ValueError) as err:
            raise bad(f"tensor {key!r:.80}: {str(err)[:80]}") from None
        entries[key] = (dtype, shape, data + begin, data + end)
    return metadata, entries


# the bytes of one item of each torch dtype a file may name, known without importing torch (show, sizes)
TORCH_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
                  "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8,
                  "complex128": 16, "complex32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
                  "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "qint8": 1, "quint8": 1, "qint32": 4}


def _itemsize(info: dict) -> int:
    if info["kind"] == "numpy":
        return numpy_dtype(info["dtype"]).itemsize
    size = TORCH_ITEMSIZE.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if size is None:
        raise ValueError(f"unknown torch dtype {info['dtype']!r:.40}")
    return size


def _nbytes(info: dict) -> int:
    count = 1
    for n in info["shape"]:
        count *= n
    return count * _itemsize(info)


def _empty(info: dict, torch_file: bool) -> Any:
    """Memory of its own for a tensor of the table (as safetensors holds it: raw ones as bytes)."""
    import numpy as np

    if torch_file:
        import torch

        dtype = torch.uint8 if info.get("raw") else torch.from_numpy(np.empty(0, numpy_dtype(info["dtype"]))).dtype \
            if info["kind"] == "numpy" else torch_dtypes()[info["dtype"]]
        return torch.empty([_nbytes(info)] if info.get("raw") else info["shape"], dtype=dtype)
    if info.get("raw"):
        return np.empty(_nbytes(info), dtype=np.uint8)
    return np.empty(info["shape"], dtype=numpy_dtype(info["dtype"]))


def _read_piece(raw, view: memoryview, offset: int, one) -> bytes:
    """Read len(view) bytes of raw at offset into view (EOFError if the file ends first); their hash."""
    fd, done = raw.fileno(), 0
    while done < len(view):
        if _preadv is not None:
            n = _preadv(fd, [view[done:]], offset + done)
        else:  # no positional reads (Windows): one reader at a time
            with _seeking:
                raw.seek(offset + done)
                n = raw.readinto(view[done:])
        if not n:
            raise EOFError
        done += n
    return one(view)


_preadv = getattr(os, "preadv", None)
_seeking = threading.Lock()


def _stored(info: dict, torch_file: bool) -> tuple:
    """(dtype, shape) of a table entry as the safetensors tensor holds it."""
    shape = info.get("shape")
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(type(n) is int and 0 <= n < 1 << 62 for n in shape):
        raise ValueError("bad shape in the tensor table")
    if not info.get("raw"):
        return info["dtype"], shape
    count = 1
    for n in shape:
        count *= n
    return ("uint8" if torch_file else "|u1"), [count * _itemsize(info)]


def _final(own: Any, info: dict, torch_file: bool) -> Any:
    """A loaded tensor as the run had it: reinterpreted when raw, a numpy array when it was one."""
    if info["kind"] == "numpy":
        arr = own.numpy() if torch_file else own
        if info.get("raw"):
            arr = arr.view(numpy_dtype(info["dtype"])).reshape(info["shape"])
        if info.get("order") == "F":
            import numpy as np

            arr = np.asfortranarray(arr)
        return arr
    if info.get("raw"):
        return own.view(torch_dtypes()[info["dtype"]]).reshape(info["shape"])
    return own


