"""Running one rank's driver in step with the others: every rank runs the same number of steps between two
agreements (``sync_every``), and at each agreement the ranks learn, by one all-reduce of a few integers,
whether any of them was asked to stop (SIGTERM, SIGINT) or found a time-based save due.  A save or a stop
thus happens at the same step boundary on every rank, whichever rank the signal reached.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..machine.runstate import save_wait
from ..program.analysis import static_steps
from . import coordinated, group, replicas

__all__ = ["Synchronized", "DEFAULT_SYNC_EVERY"]

DEFAULT_SYNC_EVERY = 20


class _Signals:
    """SIGINT/SIGTERM become a request to stop at the next agreement (outside the command, which has its
    own)."""

    def __init__(self):
        self.signal: int | None = None
        self._old: dict = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signal = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


class Synchronized:
    """Runs a rank's driver to its end (or ``max_steps`` more steps, or a stop agreed on), saving coordinated
    checkpoints at ``location`` every ``every`` steps or ``every_seconds`` seconds (rank 0's clock decides),
    when a stop is agreed on, and at the end.  ``stop`` is an object whose ``signal`` attribute a signal
    handler sets (the command's); without one, SIGINT and SIGTERM are taken over while it runs.
    ``on_chunk(drv)`` is called after every chunk of steps (progress, history).

    On more than one rank, the ranks' modules, parameters and optimizers must stay bit for bit alike (one
    model, as DistributedDataParallel keeps it): compared at the first agreement after an optimizer's first
    step, before every save and at the end (flowvm.distributed.replicas), a ReplicaError on every rank when
    they differ.  ``per_rank`` names the registers each rank keeps its own of (not compared)."""

    def __init__(self, drv, location: Path | str | None = None, every: int | None = None,
                 every_seconds: float | None = None, sync_every: int = DEFAULT_SYNC_EVERY, key: Any = None,
                 meta: dict | None = None, stop: Any = None, on_chunk: Callable | None = None,
                 resumed: bool = False, per_rank=()):
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.drv, self.location, self.every, self.every_seconds = drv, location, every, every_seconds
        self.sync_every, self.key, self.meta, self.stop, self.on_chunk = sync_every, key, meta, stop, on_chunk
        self.saved_step = drv.steps
        self.written = resumed  # whether location holds this run at saved_step
        self.saved_time = time.monotonic()
        self.signal: int | None = None  # the signal the ranks agreed to stop on
        self.per_rank = replicas.per_rank_names(per_rank)
        self.checked_step: int | None = None  # the step the ranks' replicas were last compared at
        self.steps_seen: replicas.OptimizerSteps | None = None  # until the first optimizer step is seen

    def check_replicas(self) -> None:
        """Compare the ranks' modules, parameters and optimizers (once a step; every rank calls it)."""
        if group.world_size() > 1 and self.checked_step != self.drv.steps:
            replicas.check(self.drv, self.per_rank)
            self.checked_step = self.drv.steps

    def save(self) -> None:
        if self.location is not None and (self.drv.steps != self.saved_step or not self.written):
            self.exact()
            self.check_replicas()
            coordinated.save(self.drv, self.location, self.key, self.meta)
            self.saved_step, self.saved_time, self.written = self.drv.steps, time.monotonic(), True

    def exact(self) -> None:
        """Every rank steps on, together, until no rank's run holds an autograd graph a later backward() still
        needs (Driver.copyable), so that the coordinated checkpoint resumes exactly; rank 0 says how far it
        went.  Past save_wait() seconds (any rank's clock) every rank refuses alike (AllRanksError)."""
        drv, start, t0 = self.drv, self.drv.steps, time.monotonic()
        while True:
            problem = None if drv.done else drv.copyable()
            blocked, late = group.agree(int(problem is not None), int(time.monotonic() - t0 >= save_wait()))
            if not blocked:
                break
            if late:
                where = problem.where if problem is not None else "another rank's register"
                raise group.AllRanksError(
                    f"checkpoint {self.location}: not saved: {where} still holds an autograd graph a later "
                    f"backward() may run through after {drv.steps - start} more steps; it keeps the run as saved "
                    f"at step {self.saved_step}")
            drv.run(max_steps=1)
        if drv.steps > start and group.rank() == 0:
            print(f"flowvm: saving at step {drv.steps}, not {start}: a register held an autograd graph that a "
                  f"backward() still needed, and a copy resumes exactly only without one (waited "
                  f"{drv.steps - start} step{'s' if drv.steps - start != 1 else ''}, {time.monotonic() - t0:.2f} s)",
                  file=sys.stderr, flush=True)

    def _chunk(self, limit: int | None) -> int:
        n = self.sync_every
        if self.every is not None and self.location is not None:
            n = max(1, min(n, self.saved_step + self.every - self.drv.steps))
        if limit is not None:
            n = min(n, limit - self.drv.steps)
        return n

    def _agree(self, stop) -> tuple[int, bool]:
        """(the signal any rank was asked to stop on, whether a timed save is due), agreed on by every rank,
        after checking that every rank is at the same step (programs whose step counts differ between ranks,
        such as loops over Batches of shards of different lengths, would otherwise wait on each other)."""
        drv = self.drv
        due = (self.location is not None and self.every_seconds is not None
               and time.monotonic() - self.saved_time >= self.every_seconds and group.rank() == 0)
        stepped = self.steps_seen is not None and self.steps_seen.stepped
        signum, due, most, least, done, running, stepped = group.agree(
            getattr(stop, "signal", None) or 0, int(due), drv.steps, -drv.steps, int(drv.done), int(not drv.done),
            int(stepped))
        if most != -least or (done and running):
            raise group.AllRanksError(f"the ranks' runs differ: they are at steps {-least} to {most}"
                            f"{' and some have finished' if done and running else ''} (rank {group.rank()} at step "
                            f"{drv.steps}); every rank must take the same steps (a Batches serves as many batches on "
                            "every rank: look for a loop or a condition that depends on the rank)")
        if stepped:  # some rank's optimizer has stepped: the replicas are compared once now, at the same step
            if self.steps_seen is not None:
                self.steps_seen.stop()
                self.steps_seen = None
            self.check_replicas()
        return signum, bool(due)

    def _check_lengths(self) -> None:
        """Every rank's program must take as many steps: compared before the run where the programs say how
        many they take (their loops' counts are known), since ranks whose collectives stop pairing up fail
        with the transport's error, not this one."""
        total = static_steps(self.drv.program)
        total = -1 if total is None else int(total)
        most, least = group.agree(total, -total)
        if most != -least:
            raise group.AllRanksError(f"the ranks' programs take different numbers of steps ({-least} to {most}; rank "
                            f"{group.rank()}: {total}): every rank must take the same steps (a Batches serves as "
                            "many batches on every rank: look for a loop count that depends on the rank)")

    def run(self, max_steps: int | None = None) -> int:
        """Run; the exit status: 0, or 128 + the signal the ranks stopped on."""
        drv = self.drv
        self._check_lengths()
        limit = None if max_steps is None else drv.steps + max_steps
        if group.world_size() > 1 and self.steps_seen is None and self.checked_step is None:
            self.steps_seen = replicas.OptimizerSteps().start()
        try:
            return self._run(limit)
        finally:
            if self.steps_seen is not None:
                self.steps_seen.stop()
                self.steps_seen = None

    def _run(self, limit: int | None) -> int:
        drv = self.drv
        with (_Signals() if self.stop is None else _Keep(self.stop)) as stop:
            if hasattr(stop, "running"):
                stop.running = True
            while not drv.done and (limit is None or drv.steps < limit):
                drv.run(max_steps=self._chunk(limit))
                if self.on_chunk is not None:
                    self.on_chunk(drv)
                signum, due = self._agree(stop)
                if signum:
                    self.signal = signum
                    break
                if not drv.done and (due or (self.every is not None and self.location is not None
                                             and drv.steps - self.saved_step >= self.every)):
                    self.save()
            if not self.signal:
                self.check_replicas()  # the run's end (also without a checkpoint): before anything is reported
            self.save()
        return 128 + self.signal if self.signal else 0


class _Keep:
    def __init__(self, stop):
        self.stop = stop

    def __enter__(self):
        return self.stop

    def __exit__(self, *exc):
        return None
