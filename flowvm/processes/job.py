"""A SPAWN fragment's job: the payload the parent submits and the parent's live handle (``Job``).  What the
child runs is flowvm/processes/child.py (``run_job``); where jobs run, flowvm/processes/named.py (the default
pool: flowvm/processes/executors.py), which describes the wire format.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import io
import os
import pickle
import threading
import time
import weakref
from typing import Any

from ..base.errors import SpawnError
from . import shipping
from .executors import discard_broken, is_default_pool, retire_running, submit
from .mainscript import main_guard_hint
from .named import executor_name, resolve_executor, version_mode
from .child import decode_outcome, run_job, run_shipped
from .workerstart import main_module, start_failure, start_failure_text
from .starts import expect_start, forget, started_at, track, was_moved
from ..persist.pickler import Pickler
from ..program.registers import Registers


class _JobPickler(Pickler):
    """flowvm's pickler (as in checkpoints), writing the parent's register file as a placeholder."""

    def __init__(self, buf, registers: Registers):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self._registers = registers

    def persistent_id(self, obj):
        return "flowvm.registers" if obj is self._registers else None


class _ShippingPickler(_JobPickler, shipping.ShippingPickler):
    """The job pickler for executors whose workers may lack this process's files (see shipping)."""

    def __init__(self, buf, registers: Registers, source_tops=()):
        shipping.ShippingPickler.__init__(self, buf, protocol=pickle.HIGHEST_PROTOCOL, source_tops=source_tops)
        self._registers = registers


def job_payload(fragment, registers: Registers, names, nonce: bytes | None = None,
                pickler: type = _JobPickler) -> bytes:
    """The bytes a child needs: fragment, the values of the named registers, a nonce.

    The nonce makes every submission unique, so executors that deduplicate
    identical tasks (Dask) never merge two SPAWNs or a resubmission.
    """
    return _dump(pickler, fragment, registers, names, nonce)[0]


def shipped_payload(fragment, registers: Registers, names, nonce: bytes, mode: str) -> tuple[str, bytes]:
    """(manifest, payload) for an executor whose workers may not share this process's files: the code that
    no installed distribution holds travels by value, the manifest names the versions the worker checks
    (see shipping)."""
    tops: set[str] = set()
    probe = True  # first the fragment alone (its code decides most packages that travel as source), cheaply
    while True:
        payload, pickler = _dump(functools.partial(_ShippingPickler, source_tops=tops), fragment, registers,
                                 [] if probe else names, nonce)
        if probe:
            probe = False
            tops |= pickler.needs_source
            continue
        new = pickler.needs_source - tops
        tops |= pickler.needs_source
        # A package that travels as source must not also travel by value (its classes would come twice, as
        # two classes): written again, by name, when some of its code went by value.
        if not new & pickler.valued_tops:
            return shipping.manifest(pickler.noted, mode, tops), payload


def _dump(pickler_class, fragment, registers: Registers, names, nonce: bytes | None):
    shipped = {n: registers[n] for n in names if n in registers}
    buf = io.BytesIO()
    pickler = pickler_class(buf, registers)
    try:
        pickler.dump((fragment, shipped, nonce or os.urandom(8)))
    except Exception as err:
        for name, value in shipped.items():  # name the register at fault, when one is
            try:
                pickler_class(io.BytesIO(), registers).dump(value)
            except Exception:
                raise SpawnError(f"register {name!r}, which the fragment reads, cannot be pickled to send it "
                                 f"to the other process ({type(err).__name__}: {err}); hold such objects "
                                 "(locks, open files) in the fragment itself") from err
        raise SpawnError(f"the fragment cannot be pickled to send it to the other process "
                         f"({type(err).__name__}: {err})") from err
    return buf.getvalue(), pickler


# ----------------------------------------------------------------- the parent's handle
def _submit(executor, spec, job: tuple, nonce: bytes) -> cf.Future:
    expect_start(executor, nonce)
    try:
        return submit(executor, *job)
    except Exception as err:
        forget(nonce)
        discard_broken(executor)
        raise SpawnError(f"the {executor_name(spec)} refused the fragment: "
                         f"{type(err).__name__}: {err}") from err


def _cancel(future: cf.Future, nonce: bytes | None = None) -> None:
    forget(nonce)
    try:
        future.cancel()
    except Exception:  # pragma: no cover - never raise from a finalizer
        pass


class Job:
    """A submitted SPAWN fragment: the live handle, cancelled when dropped.

    A fragment for the default pool while that pool starts (in a background
    thread) waits in its Job, already pickled, with ``future`` None: the
    thread that started the pool submits it as soon as the pool is up (or the
    next poll does, whichever comes first: ``submitted()``).  A Job cancelled
    or dropped before then is never submitted.
    """

    def __init__(self, future: cf.Future | None, executor, nonce: bytes | None = None):
        self.future = future
        self.executor = executor
        self.nonce = nonce
        self.running_since: float | None = None  # when the executor first reported the task running
        self._waiting: tuple | None = None  # (spec, (run_job, payload, timeout), the pool's start) while future is None
        self._lock: threading.RLock | None = None  # guards _waiting and future while future is None
        self._finalizer = None
        if future is not None:
            self._finalizer = weakref.finalize(self, _cancel, future, nonce)
            track(executor, future, nonce)

    @classmethod
    def submit(cls, fragment, spec, registers: Registers, timeout: float | None = None) -> "Job":
        """Submit fragment, with the registers it reads, to the executor spec stands for (the worker
        stops it at the first step boundary past timeout seconds of running, see run_job).

        The registers are read (pickled) now, whether the task goes to its
        executor now or, for a default pool still starting, once it is up.
        """
        from ..program.analysis import reads

        executor = resolve_executor(spec, wait=False)
        nonce = os.urandom(8)
        names = sorted(reads(fragment))
        if isinstance(executor, cf.Future):  # the default pool, starting
            job = cls(None, None, nonce)
            job._lock = threading.RLock()  # re-entered by a callback that runs at once
            job._wait_for(spec, (run_job, job_payload(fragment, registers, names, nonce), timeout), executor)
            return job
        if is_default_pool(executor):  # its workers share this process's files and installation
            work = (run_job, job_payload(fragment, registers, names, nonce), timeout)
        else:
            work = (run_shipped, *shipped_payload(fragment, registers, names, nonce, version_mode(spec)), timeout)
        return cls(_submit(executor, spec, work, nonce), executor, nonce)

    def _wait_for(self, spec, work: tuple, starting: cf.Future) -> None:
        """Submit once starting is done (the callback holds the Job weakly: a dropped Job is not submitted)."""
        self._waiting = (spec, work, starting)
        ref = weakref.ref(self)

        def pool_up(_):  # in the thread that started the pool (or this one, if it is up already)
            job = ref()
            if job is not None:
                try:
                    job.submitted()
                except Exception:  # the next poll raises it
                    pass

        starting.add_done_callback(pool_up)

    def submitted(self) -> bool:
        """Whether the task is in its executor; one waiting for the default pool is submitted here if the
        pool is up.  Raises SpawnError if the pool could not start or refused the task (the Job is then
        spent: the SPAWN's next step starts over)."""
        if self.future is not None:
            return True
        with self._lock:
            if self.future is not None:
                return True
            if self._waiting is None:  # cancelled
                return False
            spec, work, starting = self._waiting
            if not starting.done():
                return False
            starting.result()  # the pool's start failed: SpawnError
            executor = resolve_executor(spec, wait=False)
            if isinstance(executor, cf.Future):  # shut down meanwhile: a new start
                self._wait_for(spec, work, executor)
                return False
            future = _submit(executor, spec, work, self.nonce)
            self._finalizer = weakref.finalize(self, _cancel, future, self.nonce)
            track(executor, future, self.nonce)
            self.executor, self._waiting, self.future = executor, None, future
            return True

    def ready_future(self) -> cf.Future | None:
        if self.future is None:  # done when the default pool is up (and has the task, or the next poll gives it)
            waiting = self._waiting
            return waiting[2] if waiting is not None else None
        return self.future if isinstance(self.future, cf.Future) else None

    def overdue(self, timeout: float) -> bool:
        """Whether the task still runs twice its timeout and a second after it started: the worker stops
        a fragment at a step boundary, so this one is inside a step that runs on.  Counted from its
        start, so time queued behind other tasks is free.  The default pool's workers report the start;
        other executors' futures say when they run (a user's process pool says so once a task is
        queued for a worker, at most one task early); futures that never do, Dask's, rely on the
        worker's check alone."""
        now = time.monotonic()
        if self.running_since is None:
            reporting, since = started_at(self.executor, self.nonce)
            if reporting:
                self.running_since = since
            elif self.future.running():
                self.running_since = now
            return False
        return now - self.running_since > 2 * timeout + 1.0

    def moved(self) -> bool:
        """Whether the task was left unstarted on a retired pool: its SPAWN submits it again."""
        return self.future is not None and was_moved(self.future)

    def drop(self) -> None:
        """Forget a moved task (its copy on the retired pool is abandoned)."""
        if self._finalizer is not None:
            self._finalizer.detach()
        forget(self.nonce)

    def cancel(self) -> None:
        """Cancel the task; one already running on the default pool retires that pool (see retire_running)."""
        if self.future is None:
            with self._lock:
                self._waiting = None  # never submitted now
            if self.future is None:
                return
        self._finalizer()
        if not self.future.done() or self.future.running():
            retire_running(self.executor, self.future)

    def finish(self, spec, store_to, registers: Registers) -> Any:
        """The fragment's value, its written registers merged into registers; or its error raised."""
        self._finalizer.detach()
        forget(self.nonce)
        where = executor_name(spec)
        try:
            data = self.future.result()
        except cf.CancelledError:
            raise SpawnError(f"the fragment's task was cancelled by the {where} (a lost worker or a "
                             "closed cluster?); the next step submits it again") from None
        except Exception as err:
            name = type(err).__name__
            if isinstance(err, cf.BrokenExecutor) or name == "KilledWorker":
                failure = start_failure(self.executor)
                discard_broken(self.executor)
                if failure is not None:
                    raise SpawnError(start_failure_text(where, failure, main_module())) from err
                raise SpawnError(f"the worker process running the fragment died ({name}: {err}); killed by a "
                                 f"signal or out of memory? The {where} "
                                 + ("is replaced by a new one on the next SPAWN" if spec is None
                                    else "may need replacing") + "." + main_guard_hint()) from err
            raise SpawnError(f"the {where} failed to run the fragment: {name}: {err}") from err
        try:
            outcome = decode_outcome(data)
        except Exception as err:
            raise SpawnError(f"the fragment's outcome cannot be unpickled here ({type(err).__name__}: {err}); "
                             "does it hold an object of a class this process cannot import?") from err
        if outcome[0] == "error":
            _, exc, text, host = outcome
            note = f"flowvm: the SPAWN fragment failed in {host}; its traceback there:\n{text.rstrip()}"
            if exc is None:
                raise SpawnError(f"the fragment raised an exception that cannot be sent back\n{note}")
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: the fragment's, not this process's
                err = SpawnError(f"the fragment raised {type(exc).__name__}{exc.args!r} in {host}: it stops the "
                                 "fragment, not this process; the next step submits the fragment again")
                err.add_note(note)
                raise err from exc
            exc.add_note(note)
            try:
                exc.child_traceback = text
            except Exception:  # pragma: no cover - exceptions with __slots__
                pass
            raise exc
        _, value, written = outcome
        for name, v in written.items():  # item by item: a SPAWN inside a fragment is tracked as a write
            registers[name] = v
        if store_to is not None:
            registers[store_to.name] = value
        return value
