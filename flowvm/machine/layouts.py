"""Each built-in container kind's frame, declared once: its slots' names (after the element, in order), the
slot holding the running child's index, the slot holding paused children's frames (WEAVE's segments), and
the check of a frame that comes from outside a run (a state file): every slot of its type and range, so
that a file cannot give a run a state no run reaches (a REPEAT counter of -5, a SEQ position past its
children, a missing slot).

Every module outside the moves (flowvm/machine/frames.py) asks ``layout_of(el)`` instead of testing an
element's kind: state files save and load frames by these names, the culprit walker names the slot holding a
value, and a run's path is built from ``child``.  A kind is its element's ``frame_kind``, so a subclass of a
kind has its kind's layout; a container kind written outside flowvm declares its own as the class attribute
``frame_layout`` (a ``Layout``), or has none (its frames stay in a run and in pickles, and a state file
refuses them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..program.elements import BUFFER, LOOP, REPEAT, SEQ, SWITCH, WEAVE, WHILE

LARGEST = 1 << 62  # counts and step numbers a run reaches


@dataclass(frozen=True)
class Layout:
    """A container kind's frame ``[el, slot 1, slot 2, ...]``: ``slots`` names slots 1, 2, ...; ``child`` is
    the slot holding the index (in ``children``) of the running child (None: child 0); ``segments`` the slot
    holding the frames of paused children; ``check(frame, children, steps)`` raises ValueError naming the
    first slot out of its type or range; ``counter`` the slots of its iteration and its count of iterations
    (a kind that runs its child a known number of times); ``ends`` False for a kind whose number of runs
    of its children is not known in advance (LOOP, WHILE, WEAVE)."""

    slots: tuple[str, ...]
    check: Callable[[list, int, int], None]
    child: int | None = None
    segments: int | None = None
    counter: tuple[int, int] | None = None
    ends: bool = True

    @property
    def size(self) -> int:
        """The frame's length once started (the element and its slots)."""
        return len(self.slots) + 1


def count(x: Any, what: str, low: int = 0, high: int = LARGEST) -> int:
    if type(x) is not int or not low <= x <= high:
        raise ValueError(f"{what} is {x!r:.40}, expected an int in [{low}, {high}]")
    return x


def _seq(fr: list, n: int, steps: int) -> None:
    count(fr[1], "its position", 0, n - 1)


def _repeat(fr: list, n: int, steps: int) -> None:
    count(fr[1], "its counter", 0, count(fr[2], "its count", 1))


def _buffer(fr: list, n: int, steps: int) -> None:
    done = count(fr[1], "its counter", 0, count(fr[2], "its count", 1))
    if type(fr[3]) is not list or len(fr[3]) != done:
        raise ValueError(f"its values are {type(fr[3]).__name__} {fr[3]!r:.40}, expected a list of {done}")


def _loop(fr: list, n: int, steps: int) -> None:
    count(fr[1], "the step its iteration started at", 0, steps)
    count(fr[2], "its iteration count")


def _while(fr: list, n: int, steps: int) -> None:
    count(fr[1], "its phase", 0, 1)
    count(fr[3], "its iteration count")


def _switch(fr: list, n: int, steps: int) -> None:
    count(fr[1], "its case", 0, n - 1)


def _weave(fr: list, n: int, steps: int) -> None:
    active, segments, finished, values, credits, done, rotate = fr[1:8]
    count(active, "its active child", 0, n - 1)
    for name, items in (("segments", segments), ("finished", finished), ("values", values), ("credits", credits)):
        if type(items) is not list or len(items) != n:
            raise ValueError(f"its {name} are {type(items).__name__} {items!r:.40}, expected a list of {n}")
    if not all(type(f) is bool for f in finished):
        raise ValueError(f"its finished flags are {finished!r:.60}, expected bools")
    if not all(type(c) in (int, float) and math.isfinite(c) for c in credits):
        raise ValueError(f"its credits are {credits!r:.60}, expected finite numbers")
    if not all(s is None or type(s) is list for s in segments):
        raise ValueError("its segments are not lists of frames")
    count(done, "its count of finished children", 0, n)
    if type(rotate) is not bool:
        raise ValueError(f"its rotate flag is {rotate!r:.40}, expected a bool")


LAYOUTS: dict[type, Layout] = {
    SEQ: Layout(("pos",), _seq, child=1),
    REPEAT: Layout(("i", "n", "last"), _repeat, counter=(1, 2)),
    BUFFER: Layout(("i", "n", "values"), _buffer, counter=(1, 2)),
    LOOP: Layout(("steps_at_iteration_start", "iterations"), _loop, ends=False),
    WHILE: Layout(("phase", "last", "iterations"), _while, child=1, ends=False),
    SWITCH: Layout(("child_index",), _switch, child=1),
    WEAVE: Layout(("active", "segments", "finished", "values", "credits", "n_finished", "rotate_due"), _weave,
                  child=1, segments=2, ends=False),
}


def layout_of(el: Any) -> Layout | None:
    """The layout of el's frames: its built-in kind's, else the one its class declares as ``frame_layout`` (a
    container kind written outside flowvm: docs/containers.md); None for a leaf and for a kind that declares
    none."""
    found = LAYOUTS.get(el.frame_kind)
    if found is None:
        own = getattr(type(el), "frame_layout", None)
        return own if isinstance(own, Layout) else None
    return found
