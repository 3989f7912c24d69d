"""The drivers alive in this process, for the tools that edit programs in place (flowvm.editing.edit): which
driver runs an element now, which drivers are in the middle of a step, and dropping what live drivers
derived from an element that was edited; and, for a leaf deciding whether work now pays off later, how
many more times the run will run it.
"""

from __future__ import annotations

import sys

from .driver import DRIVERS, Driver
from ..program.elements import Element
from .frames import ELEMENT
from .layouts import layout_of
from .frames import walk as walk_frames
from ..program.paths import format_path, walk


def running_in(el: Element) -> "tuple[Driver, str] | None":
    """A live driver of this process with a started frame of el (a container in progress, a leaf that is
    polling work it started), and that frame's path; else None.

    Editing el in place (``flowvm.editing.edit``) would pull the children out from under such a frame.
    """
    for drv in list(DRIVERS):
        if drv.done:
            continue
        live = drv.__dict__.get("_live") or {}
        for path, chain, k, paused in walk_frames(drv.frames):
            fr = chain[k]
            if fr[ELEMENT] is el and (len(fr) > 1 or id(fr) in live):  # a container in progress, a polling leaf
                return drv, "(a paused WEAVE child)" if paused else format_path(path)
    return None


def drivers_mid_step() -> "list[Driver]":
    """The drivers whose step is running now in this thread, further up the call stack, innermost first: an
    edit made from there comes from one of their own CALLs.  Their tight loops keep the functions of the
    leaves they run, and their frames are in the middle of a move, so such an edit is refused
    (flowvm.editing.edit).

    They are found by the frames of ``Driver.step`` and ``Driver._drive`` on the interpreter's stack: that
    costs nothing per step, where marking each step (a context variable set and reset) cost more than a
    whole step of a repeated leaf."""
    codes = {Driver.step.__code__, Driver._drive.__code__}
    found: list = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            drv = frame.f_locals.get("self")
            if isinstance(drv, Driver) and drv not in found:
                found.append(drv)
        frame = frame.f_back
    return found


def refresh_drivers_holding(el: Element) -> None:
    """el was edited in place (flowvm.editing.edit) while not running: drop what live drivers whose program
    holds it derived from it (the next leaf's function, the fast paths, whether there is a WEAVE)."""
    for drv in list(DRIVERS):
        if drv.done or not any(x is el for _, x in walk(drv.program)):
            continue
        drv.invalidate()  # (when the next leaf became a container, the next step settles into it)


def remaining_runs() -> int | None:
    """For the leaf running now (called from its function, inside a driver's step in this thread): how many
    more times its run will run it, this time included, as far as the REPEATs (and BUFFERs) around it
    tell (assuming it runs once per iteration of the innermost).  None when a LOOP, WHILE or WEAVE around it has no
    known end, or no driver is running here.  (Inside a tight loop a REPEAT's frame may lag its loop by
    the iterations run since the loop began: an estimate, for deciding whether work pays off.)"""
    drivers = drivers_mid_step()
    if not drivers:
        return None
    left, per = 1, 1  # runs left within the current iteration of a level; runs per iteration of it
    for fr in reversed(drivers[0].frames[:-1]):  # the leaf's ancestors, innermost first
        layout = layout_of(fr[ELEMENT])  # (a subclass of a kind is that kind)
        if layout is not None and not layout.ends:
            return None
        if layout is None or layout.counter is None or len(fr) == 1:
            continue
        i, n = fr[layout.counter[0]], fr[layout.counter[1]]
        left += max(n - i - 1, 0) * per
        per *= n
    return left
