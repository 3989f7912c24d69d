"""How one batch is made from its sample indices: the same code in the program's process (``workers=0``)
and in ``Batches``' worker processes, so both give the same batch bit for bit.

A per-sample ``transform(sample, rng)`` gets a numpy ``Generator`` seeded with
``(seed, epoch, index)`` (``sample_rng``): a function of the sample's place in
the run, never of the worker that made it or of any global generator.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, Callable

import numpy as np

__all__ = ["BatchMaker", "sample_rng", "stack_items", "is_array", "length", "take", "inspect_source"]


def is_array(obj: Any) -> bool:
    """A numpy array, a torch tensor, or an array-like source that gathers rows itself (``take_rows``)."""
    if isinstance(obj, np.ndarray) or callable(getattr(obj, "take_rows", None)):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def length(arr: Any, what: str) -> int:
    shape = getattr(arr, "shape", ())
    if len(shape) == 0:
        raise ValueError(f"Batches: {what} is a 0-dimensional {type(arr).__name__}; it needs a first "
                         "(sample) dimension")
    return int(shape[0])


def inspect_source(source: Any) -> tuple[str, int]:
    """A Batches source's kind ("array", "tuple", "dict" or "dataset") and sample count; a clear error for
    anything else."""
    if is_array(source):
        return "array", length(source, "the source")
    if isinstance(source, (tuple, dict)):
        items = list(source.items()) if isinstance(source, dict) else list(enumerate(source))
        if not items:
            raise ValueError(f"Batches: the source is an empty {type(source).__name__}")
        sizes = {}
        for key, arr in items:
            if not is_array(arr):
                raise TypeError(f"Batches: source item {key!r} must be a numpy array or torch tensor, got "
                                f"{type(arr).__name__}")
            sizes[key] = length(arr, f"source item {key!r}")
        if len(set(sizes.values())) > 1:
            listed = ", ".join(f"{k!r}: {n}" for k, n in sizes.items())
            raise ValueError(f"Batches: the source's arrays differ in length ({listed})")
        return ("dict" if isinstance(source, dict) else "tuple"), next(iter(sizes.values()))
    torch_data = sys.modules.get("torch.utils.data")
    if torch_data is not None and isinstance(source, torch_data.IterableDataset):
        raise TypeError(f"Batches: {type(source).__name__} is an IterableDataset, whose samples cannot be "
                        "fetched by index; give a map-style dataset (__len__ and __getitem__)")
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return "dataset", len(source)
    raise TypeError(f"Batches: source must be an array, a tensor, a tuple or dict of them, .npy files or a "
                    f"dataset with __len__ and __getitem__, got {type(source).__name__}")


def take(arr: Any, idx: np.ndarray) -> Any:
    """The rows of arr at idx."""
    if isinstance(arr, np.ndarray):
        return arr[idx]
    rows = getattr(arr, "take_rows", None)
    if rows is not None:
        return rows(idx)
    import torch

    return arr[torch.from_numpy(np.asarray(idx)).to(arr.device)]


def row(arr: Any, i: int) -> Any:
    """One sample of an array source (its row i)."""
    return take(arr, np.array([i]))[0] if callable(getattr(arr, "take_rows", None)) else arr[i]


def stack_items(items: list) -> Any:
    """Default collation for dataset items: stack arrays/tensors/numbers, recursing into tuples (named ones
    too), lists and dicts.

    >>> stack_items([(np.zeros(2), 1), (np.ones(2), 0)])
    (array([[0., 0.],
           [1., 1.]]), array([1, 0]))
    """
    first = items[0]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(first, torch.Tensor):
        return torch.stack(items)
    if isinstance(first, (np.ndarray, np.generic, numbers.Number)):
        return np.stack([np.asarray(item) for item in items])
    if isinstance(first, tuple):
        fields = [stack_items(list(group)) for group in zip(*items)]
        return type(first)(*fields) if hasattr(first, "_fields") else tuple(fields)  # a namedtuple stays one
    if isinstance(first, list):
        return [stack_items(list(group)) for group in zip(*items)]
    if isinstance(first, dict):
        return {key: stack_items([item[key] for item in items]) for key in first}
    return list(items)


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator a transform gets for sample index in epoch epoch of a run seeded with seed."""
    return np.random.default_rng([int(seed), int(epoch), int(index), 0x5A])  # 4 words: apart from the orders'


class BatchMaker:
    """Makes the batch of given sample indices: ``maker(seed, epoch, indices)`` (what workers run).

    kind is Batches' kind of source ("array", "tuple", "dict" or "dataset").
    """

    def __init__(self, kind: str, source: Any, transform: Callable | None, collate: Callable | None):
        self.kind, self.source, self.transform, self.collate = kind, source, transform, collate

    def __call__(self, seed: int, epoch: int, idx: np.ndarray) -> Any:
        kind, source = self.kind, self.source
        if self.transform is None and kind != "dataset":
            if kind == "array":
                return take(source, idx)
            if kind == "tuple":
                return tuple(take(arr, idx) for arr in source)
            return {key: take(arr, idx) for key, arr in source.items()}
        items = [self.sample(seed, epoch, int(i)) for i in idx]
        return self.collation()(items)

    def sample(self, seed: int, epoch: int, i: int) -> Any:
        """Sample i, transformed; an error of its own is noted with its index (``err.flowvm_sample``)."""
        try:
            kind, source = self.kind, self.source
            if kind == "dataset":
                item = source[i]
            elif kind == "array":
                item = row(source, i)
            elif kind == "tuple":
                item = tuple(row(arr, i) for arr in source)
            else:
                item = {key: row(arr, i) for key, arr in source.items()}
            if self.transform is not None:
                item = self.transform(item, sample_rng(seed, epoch, i))
            return item
        except Exception as err:
            if getattr(err, "flowvm_sample", None) is None:
                err.flowvm_sample = i
                err.add_note(f"flowvm: Batches: while preparing sample {i} (epoch {epoch})")
            raise

    def collation(self) -> Callable[[list], Any]:
        if self.collate is not None:
            return self.collate
        torch = sys.modules.get("torch")
        if torch is not None and self.kind == "dataset" and isinstance(self.source, torch.utils.data.Dataset):
            return torch.utils.data.default_collate
        return stack_items
