"""The checks of a run's frames read from a state file (flowvm.persist.state): every slot of every frame
has the type and the range its layout gives it (flowvm.machine.frames), so that a file cannot give a run a
state no run reaches (a REPEAT counter of -5, a SEQ position past its children, a missing slot)."""

from __future__ import annotations

import math
from typing import Any

from ..program.elements import BUFFER, LOOP, REPEAT, SEQ, SWITCH, WEAVE, WHILE

LARGEST = 1 << 62  # counts and step numbers a run reaches


def _count(x: Any, what: str, low: int = 0, high: int = LARGEST) -> int:
    if type(x) is not int or not low <= x <= high:
        raise ValueError(f"{what} is {x!r:.40}, expected an int in [{low}, {high}]")
    return x


def _marker(fr: list, size: int, what: str) -> None:
    """A frame of size slots, or one more: the marker of a move that failed once (True)."""
    if len(fr) == size + 1 and fr[size] is True:
        return
    if len(fr) != size:
        raise ValueError(f"{what} frame has {len(fr) - 1} slots, its layout {size - 1}")


def check_frame(fr: list, steps: int) -> None:
    """Raise ValueError naming the first slot of fr (a frame as the driver holds it, its element first) that
    is not of its layout's type or range; steps: the run's step count."""
    el = fr[0]
    kind = el.frame_kind
    what = el.kind
    if len(fr) == 1:  # a leaf ready to run, a container not started yet
        return
    if el.is_leaf:
        raise ValueError(f"{what} (a leaf) frame has {len(fr) - 1} slots, its layout none")
    n = len(el.children)
    if kind is SEQ:
        _marker(fr, 2, what)
        _count(fr[1], "its position", 0, n - 1)
    elif kind in (REPEAT, BUFFER):
        _marker(fr, 4, what)
        total = _count(fr[2], "its count", 1)
        done = _count(fr[1], "its counter", 0, total)
        if kind is BUFFER and (type(fr[3]) is not list or len(fr[3]) != done):
            raise ValueError(f"its values are {type(fr[3]).__name__} {fr[3]!r:.40}, expected a list of {done}")
    elif kind is LOOP:
        _marker(fr, 3, what)
        _count(fr[1], "the step its iteration started at", 0, steps)
        _count(fr[2], "its iteration count")
    elif kind is WHILE:
        _marker(fr, 4, what)
        _count(fr[1], "its phase", 0, 1)
        _count(fr[3], "its iteration count")
    elif kind is SWITCH:
        _marker(fr, 2, what)
        _count(fr[1], "its case", 0, n - 1)
    elif kind is WEAVE:
        _check_weave(fr, n, what)
    else:
        raise ValueError(f"{what} frame: an element kind whose frames a state file does not hold")


def _check_weave(fr: list, n: int, what: str) -> None:
    _marker(fr, 8, what)
    active, segments, finished, values, credits, done, rotate = fr[1:8]
    _count(active, "its active child", 0, n - 1)
    for name, items in (("segments", segments), ("finished", finished), ("values", values), ("credits", credits)):
        if type(items) is not list or len(items) != n:
            raise ValueError(f"its {name} are {type(items).__name__} {items!r:.40}, expected a list of {n}")
    if not all(type(f) is bool for f in finished):
        raise ValueError(f"its finished flags are {finished!r:.60}, expected bools")
    if not all(type(c) in (int, float) and math.isfinite(c) for c in credits):
        raise ValueError(f"its credits are {credits!r:.60}, expected finite numbers")
    if not all(s is None or type(s) is list for s in segments):
        raise ValueError("its segments are not lists of frames")
    _count(done, "its count of finished children", 0, n)
    if type(rotate) is not bool:
        raise ValueError(f"its rotate flag is {rotate!r:.40}, expected a bool")
