"""A stop asked for by a signal, for the waits inside a step that could otherwise block it forever.

The command's SIGINT/SIGTERM handler (flowvm.command.runner.Stop) asks for a stop at the next step boundary.
A step that waits on something outside the program (a data worker's batch) checks ``pending()`` while it
waits: once a stop has been asked for ``GRACE`` seconds, it gives up with ``Interrupted``.  The step then did
not happen: the driver stays at the step before, which the command saves, and a resumed run takes the step
again from the start (a batch is made again from its seed, epoch and indices, bit for bit).
"""

from __future__ import annotations

import signal
import time

from .errors import FlowError

__all__ = ["request", "clear", "pending", "Interrupted", "GRACE"]

GRACE = 1.0  # seconds a wait goes on after a stop was asked for (a step about to finish finishes)

_asked: list[tuple[int, float]] = []


def request(signum: int) -> None:
    """A signal asked the run to stop at the next step boundary."""
    if not _asked:
        _asked.append((signum, time.monotonic()))


def clear() -> None:
    _asked.clear()


def pending() -> tuple[int, float] | None:
    """(the signal, how many seconds ago) of the stop asked for, or None."""
    if not _asked:
        return None
    signum, since = _asked[0]
    return signum, time.monotonic() - since


def due() -> int | None:
    """The signal whose stop a wait should give way to now (asked GRACE seconds ago or more), or None."""
    asked = pending()
    return asked[0] if asked is not None and asked[1] >= GRACE else None


class Interrupted(FlowError):
    """A wait inside a step was given up because a signal asked the run to stop: the step did not happen
    (the driver is at the step before it).  ``signum`` is the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name
