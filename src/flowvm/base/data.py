"""A resumable source of minibatches, reshuffled every epoch.

``Batches`` serves minibatches over numpy arrays, torch tensors (one, or a
tuple or dict of them with the same first dimension) or a map-style dataset
(anything with ``__len__`` and ``__getitem__``, such as a list of samples
or a ``torch.utils.data.Dataset``).  Its whole state is three integers:

- ``seed``: fixes every epoch's order;
- ``epoch``: the current epoch (0-based), also the number of epochs finished;
- ``position``: the batches already taken in the current epoch.

Epoch ``e`` visits the samples in the order ``permutation(seed, e)``, drawn
from its own generator seeded with ``(seed, e)``: no random state is carried
from one epoch to the next and no global generator is touched.  So a program
stopped between two ``next_batch()`` calls, pickled and loaded anywhere,
serves exactly the batch it would have served next, without re-reading or
skipping samples, whatever happens to the global random states meanwhile.

>>> import numpy as np

from ..pickled import stable
>>> data = Batches(np.arange(10), batch_size=4, seed=0)
>>> len(data), data.epoch, data.position
(3, 0, 0)
>>> first = [data.next_batch() for _ in range(3)]       # one epoch: 4 + 4 + 2 samples
>>> sorted(np.concatenate(first).tolist()) == list(range(10))
True
>>> data.epoch, data.position                           # the epoch rolls over after its last batch
(1, 0)
>>> state = data.state_dict(); state
{'seed': 0, 'epoch': 1, 'position': 0}
>>> a = data.next_batch(); data.load_state_dict(state)
>>> bool((data.next_batch() == a).all())                 # same state, same batch
True
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, Callable

import numpy as np

from ..pickled import stable

__all__ = ["Batches"]


def _is_array(obj: Any) -> bool:
    if isinstance(obj, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _length(arr: Any, what: str) -> int:
    shape = getattr(arr, "shape", ())
    if len(shape) == 0:
        raise ValueError(f"Batches: {what} is a 0-dimensional {type(arr).__name__}; it needs a first "
                         "(sample) dimension")
    return int(shape[0])


def _take(arr: Any, idx: np.ndarray) -> Any:
    if isinstance(arr, np.ndarray):
        return arr[idx]
    import torch

    return arr[torch.from_numpy(idx).to(arr.device)]


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


@stable("flowvm")
class Batches:
    """Minibatches over arrays, tensors or a dataset, shuffled per epoch; the position is plain data.

    ``source`` is an array or tensor (batches are arrays or tensors), a tuple
    of them (batches are tuples), a dict of them (batches are dicts), or a
    map-style dataset such as a list of samples (batches are its items,
    collated by ``collate``: ``torch.utils.data.default_collate`` when torch
    is imported and the source is a ``torch.utils.data.Dataset``, else
    ``stack_items``).

    ``next_batch()`` returns the next batch and moves on; after the last batch
    of an epoch ``epoch`` goes up by one and ``position`` is back at 0.  The
    last batch of an epoch is smaller when ``batch_size`` does not divide the
    number of samples, unless ``drop_last`` is set.

    The source is pickled with the object (a checkpoint is self-contained).
    For data too big for that, pass a dataset object whose pickled form is a
    reference (a file name it reopens on loading).
    """

    def __init__(self, source: Any, batch_size: int = 32, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, collate: Callable[[list], Any] | None = None):
        for name, value in (("batch_size", batch_size), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"Batches: {name} must be an int, got {type(value).__name__} {value!r:.40}")
        if batch_size < 1:
            raise ValueError(f"Batches: batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise ValueError(f"Batches: seed must be >= 0 (numpy seeds are non-negative), got {seed}")
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(value, (bool, numbers.Integral)):
                raise TypeError(f"Batches: {name} must be True or False, got {type(value).__name__} {value!r:.40}")
        if collate is not None and not callable(collate):
            raise TypeError(f"Batches: collate must be a function of a list of samples, got "
                            f"{type(collate).__name__} {collate!r:.40}")
        self.kind, self.size = self._inspect(source)
        self.source = source
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.collate = collate
        if self.size == 0:
            raise ValueError("Batches: source holds no samples (an empty array, tensor or dataset)")
        if drop_last and self.size < batch_size:
            raise ValueError(f"Batches: drop_last with batch_size={batch_size} but only {self.size} samples: "
                             "every epoch would be empty")
        self.epoch = 0
        self.position = 0

    @staticmethod
    def _inspect(source: Any) -> tuple[str, int]:
        if _is_array(source):
            return "array", _length(source, "the source")
        if isinstance(source, (tuple, dict)):
            items = list(source.items()) if isinstance(source, dict) else list(enumerate(source))
            if not items:
                raise ValueError(f"Batches: the source is an empty {type(source).__name__}")
            sizes = {}
            for key, arr in items:
                if not _is_array(arr):
                    raise TypeError(f"Batches: source item {key!r} must be a numpy array or torch tensor, got "
                                    f"{type(arr).__name__}")
                sizes[key] = _length(arr, f"source item {key!r}")
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
        raise TypeError(f"Batches: source must be an array, a tensor, a tuple or dict of them or a dataset "
                        f"with __len__ and __getitem__, got {type(source).__name__}")

    # ------------------------------------------------------------------ state
    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.size, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def batches_per_epoch(self) -> int:
        return len(self)

    @property
    def batches_taken(self) -> int:
        """All batches served so far, over all epochs."""
        return self.epoch * len(self) + self.position

    def state_dict(self) -> dict:
        """The position as plain data: ``{'seed', 'epoch', 'position'}``."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Go to a position returned by state_dict (from this object or one over the same source)."""
        try:
            values = [state[k] for k in ("seed", "epoch", "position")]
            if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in values):
                raise TypeError("not an int")
            seed, epoch, position = (int(v) for v in values)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"Batches.load_state_dict: expected a dict with int 'seed', 'epoch' and 'position', "
                             f"got {state!r:.80}") from err
        if seed < 0:
            raise ValueError(f"Batches.load_state_dict: seed must be >= 0, got {seed}")
        if epoch < 0 or not 0 <= position < len(self):
            raise ValueError(f"Batches.load_state_dict: position {position} of epoch {epoch} is outside "
                             f"0..{len(self) - 1}")
        self.seed, self.epoch, self.position = seed, epoch, position
        self.__dict__.pop("_order", None)

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The sample indices of an epoch (default: the current one) in the order they are served."""
        epoch = self.epoch if epoch is None else epoch
        cached = self.__dict__.get("_order")
        if cached is not None and cached[0] == (self.seed, epoch):
            return cached[1]
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.size)
        else:
            order = np.arange(self.size)
        self.__dict__["_order"] = ((self.seed, epoch), order)
        return order

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_order", None)  # a cache: recomputed from (seed, epoch)
        return state

    def __repr__(self) -> str:
        return (f"<Batches of {self.batch_size} over {self.size} samples: epoch {self.epoch}, "
                f"batch {self.position} of {len(self)} taken>")

    # ---------------------------------------------------------------- serving
    def indices(self) -> np.ndarray:
        """The sample indices of the batch next_batch() serves next (without moving on)."""
        start = self.position * self.batch_size
        return self.order()[start: start + self.batch_size]

    def next_batch(self) -> Any:
        """The next minibatch; moves on, rolling over to the next epoch after its last batch."""
        batch = self.gather(self.indices())
        self.position += 1
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        return batch

    def gather(self, idx: np.ndarray) -> Any:
        """The batch made of the samples at idx."""
        source = self.source
        if self.kind == "array":
            return _take(source, idx)
        if self.kind == "tuple":
            return tuple(_take(arr, idx) for arr in source)
        if self.kind == "dict":
            return {key: _take(arr, idx) for key, arr in source.items()}
        items = [source[int(i)] for i in idx]
        return self._collate()(items)

    def _collate(self) -> Callable[[list], Any]:
        if self.collate is not None:
            return self.collate
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(self.source, torch.utils.data.Dataset):
            return torch.utils.data.default_collate
        return stack_items
