"""A user's data set, for the bundled programs: arrays, tensors, (x, y) pairs, torch Datasets and files
(.npy, .npz, .csv), checked before a run starts.

``load_data(data)`` returns a ``Data``: ``x`` (a 2-d float array: one row per sample), ``y`` (integer labels
0..C-1, or None) and ``source`` (where it came from, for messages).  Bad data raises ``DataError`` naming the
file, row or column: NaN or infinite values, ragged rows, a non-numeric column, labels that are not integers
0..C-1.  Rows, columns and a file's lines are counted from 1 in these messages, as an editor or a spreadsheet
shows them.

A ``.npy`` file is memory-mapped, not read: its ``x`` is a ``FileArray``, which a checkpoint (or any pickle)
stores as a reference to the file (its path, size and a digest of its header and first and last blocks),
checked when the run is loaded again, instead of a copy of the data.
"""

from __future__ import annotations

import csv
import hashlib
import os
import zipfile
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError
from ..pickled import stable

__all__ = ["Data", "DataError", "FileArray", "load_data"]

BLOCK = 1 << 20  # the bytes of each end of a file that its digest covers


class Data:
    """Samples ``x`` (n x d floats), labels ``y`` (n ints in 0..C-1) or None, and where they came from;
    ``classes_``: the classes' names when the labels were text (a CSV's ``setosa``, ...: class i is
    ``classes_[i]``, in sorted order), else None."""

    classes_ = None

    def __init__(self, x: np.ndarray, y: np.ndarray | None, source: str, classes_: np.ndarray | None = None):
        self.x, self.y, self.source = x, y, source
        if classes_ is not None:
            self.classes_ = classes_

    @property
    def classes(self) -> int:
        return 0 if self.y is None else int(self.y.max()) + 1

    def __len__(self) -> int:
        return len(self.x)

    def split(self, fraction: float, seed: int = 0) -> tuple["Data", "Data | None"]:
        """(train, held out): a seeded shuffle's last ``fraction`` of the samples held out (None for 0)."""
        if not 0 <= fraction < 1:
            raise DataError(f"{self.source}: val_fraction must be in [0, 1), got {fraction!r}")
        n_val = int(round(len(self.x) * fraction))
        if n_val == 0:
            return self, None
        order = np.random.default_rng(seed).permutation(len(self.x))
        train, val = order[:-n_val], order[-n_val:]
        pick = (lambda a, i: None if a is None else np.asarray(a)[np.sort(i)])
        return (Data(pick(self.x, train), pick(self.y, train), f"{self.source} (training split)", self.classes_),
                Data(pick(self.x, val), pick(self.y, val), f"{self.source} (held-out split)", self.classes_))


def _digest(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(BLOCK))
        if size > BLOCK:
            f.seek(max(size - BLOCK, BLOCK))
            h.update(f.read(BLOCK))
    return h.hexdigest()


class FileArray(np.memmap):
    """A memory-mapped ``.npy`` file that pickles as a reference to the file, checked when unpickled."""

    def __reduce_ex__(self, protocol):
        ref = getattr(self, "_flowvm_file", None)
        if ref is None or self.shape != ref[3] or not self.flags.c_contiguous:  # a slice or a copy: its data
            return np.asarray(self).copy().__reduce_ex__(protocol)
        return open_file_array, ref


@stable("flowvm.pickled")
def open_file_array(path: str, size: int, digest: str, shape: tuple) -> FileArray:
    """Map the file a FileArray was made from again, once it is checked to be the same file."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{path}: the data file the run was saved with is missing (it is referenced, not copied)")
    if p.stat().st_size != size or _digest(p) != digest:
        raise DataError(f"{path}: the data file changed since the run was saved (its size or its contents "
                        "differ); restore the original file to resume")
    return _map(p, digest)


def _map(path: Path, digest: str | None = None) -> FileArray:
    raw = _load_numpy(path, ".npy file", mmap_mode="r")
    arr = raw.view(FileArray)
    arr._mmap = getattr(raw, "_mmap", None)  # keep the mapping alive with the view
    size = path.stat().st_size
    arr._flowvm_file = (str(path.resolve()), size, digest or _digest(path), tuple(raw.shape))
    return arr


def _check_finite(x: np.ndarray, source: str) -> None:
    bad = ~np.isfinite(x)
    if bad.any():
        row, col = np.argwhere(bad)[0] if x.ndim == 2 else (int(np.argwhere(bad)[0][0]), 0)
        raise DataError(f"{source}: row {int(row) + 1}, column {int(col) + 1} holds {x[row, col] if x.ndim == 2 else x[row]} "
                        "(NaN and infinite values are not allowed)")


def _as_samples(x: Any, source: str) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu().numpy()
    try:
        arr = x if isinstance(x, np.ndarray) else np.asarray(x)
    except ValueError as err:  # ragged nested lists
        raise DataError(f"{source}: rows of different lengths ({err})") from None
    if arr.dtype == object:
        raise DataError(f"{source}: rows of different lengths or values that are not numbers")
    if arr.ndim == 1:
        arr = arr[:, None]
    elif arr.ndim > 2:
        arr = arr.reshape(len(arr), -1)  # images and the like: one flat row per sample
    if arr.ndim != 2 or len(arr) == 0:
        raise DataError(f"{source}: no samples (shape {arr.shape})")
    if not np.issubdtype(arr.dtype, np.number) and arr.dtype != bool:
        raise DataError(f"{source}: values of type {arr.dtype} are not numbers")
    if not isinstance(arr, FileArray):
        arr = np.ascontiguousarray(arr, dtype=np.float64)
    _check_finite(arr if isinstance(arr, FileArray) else arr, source)
    return arr


def _labels(y: Any, n: int, source: str) -> np.ndarray:
    if type(y).__module__.startswith("torch"):
        y = y.detach().cpu().numpy()
    y = np.asarray(y)
    if y.ndim != 1 or len(y) != n:
        raise DataError(f"{source}: {n} samples but labels of shape {y.shape}")
    if y.dtype.kind == "f":
        if not np.isfinite(y).all() or (y != np.round(y)).any():
            row = int(np.argwhere(~np.isfinite(y) | (y != np.round(y)))[0][0])
            raise DataError(f"{source}: label of row {row + 1} is {y[row].item()!r}, not an integer class 0..C-1")
    elif y.dtype.kind not in "iub":
        raise DataError(f"{source}: labels of type {y.dtype} are not integer classes 0..C-1")
    y = y.astype(np.int64)
    if (y < 0).any():
        row = int(np.argwhere(y < 0)[0][0])
        raise DataError(f"{source}: label of row {row + 1} is {y[row]}, not a class 0..C-1")
    missing = sorted(set(range(int(y.max()) + 1)) - set(np.unique(y).tolist()))
    if missing:
        raise DataError(f"{source}: labels must be the classes 0..C-1 with each present; class "
                        f"{missing[0]} has no sample (labels run from 0 to {int(y.max())})")
    return y


def _read_csv(path: Path, label: int | str | None, supervised: bool,
              drop: Any = None) -> tuple[np.ndarray, Any]:
    """The values of a CSV file (a header row allowed), read row by row into one array of floats: memory
    stays at 8 bytes a value whatever the file holds (a field over csv's limit, a NUL byte or text that is
    not UTF-8 is a DataError naming the line).  The label column is kept apart, as numbers or as text (class
    names); the columns ``drop`` names are left out."""
    header, width, values = None, None, array("d")
    reader = None
    col, keep, labels = None, None, []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(_lines(f, path))
            for row in reader:
                if not row or not any(c.strip() for c in row):
                    continue
                if width is None:
                    width, header, col, keep = _layout(row, label, supervised, drop, path)
                    if header is not None:
                        continue
                if len(row) == width and col is not None:
                    labels.append(row[col].strip())
                _append_row(values, row, width, header, path, reader.line_num, keep)
    except csv.Error as err:
        raise DataError(f"{path}: line {reader.line_num if reader else 1} is not CSV ({err})") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not a UTF-8 text file (byte {err.start}: {err.reason})") from None
    if width is None:
        raise DataError(f"{path}: empty file")
    arr = np.frombuffer(values, dtype=np.float64).reshape(-1, len(keep)).copy()
    if col is None:
        return arr, None
    return arr, labels


def _layout(row: list, label: int | str | None, supervised: bool, drop: Any, path: Path) -> tuple:
    """(width, header or None, the label column or None, the sample columns) of a file from its first row."""
    width = len(row)
    header = None if _numeric(row) else [c.strip() for c in row]
    col = _label_column(label, supervised, header, width, path)
    gone = {col} | set(_columns(drop, header, width, path))
    return width, header, col, [j for j in range(width) if j not in gone]


def _columns(drop: Any, header: list | None, width: int, path: Path) -> list[int]:
    """The indices of the columns ``drop`` names (a name or index, or a list of them)."""
    if drop is None:
        return []
    names = drop if isinstance(drop, (list, tuple)) else [drop]
    return [_label_column(name, True, header, width, path) for name in names]


def _csv_labels(raw: list, n: int, source: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The labels of a CSV file's label column: numbers as classes 0..C-1, or text as class names (encoded in
    sorted order; the names returned)."""
    if _numeric(raw):
        return _labels(np.array([float(v) for v in raw]), n, source), None
    kinds = [_numeric([v]) for v in raw]
    odd = next((i for i, k in enumerate(kinds) if k != kinds[0]), None)
    if odd is not None:
        raise DataError(f"{source}: the label of row {odd + 1} is {raw[odd][:60]!r}, the first row's "
                        f"{raw[0][:60]!r}: labels are all numbers (classes 0..C-1) or all class names")
    missing = [i for i, v in enumerate(raw) if not v]
    if missing:
        raise DataError(f"{source}: the label of row {missing[0] + 1} is empty")
    names, y = np.unique(np.array(raw, dtype=str), return_inverse=True)
    return y.astype(np.int64), names


MAX_LINE = 16 << 20  # characters in a line of a CSV file, at most


def _lines(f, path: Path):
    """The lines of a text file, each read with a bound (a file with no line breaks is not read whole)."""
    number = 0
    while line := f.readline(MAX_LINE):
        number += 1
        if len(line) == MAX_LINE and not line.endswith("\n"):
            raise DataError(f"{path}: line {number} is longer than {MAX_LINE} characters; not a CSV file of numbers")
        yield line


def _numeric(row: list) -> bool:
    try:
        [float(c) for c in row]
        return True
    except ValueError:
        return False


def _append_row(values: array, row: list, width: int, header: list | None, path: Path, line: int,
                keep: list[int]) -> None:
    if len(row) != width:
        raise DataError(f"{path}: line {line} has {len(row)} values, the first row {width}")
    for j in keep:
        cell = row[j]
        try:
            values.append(float(cell))
        except ValueError:
            name = f"column {j + 1}" + (f" ({header[j]!r})" if header else "")
            raise DataError(f"{path}: line {line}, {name} holds {cell.strip()[:60]!r}, not a number") from None


def _label_column(label: int | str | None, supervised: bool, header: list | None, width: int,
                  path: Path) -> int | None:
    if label is None and not supervised:
        return None
    if label is None:
        return width - 1
    if isinstance(label, str) and not label.lstrip("-").isdigit():
        if header is None or label not in header:
            raise DataError(f"{path}: no column named {label!r} (columns: {header or 'no header row'})")
        return header.index(label)
    return int(label) % width


def _load_numpy(path: Path, what: str, **options) -> Any:
    """np.load of a data file, its refusals as DataErrors: an array of Python objects (a pickle, never
    loaded), a file numpy cannot read."""
    try:
        return np.load(path, allow_pickle=False, **options)
    except ValueError as err:
        if "pickle" in str(err) or "object" in str(err).lower():
            raise DataError(f"{path}: {what} holds Python objects (a pickle), which flowvm never loads: save an "
                            "array of numbers") from None
        raise DataError(f"{path}: not a {what} numpy can read ({str(err)[:120]})") from None
    except (OSError, EOFError, zipfile.BadZipFile) as err:
        raise DataError(f"{path}: not a {what} numpy can read ({str(err)[:120]})") from None


def _member(z: Any, name: str, path: Path) -> np.ndarray:
    try:
        return z[name]
    except ValueError as err:
        if "pickle" in str(err) or "object" in str(err).lower():
            raise DataError(f"{path}: the .npz file's {name!r} holds Python objects (a pickle), which flowvm never "
                            "loads: save an array of numbers") from None
        raise DataError(f"{path}: the .npz file's {name!r} cannot be read ({str(err)[:120]})") from None
    except (OSError, EOFError, zipfile.BadZipFile) as err:
        raise DataError(f"{path}: the .npz file's {name!r} cannot be read ({str(err)[:120]})") from None


def load_data(data: Any, *, supervised: bool = False, label: int | str | None = None,
              name: str = "data", drop: Any = None) -> Data:
    """``data`` as samples (and labels when ``supervised``, or when given): an array or tensor, an ``(x, y)``
    pair, a ``torch.utils.data.Dataset`` (items ``x`` or ``(x, y)``), or a path to a ``.npy``, ``.npz``
    (keys ``x`` and ``y``) or ``.csv`` file (a header row allowed; ``label``: the label column's name or
    index, by default the last one when ``supervised``; its values numbers 0..C-1 or class names, which are
    encoded in sorted order and kept as ``classes_``; ``drop``: a column's name or index, or a list of them,
    left out of a .csv file's samples)."""
    if isinstance(data, Data):
        return data
    if isinstance(data, (str, os.PathLike)):
        return _load_file(Path(data), supervised, label, drop)
    if isinstance(data, tuple) and len(data) == 2:
        x = _as_samples(data[0], f"{name} (x)")
        return Data(x, _labels(data[1], len(x), f"{name} (y)"), name)
    if hasattr(data, "__getitem__") and hasattr(data, "__len__") and type(data).__module__.startswith("torch.utils") \
            or _is_torch_dataset(data):
        return _load_dataset(data, name)
    x = _as_samples(data, name)
    if supervised:
        raise DataError(f"{name}: this program needs labels: give (x, y)")
    return Data(x, None, name)


def _load_file(path: Path, supervised: bool, label: int | str | None, drop: Any) -> Data:
    """A .npy, .npz or .csv data file (see load_data)."""
    source = str(path)
    if not path.is_file():
        raise DataError(f"{source}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return Data(_as_samples(_map(path), source), None, source)
    if suffix == ".npz":
        with _load_numpy(path, ".npz file") as z:
            if "x" not in z:
                raise DataError(f"{source}: an .npz data file needs an array named 'x' (found {list(z.keys())})")
            x = _as_samples(_member(z, "x", path), f"{source} (x)")
            y = _labels(_member(z, "y", path), len(x), f"{source} (y)") if "y" in z else None
        if supervised and y is None:
            raise DataError(f"{source}: this program needs labels (an .npz with 'y', or a .csv label column)")
        return Data(x, y, source)
    if suffix == ".csv":
        raw_x, raw_y = _read_csv(path, label, supervised, drop)
        x = _as_samples(raw_x, source)
        y, names = (None, None) if raw_y is None else _csv_labels(raw_y, len(x), f"{source} (label column)")
        if supervised and y is None:
            raise DataError(f"{source}: this program needs labels (a .csv label column)")
        return Data(x, y, source, names)
    raise DataError(f"{source}: unknown data file type {suffix!r} (use .npy, .npz or .csv)")


def _load_dataset(data: Any, name: str) -> Data:
    """A torch Dataset's items: samples, or (sample, label) pairs."""
    items = [data[i] for i in range(len(data))]
    if items and isinstance(items[0], (tuple, list)) and len(items[0]) == 2:
        xs, ys = zip(*items)
        x = _as_samples(np.stack([_flat(v) for v in xs]), f"{name} (dataset samples)")
        return Data(x, _labels(np.array([_scalar(v) for v in ys]), len(x), f"{name} (dataset labels)"), name)
    return Data(_as_samples(np.stack([_flat(v) for v in items]), name), None, name)


def _is_torch_dataset(data: Any) -> bool:
    try:
        from torch.utils.data import Dataset
    except ImportError:
        return False
    return isinstance(data, Dataset)


def _flat(v: Any) -> np.ndarray:
    if type(v).__module__.startswith("torch"):
        v = v.detach().cpu().numpy()
    return np.asarray(v, dtype=np.float64).reshape(-1)


def _scalar(v: Any) -> Any:
    if type(v).__module__.startswith("torch"):
        return v.item()
    return v
