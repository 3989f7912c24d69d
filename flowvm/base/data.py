"""A resumable source of minibatches, reshuffled every epoch.

``Batches`` serves minibatches over numpy arrays, torch tensors (one, or a tuple or dict of them with the
same first dimension) or a map-style dataset (anything with ``__len__`` and ``__getitem__``, such as a list of
samples or a ``torch.utils.data.Dataset``), by ``next_batch()`` or ``for batch in batches:`` (the batches left
in the epoch, epochs.py).  Its whole state is three integers:

- ``seed``: fixes every epoch's order;
- ``epoch``: the current epoch (0-based), also the number of epochs finished;
- ``position``: the batches already taken in the current epoch.

Epoch ``e`` visits the samples in the order ``permutation(seed, e)``, drawn from its own generator seeded
with ``(seed, e)``: no random state is carried from one epoch to the next and no global generator is touched.
So a program stopped between two ``next_batch()`` calls, pickled and loaded anywhere, serves exactly the batch
it would have served next, without re-reading or skipping samples, whatever the global random states do.

The rest is configuration or cache: ``transform(sample, rng)`` draws from a
generator seeded with ``(seed, epoch, index)`` (batching.py); ``workers=N``
makes batches ahead in worker processes (workers.py), served in the order
``workers=0`` serves them, and dropped when the object is pickled; ``rank``
and ``world_size`` share each global batch (``batch_size`` samples per rank of
the world the object was made in, consecutive in the epoch's order) out among
the ranks, rank r taking every world_size-th of them from r;
``.npy`` files are memory-mapped shards (sources.py); DataLoaders in a
program are handled by loaders.py (``Batches.next_from``).

>>> import numpy as np
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
import os
import sys
import weakref
from typing import Any, Callable

import numpy as np

from ..pickled import stable
from .loaders import next_from, restore_loader, restore_with
from .batching import BatchMaker, inspect_source, sample_rng, stack_items
from .sources import NpyShards, open_files, rebuild_with
from .environment import cores
from .epochs import BatchesEpoch
from .workers import WorkerError, WorkerPool

__all__ = ["Batches", "WorkerError", "sample_rng", "stack_items"]


def max_workers() -> int:
    """The most worker processes a Batches may start: 4 per core this process may use, and at least 8."""
    return max(8, 4 * cores())


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"Batches: {name} must be an int, got {type(value).__name__} {value!r:.40}")
    if value < low:
        raise ValueError(f"Batches: {name} must be >= {low}, got {value}")
    return int(value)


def _ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): as given, else torch.distributed's when it is initialised, else (0, 1)."""
    if rank is None and world_size is None:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError("Batches: give both rank and world_size, or neither")
    rank, world_size = _check_int("rank", rank, 0), _check_int("world_size", world_size, 1)
    if rank >= world_size:
        raise ValueError(f"Batches: rank {rank} is outside 0..{world_size - 1} (world_size={world_size})")
    return rank, world_size


@stable("flowvm")
class Batches:
    """Minibatches over arrays, tensors, .npy shards or a dataset, shuffled per epoch; the position is plain
    data.

    ``source`` is an array or tensor (batches are arrays or tensors), a tuple
    of them (batches are tuples), a dict of them (batches are dicts), .npy
    files (a path, a glob, an fsspec URL or a list of them: memory-mapped
    shards, joined), or a map-style dataset such as a list of samples (batches
    are its items, collated by ``collate``: ``torch.utils.data.default_collate``
    when the source is a ``torch.utils.data.Dataset``, else ``stack_items``).

    ``transform(sample, rng)``, if given, maps each sample before collation;
    ``rng`` is a numpy Generator seeded with ``(seed, epoch, index)``.

    ``workers=N`` makes batches ahead in N worker processes (at most 4 per core, and at
    least 8), ``prefetch`` batches per worker in flight, served in exactly the order
    ``workers=0`` serves them.  Batches in flight are a cache: the state stays three
    integers.  A worker that makes nothing for ``timeout`` seconds (a sample that hangs, a
    worker stopped from outside) is a ``WorkerError`` naming it and the batch.

    ``rank`` and ``world_size`` (default: torch.distributed's when initialised)
    shard each epoch: its order is cut into global batches of ``batch_size *
    world_size`` samples, and rank r takes every world_size-th sample of each
    from r.  A run resumed on another number of ranks keeps the global batch
    (each rank then takes about global/world_size samples a batch), so every
    rank serves ``len(batches)`` batches an epoch, as many as the world that
    made the object: loops counted by it stay right.
    """

    transform = None  # defaults of the options later versions added (objects pickled before them)
    workers = 0
    prefetch = 2
    start_method = None
    timeout = 300.0
    rank = 0
    world_size = 1
    global_batch_size = None  # objects saved before it was kept: batch_size * world_size

    def __init__(self, source: Any, batch_size: int = 32, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, collate: Callable[[list], Any] | None = None, *,
                 transform: Callable[[Any, np.random.Generator], Any] | None = None, workers: int = 0,
                 prefetch: int = 2, start_method: str | None = None, rank: int | None = None,
                 world_size: int | None = None, timeout: float = 300.0):
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(value, (bool, numbers.Integral)):
                raise TypeError(f"Batches: {name} must be True or False, got {type(value).__name__} {value!r:.40}")
        for name, fn, what in (("collate", collate, "a list of samples"), ("transform", transform, "(sample, rng)")):
            if fn is not None and not callable(fn):
                raise TypeError(f"Batches: {name} must be a function of {what}, got {type(fn).__name__} {fn!r:.40}")
        self.workers = _check_int("workers", workers, 0)
        if self.workers > max_workers():
            raise ValueError(f"Batches: workers={self.workers} is more than this machine can run usefully: at most "
                             f"{max_workers()} (4 per core of its {cores()}, or 8)")
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < float("inf"):
            raise ValueError(f"Batches: timeout must be a number of seconds > 0, got {timeout!r:.40}")
        self.timeout = float(timeout)
        self.prefetch = _check_int("prefetch", prefetch, 1)
        if start_method is not None and not isinstance(start_method, str):
            raise TypeError(f"Batches: start_method must be 'fork', 'forkserver' or 'spawn', got {start_method!r:.40}")
        self.start_method = start_method
        self.rank, self.world_size = _ranks(rank, world_size)
        self.global_batch_size = self.batch_size * self.world_size
        source = open_files(source)
        self.kind, self.size = inspect_source(source)
        self.source = source
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.collate = collate
        self.transform = transform
        if self.size == 0:
            raise ValueError("Batches: source holds no samples (an empty array, tensor or dataset)")
        if len(self) == 0:  # drop_last, and fewer samples than a batch of all ranks
            ranks = f" for each of {self.world_size} ranks" if self.world_size > 1 else ""
            raise ValueError(f"Batches: drop_last with batch_size={batch_size}{ranks} but only {self.size} samples: "
                             "every epoch would be empty")
        self.check_shards()
        self.epoch = 0
        self.position = 0
        self._check_workers()
        self.start_workers()

    def _check_workers(self) -> None:
        if not self.workers:
            return
        torch = sys.modules.get("torch")
        arrays = [self.source] if self.kind == "array" else \
            list(self.source.values()) if self.kind == "dict" else list(self.source) if self.kind == "tuple" else []
        if torch is not None and any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in arrays):
            raise ValueError("Batches: workers need a source in CPU memory (the source holds tensors on "
                             f"{next(a.device for a in arrays if a.device.type != 'cpu')}): move the batches "
                             "to the device in the program, or use workers=0")

    # ------------------------------------------------------------------ state
    @property
    def global_batch(self) -> int:
        """The samples all ranks take together in one batch: batch_size times the ranks of the world that
        made this object, whatever the world now."""
        return self.global_batch_size or self.batch_size * self.world_size

    @property
    def per_rank(self) -> int:
        """The samples this rank takes of each full global batch."""
        return len(range(self.rank, self.global_batch, self.world_size))

    @property
    def count(self) -> int:
        """The samples of an epoch this rank serves."""
        full, rest = divmod(self.size, self.global_batch)
        return full * self.per_rank + (0 if self.drop_last else len(range(self.rank, rest, self.world_size)))

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank."""
        full, rest = divmod(self.size, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def check_shards(self, where: str = "Batches") -> None:
        """Raise ValueError when some rank would get an empty batch: more ranks than samples in a global
        batch, or in the last one (which drop_last leaves out)."""
        g, ranks = self.global_batch, self.world_size
        rest = 0 if self.drop_last else self.size % g
        short = [n for n in (g, rest) if 0 < n < ranks]  # a batch of n samples leaves ranks n.. without one
        if not short:
            return
        n = min(short)
        fix = "use drop_last=True, or a batch size that leaves every rank a sample of the last batch" \
            if n == rest and g >= ranks else f"use at most {g} ranks, or a larger batch size"
        raise ValueError(
            f"{where}: {'the last' if n == rest else 'each'} batch of all {ranks} ranks together holds {n} "
            f"sample{'s' if n > 1 else ''} ({self.size} samples in global batches of {g}), so rank {n} and above "
            f"would take an empty batch: {fix}")

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

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The sample indices of an epoch (default: the current one) in the order this rank serves them:
        a permutation seeded with (seed, epoch); of each global batch of it, every world_size-th entry
        from rank on."""
        epoch = self.epoch if epoch is None else epoch
        key = (self.seed, epoch, self.shuffle, self.rank, self.world_size, self.global_batch)
        cached = self.__dict__.get("_order")
        if cached is not None and key in cached:
            return cached[key]
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.size)
        else:
            order = np.arange(self.size)
        if self.world_size > 1:
            at = np.arange(self.size) % self.global_batch
            order = order[at % self.world_size == self.rank]
        cached = {k: v for k, v in (cached or {}).items() if k[1] >= epoch - 1}  # this epoch and its neighbours
        cached[key] = order
        self.__dict__["_order"] = cached
        return order

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for cache in ("_order", "_pool", "_stop"):  # recomputed from (seed, epoch); workers start anew
            state.pop(cache, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.start_workers()

    def __repr__(self) -> str:
        workers = f", {self.workers} workers" if self.workers else ""
        ranks = f", rank {self.rank} of {self.world_size}" if self.world_size > 1 else ""
        return (f"<Batches of {self.batch_size} over {self.size} samples{ranks}{workers}: epoch {self.epoch}, "
                f"batch {self.position} of {len(self)} taken>")

    # ---------------------------------------------------------------- serving
    def indices(self, epoch: int | None = None, position: int | None = None) -> np.ndarray:
        """The sample indices of a batch (default: the one next_batch() serves next, without moving on)."""
        position = self.position if position is None else position
        per = self.per_rank
        return self.order(epoch)[position * per: (position + 1) * per]

    def __iter__(self):
        """The batches left in this epoch (``for batch in batches:``), by an iterator a copy of the run keeps."""
        return BatchesEpoch(self)

    def next_batch(self) -> Any:
        """The next minibatch; moves on, rolling over to the next epoch after its last batch (an error leaves
        the position where it was)."""
        if self.workers:
            batch = self._from_workers()
        else:
            if self.__dict__.get("_pool") is not None:  # workers set to 0 meanwhile
                self.close()
            batch = self.gather(self.indices())
        self.position += 1
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        return batch

    def gather(self, idx: np.ndarray, epoch: int | None = None) -> Any:
        """The batch made of the samples at idx (transformed as in epoch, default the current one)."""
        return self.maker()(self.seed, self.epoch if epoch is None else epoch, idx)

    def maker(self) -> BatchMaker:
        """What makes a batch from its indices (in this process, or pickled to the workers)."""
        return BatchMaker(self.kind, self.source, self.transform, self.collate)

    @staticmethod
    def next_from(loader: Any) -> Any:
        """The next batch of a torch DataLoader, a torchdata StatefulDataLoader or any iterable, which keeps
        its iterator; after an epoch's last batch, the first of the next.  A saved run holds a
        StatefulDataLoader's state_dict() and resumes on its next batch; a plain DataLoader's iterator is
        refused at save (see docs/data.md)."""
        return next_from(loader)

    @staticmethod
    def _open_shards(paths: list) -> NpyShards:
        return NpyShards(paths)

    @staticmethod
    def _restore_loader(cls: type, state: dict, loader_state: dict | None) -> Any:
        return restore_loader(cls, state, loader_state)

    # ---------------------------------------------------------------- workers
    def start_workers(self) -> None:
        """Start the worker processes (in the background where they start slowly), if workers > 0 and none
        run; next_batch() calls this too."""
        if not self.workers or self.__dict__.get("_pool") is not None:
            return
        pool = WorkerPool(self.workers, self.maker(), self.start_method, self.timeout)
        self.__dict__["_pool"] = pool
        self.__dict__["_stop"] = weakref.finalize(self, pool.close)

    def close(self) -> None:
        """Stop the worker processes (a later next_batch() starts new ones); they also stop when this object
        is garbage-collected and when the interpreter exits."""
        stop = self.__dict__.pop("_stop", None)
        self.__dict__.pop("_pool", None)
        if stop is not None:
            stop()

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the workers (starting them if none run)."""
        self.start_workers()
        return self.__dict__["_pool"].pids if self.workers else []

    def _ahead(self, n: int):
        """The (epoch, position) of this batch and the n - 1 after it."""
        epoch, position, per_epoch = self.epoch, self.position, len(self)
        for _ in range(n):
            yield epoch, position
            position += 1
            if position >= per_epoch:
                epoch, position = epoch + 1, 0

    def _from_workers(self) -> Any:
        self.start_workers()
        pool = self.__dict__["_pool"]
        if pool.closed or pool.n != self.workers or pool.owner != os.getpid():  # a worker died, workers was
            # changed, or this is a forked copy of the process that started them: start afresh
            self.close()
            self.start_workers()
            pool = self.__dict__["_pool"]
        window = list(self._ahead(self.workers * self.prefetch + 1))  # this batch, and as many in flight
        # while the program works on it as prefetch asks
        keys = [(self.seed, e, p) for e, p in window]
        pool.keep_only(set(keys))
        per_epoch = len(self)
        for n, ((epoch, position), key) in enumerate(zip(window, keys)):
            if pool.has(key):
                continue
            if n and pool.in_flight() >= len(keys):
                break
            pool.submit((epoch * per_epoch + position) % self.workers, key, self.seed, epoch,
                        self.indices(epoch, position))
        return pool.take(keys[0])


restore_with(Batches._restore_loader)  # a pickled StatefulDataLoader names flowvm.Batches._restore_loader
rebuild_with(Batches._open_shards)  # a pickled NpyShards names flowvm.Batches._open_shards
