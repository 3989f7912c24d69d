"""Waiting on pending leaves: what run() and arun() do when no runnable leaf can make progress.

A leaf of the driver's leaf protocol returns PENDING while its work runs
elsewhere (a POPEN's process, a SPAWN's task).  One run() or arun() call
keeps an ``Idle`` record of the streak of such polls; once every runnable
leaf has polled PENDING since the last step that made progress, the driver
waits on the leaves' ``ready_future()`` hooks (blocking in run(), awaiting
in arun()) for at most ``IDLE_SLICE`` seconds, then polls them all again.
Leaves without a hook are polled with a back-off of at most
``IDLE_BACKOFF_MAX`` seconds.
"""

from __future__ import annotations

import numbers
from time import monotonic

IDLE_SLICE = 0.1
"""Longest single wait (seconds) on pending leaves before they are all polled again."""
IDLE_BACKOFF_MAX = 0.005
"""Longest sleep (seconds) between polls of pending leaves that offer nothing to wait on."""


class Idle:
    """A streak of PENDING polls, kept by one run() or arun() call.

    The streak holds the leaves (by frame id) that polled PENDING since the
    last step that was not such a poll.  When a leaf of the streak polls
    PENDING again, every runnable leaf has had its turn without progress, and
    the driver may wait on the streak's live handles.
    """

    __slots__ = ("keys", "at", "stopped", "backoff", "aio")

    def __init__(self):
        self.keys: dict[int, None] = {}
        self.at = -1
        self.stopped = False
        self.backoff = 0.0
        self.aio: dict[int, tuple] = {}

    def full_circle(self, key: int, steps: int) -> bool:
        if steps != self.at:  # a step that made progress came in between: a new streak
            self.keys.clear()
            self.backoff = 0.0
        self.at = steps + 1
        if key in self.keys:
            return True
        self.keys[key] = None
        return False

    def _futures(self, drv) -> tuple[list, bool]:
        futures, hookless = [], False
        for key in self.keys:
            hook = getattr(drv.live.get(key), "ready_future", None)
            try:
                fut = hook() if hook is not None else None
            except Exception:
                fut = None
            if fut is None:
                hookless = True
            else:
                futures.append(fut)
        return futures, hookless

    def _slice(self, deadline: float | None, hookless: bool) -> float:
        t = IDLE_SLICE
        if hookless:
            self.backoff = min(max(self.backoff * 2, 5e-5), IDLE_BACKOFF_MAX)
            t = self.backoff
        if deadline is not None:
            t = min(t, max(0.0, deadline - monotonic()))
        return t

    def wait(self, drv, deadline: float | None) -> None:
        """Block until one of the streak's leaves is ready (or one slice passed); start a new streak."""
        futures, hookless = self._futures(drv)
        t = self._slice(deadline, hookless)
        if futures:
            import concurrent.futures

            concurrent.futures.wait(futures, timeout=t, return_when=concurrent.futures.FIRST_COMPLETED)
        elif t > 0:
            import time

            time.sleep(t)
        self.keys.clear()  # all leaves poll once more before the next wait

    async def wait_async(self, drv, deadline: float | None) -> None:
        """As wait(), awaiting instead of blocking the event loop."""
        import asyncio

        futures, hookless = self._futures(drv)
        t = self._slice(deadline, hookless)
        if futures:
            loop = asyncio.get_running_loop()
            waits = [self._aio_future(f, loop) for f in futures]
            await asyncio.wait(waits, timeout=t, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(t)
        self.keys.clear()

    def _aio_future(self, fut, loop):
        """An asyncio future done with fut, made once per fut.

        Not ``asyncio.wrap_future``: cancelling its result would cancel fut,
        the leaf's own work.
        """
        entry = self.aio.get(id(fut))
        if entry is not None and entry[0] is fut and entry[2] is loop:
            return entry[1]
        for k in [k for k, e in self.aio.items() if e[0].done()]:
            del self.aio[k]
        waiter = loop.create_future()

        def wake(_fut, waiter=waiter):
            try:
                loop.call_soon_threadsafe(_set_done, waiter)
            except RuntimeError:  # the loop is closed
                pass

        fut.add_done_callback(wake)
        self.aio[id(fut)] = (fut, waiter, loop)
        return waiter


def _set_done(waiter) -> None:
    if not waiter.done():
        waiter.set_result(None)


def step_limit(steps: int, max_steps) -> float:
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, numbers.Integral)
                                  or max_steps < 0):
        raise ValueError(f"max_steps must be None or an int >= 0, got {max_steps!r}")
    return float("inf") if max_steps is None else steps + max_steps


def deadline_after(timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return monotonic() + float(timeout)
