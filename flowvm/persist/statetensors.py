"""Reading a state file's tensors (flowvm.persist.statefile): each tensor's entry in the file checked against
the tensor table, then read piece by piece into memory of its own by worker threads and hashed as it is
read (or, when not kept, only hashed through one scratch buffer); and the tables of dtypes both sides name."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..base.errors import CheckpointError
from .pickler import storage_bytes
from .statevalues import numpy_dtype, torch_dtypes

PIECE = 4 << 20  # bytes hashed as one piece of the hash list

# safetensors' dtype names -> (numpy's dtype.str, torch's name); None: numpy has no such dtype
ST_DTYPES = {"BOOL": ("|b1", "bool"), "U8": ("|u1", "uint8"), "I8": ("|i1", "int8"), "I16": ("<i2", "int16"),
              "U16": ("<u2", "uint16"), "I32": ("<i4", "int32"), "U32": ("<u4", "uint32"), "I64": ("<i8", "int64"),
              "U64": ("<u8", "uint64"), "F16": ("<f2", "float16"), "BF16": (None, "bfloat16"),
              "F32": ("<f4", "float32"), "F64": ("<f8", "float64"), "C64": ("<c8", "complex64"),
              "F8_E4M3": (None, "float8_e4m3fn"), "F8_E5M2": (None, "float8_e5m2"),
              "F8_E4M3FNUZ": (None, "float8_e4m3fnuz"), "F8_E5M2FNUZ": (None, "float8_e5m2fnuz")}
MAX_DIMS = 64



def bytes_of(x: Any) -> memoryview:
    """A byte view of a CPU contiguous tensor or array (no copy)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return memoryview(x.reshape(-1).view(np.uint8))
    n = x.numel() * x.element_size()
    if n == 0:
        return memoryview(b"")
    start = x.storage_offset() * x.element_size()
    return memoryview(storage_bytes(x.untyped_storage())[start: start + n])


def _check_entry(tname: str, info: dict, entry: tuple, torch_file: bool, path: Any) -> tuple[tuple, int, int]:
    """(the dtype pair of its safetensors dtype, where its data begins, its byte count) of a tensor whose entry
    in the file (dtype, shape, offsets) is checked against its entry in the tensor table."""
    st_dtype, shape, begin, end = entry
    try:
        expect = _stored(info, torch_file)
        nbytes = _nbytes(info)
    except Exception as err:
        raise CheckpointError(path, f"corrupted: tensor {tname!r:.80}'s entry in the tensor table cannot be "
                                    f"read ({type(err).__name__}: {str(err)[:120]})") from None
    dtype = ST_DTYPES[st_dtype]
    by_torch = torch_file and (info["kind"] == "torch" or info.get("raw"))
    got = (dtype[1] if by_torch else dtype[0], shape)
    if got != expect:
        raise CheckpointError(path, f"corrupted: tensor {tname!r:.80} is {got}, its table says {expect}")
    if end - begin != nbytes:
        raise CheckpointError(path, f"corrupted: tensor {tname!r:.80} has {end - begin} bytes in the "
                                    f"file, {nbytes} by its dtype and shape")
    return dtype, begin, nbytes


def _as_numpy(torch_file: bool, keep: bool | int, path: Any) -> bool:
    """Whether torch's tensors are read as numpy arrays: for show (keep: a size) where torch is not imported,
    torch is never imported (one whose dtype numpy lacks is hashed, not kept, as a large one is).  Otherwise a
    file of torch tensors needs torch to be kept."""
    as_numpy = torch_file and keep is not True and keep is not False and "torch" not in sys.modules
    if torch_file and keep is not False and not as_numpy:
        try:
            import torch  # noqa: F401
        except ImportError:
            raise CheckpointError(path, "holds torch tensors: install torch to load it") from None
    return as_numpy


def _hash_pieces(raw, scratch: memoryview, begin: int, nbytes: int, one, path: Any) -> list:
    """The hashes of a tensor's pieces read through scratch (nothing kept)."""
    try:
        return [_read_piece(raw, scratch[: min(PIECE, nbytes - i)], begin + i, one)
                for i in range(0, nbytes, PIECE)] or [one(b"")]
    except EOFError:
        raise CheckpointError(path, "truncated: the file ends inside a tensor's data") from None


def read_tensors(name: str, path: Any, table: dict, entries: dict, keep: bool | int, one):
    """(tensors as restored or None, their byte views (without keep: their sizes), their pieces' hashes by one).

    Each tensor's dtype and shape, from the file's header, are checked against the table; with keep, it is
    read piece by piece from the file into memory of its own by worker threads (``preadv``: no page faults on
    a mapping of the file, and the new memory's first-touch faults on every core), each piece hashed by the
    thread that read it.  Without keep, the pieces go through one scratch buffer: memory stays bounded
    whatever the file declares."""
    torch_file = any(info["kind"] == "torch" for info in table.values())
    reading = _Reading(path, keep, one, torch_file, _as_numpy(torch_file, keep, path))
    with ThreadPoolExecutor(min(os.cpu_count() or 1, 16), thread_name_prefix="flowvm-state-read") as pool, \
            open(name, "rb", buffering=0) as raw:
        for tname in sorted(table):
            reading.add(pool, raw, tname, table[tname], entries[tname])
        try:
            reading.hashed.update({n: [x.result() for x in fs] for n, fs in reading.futures.items()})
        except EOFError:
            raise CheckpointError(path, "truncated: the file ends inside a tensor's data") from None
    if keep is False:
        return None, reading.views, reading.hashed
    as_torch = torch_file and not reading.as_numpy
    return {n: own if reading.as_numpy and table[n]["kind"] == "torch" else _final(own, table[n], as_torch)
            for n, own in reading.out.items()}, reading.views, reading.hashed  # once read


class _Reading:
    """The tensors of one file being read: those kept (out, with their views and the futures of their
    pieces' hashes) and those only hashed (hashed, their sizes in views)."""

    def __init__(self, path: Any, keep: bool | int, one, torch_file: bool, as_numpy: bool):
        self.path, self.keep, self.one, self.torch_file, self.as_numpy = path, keep, one, torch_file, as_numpy
        self.out: dict = {}
        self.views: dict = {}
        self.futures: dict = {}
        self.hashed: dict = {}
        self.scratch = None if keep is True else memoryview(bytearray(PIECE))

    def add(self, pool, raw, tname: str, info: dict, entry: tuple) -> None:
        import numpy as np

        dtype, begin, nbytes = _check_entry(tname, info, entry, self.torch_file, self.path)
        keep = self.keep
        numpy_kind = self.as_numpy and info["kind"] == "torch"
        readable = not numpy_kind or not info.get("raw") and dtype[0] is not None
        if not (readable and (keep is True or keep is not False and nbytes <= keep)):
            self.hashed[tname] = _hash_pieces(raw, self.scratch, begin, nbytes, self.one, self.path)
            self.views[tname] = nbytes
            return
        own = np.empty(entry[1], dtype=dtype[0]) if numpy_kind else \
            _empty(info, self.torch_file and not self.as_numpy)
        view = bytes_of(own)
        self.futures[tname] = [pool.submit(_read_piece, raw, view[i: i + PIECE], begin + i, self.one)
                               for i in range(0, len(view), PIECE)] or [pool.submit(self.one, view)]
        self.out[tname], self.views[tname] = own, view


# the bytes of one item of each torch dtype a file may name, known without importing torch (show, sizes)
TORCH_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
                  "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8,
                  "complex128": 16, "complex32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
                  "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "qint8": 1, "quint8": 1, "qint32": 4}


def itemsize(info: dict) -> int:
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
    return count * itemsize(info)


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
    return ("uint8" if torch_file else "|u1"), [count * itemsize(info)]


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


