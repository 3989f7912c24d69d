"""How the ranks of ``flowvm run --nproc`` end and tell their launcher so.

Under flowvm's launcher a rank whose run ends on purpose (finished, or stopped on a signal the ranks agreed
on, saved) writes a file into a folder the launcher names in ``$FLOWVM_STOPPED_DIR`` and exits with 0, so that
torch's elastic agent takes no planned stop for a failure to restart after (``--max-restarts``); the launcher
reads the folder to learn the run's status.  A rank then leaves without the interpreter's finalization
(``leave``).
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NoReturn

from ..distributed import group

STOPPED_ENV = "FLOWVM_STOPPED_DIR"


class Ends:
    """What the ranks of this host said when they ended: the statuses of those that stopped on a signal, and
    how many finished the run."""

    def __init__(self, box: str):
        self.box = Path(box)

    @property
    def stopped(self) -> list[int]:
        return [int(p.read_text()) for p in self.box.glob("stopped-*")]

    @property
    def finished(self) -> int:
        return len(list(self.box.glob("finished-*")))


@contextmanager
def told(environ: dict = os.environ) -> Iterator[Ends]:
    """The launcher's side: while it runs the agent, its ranks' environment names a folder to tell it in."""
    with tempfile.TemporaryDirectory(prefix="flowvm-launch-") as box:
        environ[STOPPED_ENV] = box
        try:
            yield Ends(box)
        finally:
            del environ[STOPPED_ENV]


def all_ended(nproc: int) -> bool:
    """Whether every rank of this host said it finished the run or stopped on purpose (``tell``): what it does
    after that (an atexit hook, the interpreter's end) is no part of the run."""
    box = os.environ.get(STOPPED_ENV)
    ends = Ends(box) if box and os.path.isdir(box) else None
    return ends is not None and len(ends.stopped) + ends.finished >= nproc


def tell(status: int) -> int:
    """A rank's run ended with ``status`` (0: finished; 128 + a signal: stopped on it, saved): under flowvm's
    launcher it says so and ends with 0, so that the agent does not take the stop for a failure to restart
    after; under another launcher (torchrun) it ends with its status."""
    box = os.environ.get(STOPPED_ENV)
    if not box or not os.path.isdir(box):
        return status
    if not status:  # finished: a signal reaching the launcher after this is no stop of the run
        Path(box, f"finished-{group.local_rank()}").write_text("0")
        return 0
    Path(box, f"stopped-{group.local_rank()}").write_text(str(status))
    return 0


def leave(status: int) -> NoReturn:
    """End a rank whose run has ended: the atexit hooks run and the streams are flushed, then the process
    exits without the interpreter's finalization, where the threads torch's process group leaves behind can
    abort the process ("terminate called without an active exception") after the run's work is done, and so
    make the agent restart a run that finished or stopped."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
