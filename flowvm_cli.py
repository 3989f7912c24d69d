"""The ``flowvm`` command's entry point.

It lives outside the flowvm package so that it runs before flowvm (and numpy) is imported: it first turns
SIGINT and SIGTERM into requests that the command handles (stop at a step boundary, save, say so), so that
a signal landing during start-up is reported like one landing later, not as a traceback or a bare exit.
The command itself is ``flowvm.command.cli.main``.
"""

import signal
import sys

_EARLY: list[int] = []  # the signals received before the command took them over


def _record(signum, frame):
    if _EARLY and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C stops at once, as during the run
    _EARLY.append(signum)


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _record)
    from flowvm.command.cli import main as command

    return command(early_signals=_EARLY)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
