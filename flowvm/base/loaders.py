"""torch's DataLoader and torchdata's StatefulDataLoader in a program: what a copy of the run keeps.

- A ``StatefulDataLoader`` (torchdata) pickles as its settings plus its
  ``state_dict()``, the position of the iterator it last made; the loaded copy
  calls ``load_state_dict`` with it, so its next iterator resumes there.  Take
  batches with ``Batches.next_from(loader)`` (a CALL of it, the loader in a
  register or bound), which keeps one iterator per loader and starts the next
  epoch when it ends: the loader is then the whole state.
- A plain ``DataLoader`` pickles as its settings (a copy starts a new epoch);
  an iterator over one (``iter(loader)``, or the one ``next_from`` holds) is
  refused when the run is saved, with a message pointing to ``Batches`` or
  ``StatefulDataLoader``: its position cannot be saved, and a resumed run
  would silently start the epoch again.

The pickler (persist/pickler.py) asks ``reduction_for`` about every type from
torch.utils.data or torchdata.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

__all__ = ["next_from", "reduction_for", "restore_loader", "restore_with", "ITERATOR_ATTR"]

ITERATOR_ATTR = "_flowvm_iterator"  # the iterator next_from keeps on a loader (dropped from its pickle)


def _names(t: type) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in t.__mro__}


def _is_stateful_loader(t: type) -> bool:
    """A DataLoader with state_dict and load_state_dict (torchdata's StatefulDataLoader, or one like it)."""
    return "torch.utils.data.dataloader.DataLoader" in _names(t) and all(
        callable(getattr(t, m, None)) for m in ("state_dict", "load_state_dict"))


def reduction_for(t: type) -> Callable[[Any], Any] | None:
    """How the pickler writes an object of type t (None: as usual)."""
    names = _names(t)
    if "torch.utils.data.dataloader._BaseDataLoaderIter" in names:
        return _refuse_iterator
    if _is_stateful_loader(t):
        return _reduce_stateful
    if "torch.utils.data.dataloader.DataLoader" in names:
        return _reduce_loader
    return None


def _refuse_iterator(it: Any) -> Any:
    kind = "a StatefulDataLoader" if callable(getattr(it, "state_dict", None)) else "a torch DataLoader"
    raise pickle.PicklingError(
        f"flowvm: cannot save an iterator over {kind} ({type(it).__name__}): its position in the epoch "
        "cannot be saved, and a resumed run would start the epoch again. Serve batches with flowvm.Batches "
        "(exact resume, workers=N for parallel preparation), or keep a torchdata StatefulDataLoader in a "
        "register and take its batches with CALL(flowvm.Batches.next_from, reg('loader')): a saved run "
        "holds its state_dict()")


def _without_iterators(loader: Any) -> dict:
    state = dict(loader.__dict__)
    state.pop(ITERATOR_ATTR, None)
    state["_iterator"] = None
    return state


_restorer: list = [None]  # restore_loader under its stable name (Batches._restore_loader, set by data.py)


def restore_with(fn: Callable) -> None:
    """The function a pickled StatefulDataLoader names to rebuild itself (it calls restore_loader)."""
    _restorer[0] = fn


def _reduce_stateful(loader: Any) -> Any:
    return _restorer[0] or restore_loader, (type(loader), _without_iterators(loader), loader.state_dict())


def _reduce_loader(loader: Any) -> Any:
    it = loader.__dict__.get(ITERATOR_ATTR) or loader.__dict__.get("_iterator")
    if it is not None:
        _refuse_iterator(it)
    return NotImplemented


def restore_loader(cls: type, state: dict, loader_state: dict | None) -> Any:
    """A StatefulDataLoader from its settings and state_dict (its next iterator resumes there)."""
    loader = cls.__new__(cls)
    loader.__dict__.update(state)
    if loader_state is not None:
        loader.load_state_dict(loader_state)
    return loader


def next_from(loader: Any) -> Any:
    """The next batch of a loader (any iterable), keeping its iterator on it; after the last batch of an
    epoch, the first of the next."""
    it = loader.__dict__.get(ITERATOR_ATTR)
    if it is None or (_is_stateful_loader(type(loader)) and loader.__dict__.get("_iterator") is not it):
        it = loader.__dict__[ITERATOR_ATTR] = iter(loader)  # (a loaded StatefulDataLoader resumes here)
    try:
        return next(it)
    except StopIteration:
        it = loader.__dict__[ITERATOR_ATTR] = iter(loader)
        return next(it)
