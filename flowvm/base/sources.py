"""``.npy`` shards as one array source of ``Batches``: local files memory-mapped, files behind an fsspec URL
copied once into a local cache and memory-mapped there.

``NpyShards(paths)`` joins the shards along their first dimension; it pickles
as its paths (the files are opened again where it is loaded: a worker process,
a resumed run), so a checkpoint never holds the data.  A path may be a glob
(``data/x-*.npy``, ``s3://bucket/x-*.npy``: the matches, sorted).
"""

from __future__ import annotations

import glob
import os
from typing import Any, Sequence

import numpy as np

__all__ = ["NpyShards", "is_shard_list", "open_files", "rebuild_with"]


def _is_url(path: str) -> bool:
    return "://" in path or "::" in path


def is_shard_list(source: Any) -> bool:
    """Whether source names .npy files: a path (str or os.PathLike) or a list of them, each ending in .npy."""
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source).endswith(".npy")
    return isinstance(source, list) and bool(source) and all(
        isinstance(p, (str, os.PathLike)) and os.fspath(p).endswith(".npy") for p in source)


def _expand(path: str) -> list[str]:
    if not glob.has_magic(path):
        return [path]
    if _is_url(path):
        import fsspec

        fs, pattern = fsspec.core.url_to_fs(path)
        found = sorted(fs.unstrip_protocol(p) for p in fs.glob(pattern))
    else:
        found = sorted(glob.glob(path))
    if not found:
        raise FileNotFoundError(f"Batches: no .npy file matches {path!r}")
    return found


def _open(path: str) -> np.ndarray:
    """A shard's array, memory-mapped (a URL's file is copied into a local cache first)."""
    local = path
    if _is_url(path) and not path.startswith("file://"):
        import fsspec

        local = fsspec.open_local(path if "::" in path else f"simplecache::{path}")
    elif path.startswith("file://"):
        local = path[len("file://"):]
    try:
        arr = np.load(local, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise type(err)(f"Batches: cannot read the .npy shard {path!r}: {err}") from err
    if arr.ndim == 0:
        raise ValueError(f"Batches: the .npy shard {path!r} holds a 0-dimensional array; it needs a first "
                         "(sample) dimension")
    return arr


_rebuilder: list = [None]  # NpyShards under a stable name (Batches._open_shards, set by data.py)


def rebuild_with(fn) -> None:
    """The function a pickled NpyShards names to open its files again (it calls NpyShards(paths))."""
    _rebuilder[0] = fn


class NpyShards:
    """Rows of several .npy files, joined along the first dimension, read through memory maps."""

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike]):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [p for path in paths for p in _expand(os.fspath(path))]
        if not self.paths:
            raise ValueError("Batches: an empty list of .npy shards")
        arrays = self._arrays()
        first = arrays[0]
        for path, arr in zip(self.paths, arrays):
            if arr.shape[1:] != first.shape[1:] or arr.dtype != first.dtype:
                raise ValueError(f"Batches: the .npy shard {path!r} holds {arr.dtype}{list(arr.shape[1:])} rows, "
                                 f"the shard {self.paths[0]!r} {first.dtype}{list(first.shape[1:])} rows")
        self.ends = np.cumsum([len(a) for a in arrays])
        self.shape = (int(self.ends[-1]),) + tuple(first.shape[1:])
        self.dtype = first.dtype

    def _arrays(self) -> list[np.ndarray]:
        arrays = self.__dict__.get("_maps")
        if arrays is None:
            arrays = self.__dict__["_maps"] = [_open(p) for p in self.paths]
        return arrays

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.take_rows(np.array([i]))[0]

    def take_rows(self, idx: np.ndarray) -> np.ndarray:
        """The rows at idx (global row numbers), copied out of the maps into one array."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.shape[0]):
            raise IndexError(f"Batches: row {int(idx.max() if idx.max() >= self.shape[0] else idx.min())} is "
                             f"outside the {self.shape[0]} rows of {len(self.paths)} .npy shards")
        out = np.empty((len(idx),) + self.shape[1:], dtype=self.dtype)
        shard = np.searchsorted(self.ends, idx, side="right")
        starts = np.concatenate([[0], self.ends[:-1]])
        arrays = self._arrays()
        for s in np.unique(shard):
            mask = shard == s
            out[mask] = arrays[s][idx[mask] - starts[s]]
        return out

    def __reduce__(self):
        return (_rebuilder[0] or NpyShards), (self.paths,)  # the files, opened again where loaded

    def __repr__(self) -> str:
        return f"<NpyShards: {len(self.paths)} .npy files, {self.shape[0]} rows of {self.dtype}{list(self.shape[1:])}>"


def open_files(source: Any) -> Any:
    """A Batches source with its .npy files (a path, a glob, a URL or a list of them, alone or as an item of
    a tuple or dict) opened as shards; anything else as it is."""
    if is_shard_list(source):
        return NpyShards(source)
    if isinstance(source, tuple):
        return tuple(NpyShards(s) if is_shard_list(s) else s for s in source)
    if isinstance(source, dict):
        return {k: NpyShards(s) if is_shard_list(s) else s for k, s in source.items()}
    return source
