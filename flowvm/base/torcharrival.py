"""Torch's generator states and settings that a copy of a run carries into a process that has not imported
torch: set the moment torch is imported there (flowvm.base.environment's docstring says when).

``defer(part, value, owner)`` keeps them (part "random" or "settings"), tied to the driver that carries them
(held weakly: a finished or collected run leaves a later import alone); ``deferred_part`` is what
``capture_random``/``capture_settings`` count as this process's until then.  ``_TorchArrival``, first on
``sys.meta_path`` while something waits, finds torch's spec through the other finders and wraps its loader,
which sets them once torch's own import has run.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["defer", "deferred_part"]

# What torch gets when it is imported: {"random": {"torch": bytes, "torch_cuda": [...]}, "settings": {"values":
# {...}, "announce": bool}, "owner": a weak reference to the driver that carries them, or None}.  Each part is
# replaced by the next apply_random / apply_settings made while torch is not imported.
_DEFERRED: dict = {}
# how a deferred state is set once torch is imported: apply(torch, deferred), given by flowvm.base.environment
setting: dict = {"apply": lambda torch, deferred: None}


def defer(part: str, value: dict, owner: Any) -> None:
    import weakref

    if owner is not None:
        if _DEFERRED.get("owner") is not None and _DEFERRED["owner"]() is not owner:
            _DEFERRED.clear()  # another driver's copy starts: the environment is its
        _DEFERRED["owner"] = weakref.ref(owner)
    if value:
        _DEFERRED[part] = value
    else:
        _DEFERRED.pop(part, None)
    if _DEFERRED.keys() - {"owner"}:
        _TorchArrival.install()
    else:
        _DEFERRED.clear()
        _TorchArrival.remove()


def deferred_part(part: str) -> dict:
    """The deferred random states (part "random") or settings ("settings") while their driver runs, else {}."""
    if part not in _DEFERRED or not _alive(_DEFERRED):
        return {}
    return _DEFERRED[part]["values"] if part == "settings" else _DEFERRED[part]


def _torch_arrived(torch) -> None:
    """torch's import just ended: set what a copy deferred for it."""
    deferred = dict(_DEFERRED)
    _DEFERRED.clear()
    _TorchArrival.remove()
    if not deferred or not _alive(deferred):
        return
    setting["apply"](torch, deferred)


def _alive(deferred: dict) -> bool:
    """Whether the driver that deferred these still runs (no driver: until replaced)."""
    ref = deferred.get("owner")
    drv = None if ref is None else ref()
    return ref is None or (drv is not None and not getattr(drv, "done", False))


class _TorchArrival:
    """A finder first on ``sys.meta_path`` while a copy's torch states wait for torch: it finds torch's spec
    through the other finders and wraps its loader, which calls ``_torch_arrived`` once torch has run."""

    @classmethod
    def install(cls) -> None:
        if not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls())

    @classmethod
    def remove(cls) -> None:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, cls)]

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if name != "torch" or "torch" in sys.modules:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenSet(spec.loader)
        return spec


class _ThenSet:
    """torch's own loader, then ``_torch_arrived``; the module keeps its own loader."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _torch_arrived(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)
