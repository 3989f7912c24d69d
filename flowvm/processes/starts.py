"""When the default pool's workers start their tasks: each worker reports a task's start (its nonce and
the time) on a queue that a thread of the parent reads as reports come.  A SPAWN's timeout counts from that
start (time queued behind other fragments is free), and a retired pool's tasks that never started are
moved to the fresh pool (flowvm/processes/executors.py retires pools; flowvm/processes/job.py asks)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import weakref

_lock = threading.RLock()  # guards the tables below (never held while calling out)
_start_reports: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # default pools -> their start queue
_report_readers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # default pools -> stops their reader
_started: dict[bytes, float] = {}  # task nonce -> when a worker started it (drained from the start queues)
_awaited: set[bytes] = set()  # nonces of default-pool tasks whose SPAWN still waits on them
_nonce_of: "weakref.WeakKeyDictionary[cf.Future, bytes]" = weakref.WeakKeyDictionary()  # default-pool tasks
_moved: "weakref.WeakSet[cf.Future]" = weakref.WeakSet()  # tasks left unstarted on a retired pool
_report_start = None  # in a default pool's worker: puts (nonce, start time) on the pool's start queue


def _drain(reports) -> bool:
    """Move a default pool's start reports into _started (the caller holds _lock); False if the queue is gone."""
    try:
        while not reports.empty():
            n, t = reports.get()
            if n in _awaited:  # else its SPAWN is already over
                _started[n] = t
    except (OSError, EOFError, ValueError):  # the pool is gone
        return False
    return True


def _read_reports(pool, reports):
    """Read a default pool's start reports as they come, in a thread of the pool's owner, until the pool
    is closed (the finalizer returned stops it; it also runs if the pool is garbage-collected).

    The workers write a report to a pipe as each task starts (run_job); read
    only when a SPAWN with a timeout or a retired pool needed one, the pipe
    filled after some 1,700 tasks and every worker blocked there for ever.
    Reads happen under _lock and only while a report is waiting (_drain), so
    the thread and _drain's other callers never block one another.
    """
    import multiprocessing
    from multiprocessing.connection import wait

    reader = getattr(reports, "_reader", None)
    if reader is None:  # pragma: no cover - another multiprocessing: reports are drained when needed only
        return None
    stop_r, stop_w = multiprocessing.Pipe(duplex=False)

    def run() -> None:
        try:
            while True:
                ready = wait([reader, stop_r])
                if stop_r in ready:
                    return
                with _lock:
                    if not _drain(reports):
                        return
        except (OSError, EOFError, ValueError):  # pragma: no cover - closed under it
            pass
        finally:
            stop_r.close()

    threading.Thread(target=run, name="flowvm-start-reports", daemon=True).start()
    return weakref.finalize(pool, _send_stop, stop_w)


def _send_stop(stop_w) -> None:
    try:
        stop_w.send_bytes(b"")
        stop_w.close()
    except (OSError, ValueError):  # pragma: no cover - the reader is gone
        pass


def stop_reading(pool) -> None:
    """Stop reading a default pool's start reports (it is shut down or retired)."""
    stop = _report_readers.pop(pool, None)
    if stop is not None:
        stop()


def _start_of(reports, nonce: bytes | None) -> float | None:
    """When a default-pool worker started the task with this nonce (None: not yet), from its reports."""
    with _lock:
        _drain(reports)
        return _started.get(nonce)


def _forget(nonce: bytes | None) -> None:
    """The task is over for its SPAWN (finished, cancelled, dropped): its start report is not needed."""
    _started.pop(nonce, None)
    _awaited.discard(nonce)


def expect_start(executor, nonce: bytes) -> bool:
    """A task with this nonce is being submitted to executor: keep its start report when one comes (a
    default pool's workers report their tasks' starts).  Whether executor reports starts."""
    if executor in _start_reports:
        _awaited.add(nonce)  # before the worker can report its start
        return True
    return False


def track(executor, future: cf.Future, nonce: bytes | None) -> None:
    """Remember which nonce a default-pool future runs (for moving unstarted tasks off a retired pool)."""
    if nonce is not None and executor in _start_reports:
        _nonce_of[future] = nonce


def started_at(executor, nonce: bytes | None) -> tuple[bool, float | None]:
    """(whether executor reports starts, when the task with this nonce started there or None)."""
    reports = _start_reports.get(executor)
    if reports is None:
        return False, None
    return True, _start_of(reports, nonce)


def forget(nonce: bytes | None) -> None:
    """The task is over for its SPAWN (finished, cancelled, dropped): its start report is not needed."""
    _forget(nonce)


def was_moved(future: cf.Future) -> bool:
    """Whether the task was left unstarted on a retired pool (its SPAWN submits it again)."""
    return future in _moved


def report_start(nonce: bytes) -> None:
    """In a default pool's worker: tell the parent that the task with this nonce starts now."""
    if _report_start is not None:
        _report_start((nonce, time.monotonic()))


def watch_starts(pool, queue) -> None:
    """Read a new default pool's start reports from queue as they come."""
    with _lock:
        _start_reports[pool] = queue
        _report_readers[pool] = _read_reports(pool, queue)


def report_starts_to(queue) -> None:
    """In a default pool's worker: report each task's start on queue (None: report nothing)."""
    global _report_start
    _report_start = queue.put if queue is not None else None


def move_unstarted(pool, abandoned: set) -> None:
    """The tasks of a retired pool that no worker has started (by the pool's start reports): cancelled where
    possible, marked moved (their SPAWNs submit them again) and added to abandoned."""
    reports = _start_reports.get(pool)
    if reports is None:
        return
    with _lock:
        _drain(reports)
    for item in list((getattr(pool, "_pending_work_items", None) or {}).values()):
        fut = item.future
        nonce = _nonce_of.get(fut)
        if fut in abandoned or fut.done() or nonce is None or nonce in _started:
            continue
        fut.cancel()  # refused for the one a pool has queued for a worker already: it is left behind
        _moved.add(fut)
        abandoned.add(fut)


def _reset_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # the parent's may have been held by another thread at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
