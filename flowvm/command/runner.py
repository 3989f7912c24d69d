"""Running a driver from the command line: progress output, periodic atomic checkpoints, signals.

``Runner(drv, show, ckpt, every, every_seconds).run()`` runs a driver to its
end in chunks of about 50 ms.  Between chunks it updates a tqdm bar (on a
terminal) or prints a plain progress line (otherwise), saves the run when
``every`` steps or ``every_seconds`` seconds have passed since the last save,
and checks whether SIGINT or SIGTERM asked it to stop.  It also saves when a
step raises (the saved run retries that step), when it pauses and at the end.
``ckpt`` is a local Path or an fsspec URL (a str): the format its suffix chooses writes it through
flowvm.persist.storage, atomically.
"""

from __future__ import annotations

import inspect
import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .history import History
from ..persist.formats import format_of
from ..persist.lock import holding
from ..persist.storage import read_start
from ..machine.driver import Driver
from ..machine.runstate import save_wait
from ..program.analysis import static_steps
from ..base import interrupts
from ..base.errors import CheckpointError, CopyError, StoppedDuringStartup

DEFAULT_EVERY_SECONDS = 60.0
_MAX_CHUNK = 1 << 20  # steps per driver.run() call, at most


class Stop:
    """SIGINT/SIGTERM from the command's start (``early``: the signals its entry point saw before this was
    installed) to its end: during start-up they stop the command at once (``StoppedDuringStartup``); once
    the run is going (``running``) they become a request to checkpoint and stop at the next step
    boundary, and a second SIGINT stops at once."""

    def __init__(self, early: list[int] | None = None, running: bool = False):
        self.signal: int | None = early[0] if early else None
        self.running = running
        self._old: dict = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if not self.running:
            self.signal = signum
            raise StoppedDuringStartup(signum)
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal = signum
        interrupts.request(signum)  # a step waiting on a stuck data worker gives way (flowvm.base.interrupts)

    def restore(self) -> None:
        """Give the signals back to their handlers from before (commands that run no program)."""
        for sig, old in self._old.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old = {}

    def __exit__(self, *exc):
        self.restore()
        interrupts.clear()


def short_value(value: Any, limit: int = 40) -> str:
    """A register value for a progress line: numbers to 5 significant digits, arrays by shape."""
    from ..program.printer import fmt

    if isinstance(value, float):
        return f"{value:.5g}"
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) in ((), (1,)):
        try:
            v = item()
            return f"{v:.5g}" if isinstance(v, float) else str(v)
        except (TypeError, ValueError, RuntimeError):
            pass
    return fmt(value, limit)


def shown(drv: Driver, names: list[str]) -> str:
    return " ".join(f"{n}={short_value(drv.registers[n])}" for n in names if n in drv.registers)


def rate_text(steps: int, seconds: float) -> str:
    """A progress line's speed: whole steps a second from 10 on, else two significant digits (a slow step
    is 0.4 steps/s, not 0)."""
    rate = steps / max(seconds, 1e-9)
    return f"{rate:.0f} steps/s" if rate >= 10 else f"{rate:.2g} steps/s"


class Runner:
    """Runs a driver with progress output and periodic atomic checkpoints."""

    def __init__(self, drv: Driver, show: list[str], ckpt: Path | str | None = None, every: int | None = None,
                 every_seconds: float | None = None, meta: dict | None = None, key: str | None = None,
                 progress: str = "auto", progress_every: float = 2.0, stop: Stop | None = None,
                 history: list[str] | None = None, tensorboard: str | None = None, watch=None):
        self.drv, self.show, self.ckpt, self.every, self.meta, self.key = drv, show, ckpt, every, meta or {}, key
        self.format = format_of(ckpt) if ckpt is not None else None
        self.history_names = list(show) + list(history or [])
        self.tensorboard = tensorboard
        self.watch = watch  # a page watching the run (watch.py): asked between two chunks
        self.signalled = lambda: None  # the signal that stopped the run, while it runs
        self.stop = stop  # the command's, installed since its start; else run() installs its own
        if ckpt is not None and every is None and every_seconds is None:
            every_seconds = DEFAULT_EVERY_SECONDS
        self.every_seconds = every_seconds
        self.mode = ("bar" if sys.stderr.isatty() else "lines") if progress == "auto" else progress
        self.progress_every = progress_every
        self.total = static_steps(drv.program)
        self.timed = "timeout" in inspect.signature(drv.run).parameters

    def save(self, periodic: bool = False, step_on: bool = True) -> None:
        """Save the run, first stepping on to a step it resumes from exactly (see ``exact``); with
        step_on=False (after a step failed), a run that is not copyable now is not saved (CopyError)."""
        if self.ckpt is not None:
            try:
                try:
                    self.write()
                except CopyError as refused:  # a live autograd graph (the save's pickling found it, writing nothing)
                    if not step_on or refused.where is None or "autograd graph" not in refused.reason:
                        raise
                    if not self.exact(periodic, refused):
                        return
                    self.write()
            except CheckpointError as err:  # a full disk, a quota, ...: the last checkpoint stays as it is
                reason = err.reason.removesuffix("; the file there is as it was")
                failed = CheckpointError(self.ckpt, f"{reason}; {self.kept()}")
                failed.save_failed = True
                raise failed from err
            self.saved_step, self.saved_time, self.written = self.drv.steps, time.monotonic(), True

    def exact(self, periodic: bool = False, first: CopyError | None = None) -> bool:
        """Step on until a copy of the run resumes exactly (Driver.run_to_copyable), for at most WAIT_SECONDS,
        and say so when it had to; True when the run may be saved now.  Past the limit, a periodic save is
        skipped (False, said) and any other is a CheckpointError that keeps the last checkpoint.  ``first``:
        the refusal a save already met (else the run is asked, at the cost of a pickling without its arrays)."""
        drv = self.drv
        first = first or drv.copyable()
        if first is None:
            return True
        start, t0 = drv.steps, time.monotonic()
        problem = drv.run_to_copyable(save_wait())
        took, waited = time.monotonic() - t0, drv.steps - start
        if problem is not None:
            what = (f"{problem.where} still holds an autograd graph a later backward() may run through after "
                    f"{waited} more steps ({took:.1f} s)")
            if periodic:
                self.line(f"flowvm: checkpoint skipped at step {drv.steps}: {what}")
                self.saved_time = time.monotonic()
                return False
            failed = CheckpointError(self.ckpt, f"not saved: {what} (compute what is not differentiated under "
                                                f"torch.no_grad(), or keep loss.detach()); {self.kept()}")
            failed.save_failed = True
            raise failed
        self.line(f"flowvm: saving at step {drv.steps}, not {start}: at step {start} {first.where} held an autograd "
                  f"graph that a backward() still needed, and a copy resumes exactly only without one (waited "
                  f"{waited} step{'s' if waited != 1 else ''}, {took:.2f} s)")
        return True

    def kept(self) -> str:
        """What the checkpoint holds when a save fails."""
        if self.written:
            return f"it keeps the run as saved at step {self.saved_step}"
        return "no checkpoint of this run was written"

    def write(self) -> None:
        """Write the checkpoint, in the format its suffix chooses (flowvm.persist.formats)."""
        self.format.save(self.drv, self.ckpt, key=self.key, meta=self.meta)

    def line(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def progress_line(self) -> str:
        drv = self.drv
        of = f"/{self.total}" if self.total else ""
        taken = drv.steps - self.start_step
        rate = f" ({rate_text(taken, time.monotonic() - self.start_time)})" if taken else ""
        return f"step {drv.steps}{of}{rate} {shown(drv, self.show)}".rstrip()

    def run(self, max_steps: int | None = None) -> int:
        """Run until done, max_steps more steps or a signal; return the exit status.  While it runs, it
        holds the checkpoint's lock (flowvm.persist.lock): a second run saving to the same place is refused."""
        try:
            with holding(self.ckpt) if self.ckpt is not None else contextlib.nullcontext():
                return self._run(max_steps)
        finally:
            if self.watch is not None:
                self.watch.close()

    def _run(self, max_steps: int | None) -> int:
        drv = self.drv
        self.saved_step, self.saved_time = drv.steps, time.monotonic()
        self.written = self._holds_this_run()
        self.start_step, self.start_time = drv.steps, time.monotonic()
        limit = None if max_steps is None else drv.steps + max_steps
        history = History(drv, self.meta, self.history_names, self.tensorboard)  # (a missing TensorBoard: said first)
        self.bar = self._start_progress()
        self.last_line, self.chunk = time.monotonic(), 1
        with contextlib.nullcontext(self.stop) if self.stop is not None else Stop(running=True) as stop, \
                contextlib.closing(history):
            stop.running = True  # from here a signal stops the run at a step boundary, saved
            self.signalled = lambda: stop.signal
            try:
                while not drv.done and stop.signal is None and (limit is None or drv.steps < limit):
                    if self.watch is not None and not self.watch.between_chunks(self):
                        break  # stopped from the page
                    self._chunk(limit, history)
                if self.ckpt is not None:
                    self.exact()  # the last save lands on a step the run resumes from exactly
            except interrupts.Interrupted as err:  # a step waiting on a stuck worker gave way to the signal
                return self._interrupted(err, stop.signal or err.signum)
            except BaseException as err:  # an error, or SystemExit or KeyboardInterrupt raised by the program
                self._failed(err, stop)
                raise
            self._end_progress()
            self.save()
            if stop.signal is not None and not drv.done:  # a signal during the last step: the run finished
                self._stopped(stop.signal)
                return 128 + stop.signal
        return 0

    def _holds_this_run(self) -> bool:
        """Whether the checkpoint holds this run (at saved_step): a resumed run's file does, a new run's not yet."""
        return self.ckpt is not None and self.drv.steps > 0 and read_start(self.ckpt, 1, missing_ok=True) is not None

    def _interrupted(self, err: interrupts.Interrupted, signum: int) -> int:
        """A step gave way to a signal (its wait on a stuck worker ended): the run is saved at the step before."""
        self._end_progress()
        self.line(f"flowvm: {err}")
        self.save(step_on=False)  # the step did not happen: the driver is at the one before
        self._stopped(signum)
        return 128 + signum

    def _start_progress(self):
        """The tqdm bar (mode "bar"), or None after the first progress line (mode "lines")."""
        if self.mode == "bar":
            from tqdm import tqdm

            return tqdm(initial=self.drv.steps, total=self.total, unit="step", dynamic_ncols=True, file=sys.stderr)
        if self.mode == "lines":
            where = f", saving to {self.ckpt}" if self.ckpt is not None else ""
            self.line(f"flowvm: running from step {self.drv.steps}{where}")
        return None

    def _end_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.mode == "lines":
            self.line(self.progress_line())

    def _chunk(self, limit: int | None, history: History) -> None:
        """Run one chunk of steps (about 50 ms), then the progress output and the save that are due."""
        drv = self.drv
        n = self.chunk
        if self.every is not None and self.ckpt is not None:
            n = max(1, min(n, self.saved_step + self.every - drv.steps))
        if limit is not None:
            n = min(n, limit - drv.steps)
        t0, before = time.monotonic(), drv.steps
        if self.timed:  # returns within about 50 ms, also while it waits on a SPAWN or POPEN
            drv.run(max_steps=n, timeout=0.05)
        else:
            drv.run(max_steps=n)
        took = time.monotonic() - t0
        history.sync()
        # chunks of about 50 ms keep signals and output responsive
        self.chunk = max(1, min(self.chunk * 2, _MAX_CHUNK, int(n * 0.05 / took) if took > 0 else _MAX_CHUNK))
        now = time.monotonic()
        if self.bar is not None:
            self.bar.update(drv.steps - before)
            self.bar.set_postfix_str(shown(drv, self.show), refresh=False)
        elif self.mode == "lines" and now - self.last_line >= self.progress_every:
            self.line(self.progress_line())
            self.last_line = now
        if self.ckpt is not None and not drv.done and (
                (self.every is not None and drv.steps - self.saved_step >= self.every)
                or (self.every_seconds is not None and now - self.saved_time >= self.every_seconds)):
            self.save(periodic=True)

    def _failed(self, err: BaseException, stop: Stop) -> None:
        """A step raised err (the caller raises it again): save the run, which retries the step, and say so."""
        if self.bar is not None:
            self.bar.close()
        if isinstance(err, KeyboardInterrupt) and stop.signal is not None:
            # a second Ctrl-C, which may have landed in the middle of a step: saving could keep a
            # half-made step, so the last checkpoint stays as it is
            if self.ckpt is not None:
                err.add_note(f"flowvm: stopped at once by a second SIGINT; {self.ckpt}: {self.kept()}")
            return
        if getattr(err, "save_failed", False) or self.ckpt is None:  # saving again would fail again
            return
        try:
            self.save(step_on=False)  # the driver is consistent: resuming retries the step that failed
        except CheckpointError as failed:
            err.add_note(f"flowvm: {failed}")
            raise err from None
        err.add_note(f"flowvm: the run is saved at step {self.drv.steps} in {self.ckpt}; "
                     f"`flowvm resume {self.ckpt}` retries the failed step")

    def _stopped(self, signum: int) -> None:
        name = signal.Signals(signum).name
        where = f"; saved to {self.ckpt}, continue with `flowvm resume {self.ckpt}`" if self.ckpt else ""
        if where and self.key is not None:
            where += " (signed: give the key with --key or $FLOWVM_CHECKPOINT_KEY)"
        self.line(f"flowvm: stopped by {name} at step {self.drv.steps}{where}")
