"""A run's history of metrics: points ``[step, value]`` of named registers, taken at fixed steps and kept with the
run (``Driver.watch``).

The history is plain data in the driver (``drv._watch``: ``{"every", "auto", "names", "points"}``), so every
copy of the run holds it: a pickle, a checkpoint, a state file.  Points are taken when the step count reaches
a multiple of ``every`` and when the run finishes, whichever of ``run()``, ``arun()`` or ``step()`` drives it,
so a run stopped anywhere (even killed) and resumed from a copy records exactly the points of the
uninterrupted run: none lost, none twice.  With ``every`` chosen for the run (``auto``), it aims at about
``POINTS`` points over the steps the program fixes; a run that goes on longer doubles the interval and keeps
the points at its multiples, at steps that depend on the step count alone.

A register's value is a point when it is a number, a one-element array or tensor, or a list or small array of
at most 64 numbers; anything else (not yet written, a model) is skipped at that step.

``run()`` and ``arun()`` stop their loops at each step due (the tight loops inside are untouched); ``step()``
records after the step when the driver is watched (one check of ``drv._watch``).
"""

from __future__ import annotations

import numbers
from time import monotonic
from typing import Any

from ..base.sentinels import INCOMPLETE

POINTS = 200  # about this many points over a run whose step count the program fixes
MAX_LIST = 64


def watch(drv, names, every: int | None, total: int | None) -> None:
    """Start (or widen) drv's history: names added to those it has; every fixed for a new history."""
    _check_watch(names, every)
    w = drv._watch
    if w is None:
        w = drv._watch = {"every": int(every) if every is not None else max(1, (total or POINTS) // POINTS),
                          "auto": every is None, "names": [], "points": {}}
    elif every is not None and int(every) != w["every"]:
        raise ValueError(f"watch: the run's history already takes a point every {w['every']} steps")
    for name in names:
        if name not in w["points"]:
            w["names"].append(name)
            w["points"][name] = []
    attach(drv)
    if drv.steps == 0 or drv.done:
        record(drv)


def _check_watch(names, every: int | None) -> None:
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"watch: register names must be non-empty str, got {name!r}")
    if every is not None and (isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1):
        raise ValueError(f"watch: every must be an int >= 1 or None, got {every!r}")


def attach(drv) -> None:
    """Nothing left to do: a watched driver's step() records its points itself.  (Drops the step of its own
    that a watched driver of older versions had.)"""
    drv.__dict__.pop("step", None)


def adopt(drv, saved: Any) -> None:
    """Give drv the history saved with it (checked: a malformed one raises ValueError)."""
    if saved is None:
        return
    try:
        every, names, points = saved["every"], saved["names"], saved["points"]
        if type(every) is not int or every < 1 or not all(type(n) is str for n in names):
            raise TypeError
        kept = {n: [[int(p[0]), p[1]] for p in points[n] if p[0] <= drv.steps] for n in names}
    except (TypeError, KeyError, IndexError, ValueError):
        raise ValueError("malformed history") from None
    drv._watch = {"every": every, "auto": bool(saved.get("auto", True)), "names": list(names), "points": kept}
    attach(drv)


def due_after(drv) -> int:
    """The next step, after drv.steps, at which a point is due."""
    every = drv._watch["every"]
    return (drv.steps // every + 1) * every


def record(drv) -> list[tuple[str, int, Any]]:
    """Take the points due at drv's step (a multiple of every, or the run's end); returns them as
    (name, step, value)."""
    w, step = drv._watch, drv.steps
    if w["auto"]:
        _coarsen(w, step)
    if step % w["every"] and not drv.done:
        return []
    taken = []
    registers = drv.registers
    for name in w["names"]:
        if name not in registers:
            continue
        value = point_value(registers[name])
        if value is None:
            continue
        points = w["points"][name]
        if points and points[-1][0] >= step:
            continue  # taken already (a step that only polled, or a run resumed at this very step)
        points.append([step, value])
        taken.append((name, step, value))
    return taken


def _coarsen(w: dict, step: int) -> None:
    while step // w["every"] > 2 * POINTS:
        w["every"] *= 2
        for points in w["points"].values():
            points[:] = [p for p in points if p[0] % w["every"] == 0]


def run(drv, limit: int, deadline: float | None) -> Any:
    """run() of a watched driver: the driver's own loop, stopped at every step due to take its points."""
    while True:
        value = drv._drive(min(limit, due_after(drv)), deadline, None, True)
        record(drv)
        if drv.done:
            return value
        if drv.steps >= limit or (deadline is not None and monotonic() >= deadline):
            return INCOMPLETE


def point_value(value: Any) -> float | list[float] | None:
    """A register's value as a number or a list of numbers (a small array, a list); None when it is not."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    size = getattr(value, "size", None)
    if callable(size):  # a torch tensor
        size = value.numel()
    if item is not None and size == 1:
        try:
            return float(item())
        except (TypeError, ValueError, RuntimeError):
            return None
    if isinstance(value, (list, tuple)) or (size is not None and isinstance(size, int) and 1 < size <= MAX_LIST):
        try:
            values = [float(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]
        except (TypeError, ValueError):
            return None
        return values if len(values) <= MAX_LIST else None
    return None
