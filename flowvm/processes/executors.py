"""The default process pool where SPAWN fragments run unless told otherwise, and what it takes to run it.

``None`` as a SPAWN's executor is one local process pool shared by all SPAWNs of this process, created on
first use (``forkserver`` start method where there is one, else ``spawn``: never ``fork``, which is unsafe
with threads around), one worker per available core, its workers killed at interpreter exit.  It starts in a
background thread (``start_default_executor``), all its workers at once, when a run holding a SPAWN on it
starts (``flowvm.processes.named.start_ahead``) or at the SPAWN's first step, whose steps wait for it without
blocking their caller.  A fragment running in it that is abandoned retires the pool (the next SPAWN gets a
fresh one).  Executors given by instance or by name: flowvm/processes/named.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import weakref
from typing import Any

from ..pickled import stable
from ..base.errors import SpawnError
from ..base.workers import process_alive
from .mainscript import check_main_importable
from .starts import move_unstarted, report_starts_to, stop_reading, watch_starts

_lock = threading.RLock()
_pool = None  # the default pool, created on first use
_starting: cf.Future | None = None  # done when the default pool being started in a background thread is up
_pool_pid = None  # the process that created it: a forked child must leave it alone
_exit_hook_installed = False
_retired: dict = {}  # former default pools -> their abandoned futures (killed when the rest is done, or at exit)
_watched: dict = {}  # retired pools -> their futures that already have a _kill_when_idle callback
_by_token: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


# ----------------------------------------------------------------- executors
def default_workers() -> int:
    """Worker processes of the default pool: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_executor():
    """The shared local process pool that SPAWNs without an executor use (created and started on first
    call; this waits while it starts, or for a start already under way)."""
    while True:
        pool, starting = start_default_executor()
        if pool is not None:
            return pool
        starting.result()  # raises the start's error; else the pool is up (or was shut down meanwhile: again)


def start_default_executor() -> tuple[Any, cf.Future | None]:
    """(the default pool, None) when it is up; else (None, a future done once it is), starting it in a
    background thread if no start is under way.  Never blocks on process starts.

    Starting the pool takes a while (0.05 to 0.5 s: the forkserver, and any
    modules it preloads, then the workers), and a caller may be an event loop.
    The future fails with SpawnError if the pool cannot start; its result
    means only "look again": a shutdown meanwhile discards the pool it started.
    """
    global _starting
    with _lock:
        if _pool is not None:
            return _pool, None
        if _starting is None:
            check_main_importable()
            _install_exit_hooks()
            _starting = cf.Future()
            threading.Thread(target=_start_pool, args=(_starting,), name="flowvm-pool-start",
                             daemon=True).start()
        return None, _starting


def _new_pool():
    """A new default pool, every worker started (this blocks while they start), and its start queue.

    All its workers start before the pool's manager thread: the manager watches
    the workers it knows of when it waits, and concurrent.futures starts a
    worker on demand inside submit() after waking it (as in Python 3.11), so
    the death of a worker started that way went unnoticed until another
    worker's task finished (see submit).
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if ctx.get_start_method() == "forkserver":
        _preload_flowvm(ctx)
    started = ctx.SimpleQueue()  # the workers tell when each task starts (Job.overdue, _move_unstarted)
    pool = ProcessPoolExecutor(max_workers=default_workers(), mp_context=ctx,
                               initializer=worker_setup, initargs=(os.getpid(), started))
    launch = getattr(pool, "_launch_processes", None)
    manager = getattr(pool, "_start_executor_manager_thread", None)
    if callable(launch) and callable(manager):
        try:
            with pool._shutdown_lock:
                launch()
                manager()
        except BaseException:
            _kill_pool(pool)
            raise
    return pool, started


def _preload_flowvm(ctx) -> None:
    """Have the forkserver import flowvm before it forks the default pool's workers (when it is not running
    yet), so that each worker starts with flowvm imported instead of importing it itself: the pool is up
    sooner, and the workers' imports take no core from this process meanwhile.

    The modules the forkserver already preloads (``set_forkserver_preload``) are kept.  (Its default,
    ``__main__``, is not imported there as of Python 3.11: the workers import the main script themselves.)
    """
    from multiprocessing import forkserver

    modules = list(getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", None) or [])
    if "flowvm" not in modules:
        ctx.set_forkserver_preload(modules + ["flowvm"])


def default_pool_is_up() -> bool:
    return _pool is not None


def _start_pool(done: cf.Future) -> None:
    """In a background thread: start a default pool and make it the default, unless a shutdown came first."""
    global _pool, _pool_pid, _starting
    try:
        pool, started = _new_pool()
    except BaseException as err:  # noqa: B036 - handed to the SPAWNs waiting on it
        failure = SpawnError(f"the default pool could not start: {type(err).__name__}: {err}")
        failure.__cause__ = err.with_traceback(None)  # its frames would keep the half-made pool alive
    else:
        failure = None
    if failure is not None:
        with _lock:
            if _starting is done:
                _starting = None
        done.set_exception(failure)
        return
    with _lock:
        keep = _starting is done and _pool is None
        if keep:
            watch_starts(pool, started)
            _pool, _pool_pid, _starting = pool, os.getpid(), None
    if not keep:  # shut down while it started
        _kill_pool(pool)
    done.set_result(None)


def _install_exit_hooks() -> None:
    """Kill the default pool's workers at exit (the caller holds _lock; in the thread that asks for a pool,
    not the one that starts it, so that an exit during a start finds the hooks in place)."""
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    # concurrent.futures joins its pools before atexit callbacks run, waiting for
    # running work; this hook must run first, so it registers the same way, later
    # (threading runs these hooks last registered first; importing the module registers its own).
    import concurrent.futures.process  # noqa: F401

    register = getattr(threading, "_register_atexit", None)
    try:
        (register or __import__("atexit").register)(shutdown_default_executor, kill=True)
    except RuntimeError:  # pragma: no cover - interpreter already shutting down
        pass
    # In a multiprocessing child (a fragment that SPAWNs), exiting joins the child's
    # own children before either hook above runs: a finalizer runs before that join.
    from multiprocessing import util

    util.Finalize(None, shutdown_default_executor, kwargs={"kill": True}, exitpriority=100)
    _exit_hook_installed = True


def submit(executor, fn, *args) -> cf.Future:
    """executor.submit(fn, *args), making sure a process pool watches the worker the call may start.

    concurrent.futures' ProcessPoolExecutor (as in Python 3.11) starts a
    worker on demand inside submit(), *after* waking its manager thread, which
    may already be waiting again, on the workers it knew: the new worker's
    death would go unnoticed until some other event woke the manager (another
    worker's result), and a run whose sibling fragments never finish would
    hang.  Waking the manager once more, after the worker is in the pool, makes
    it wait on that worker too.  (The default pool starts all its workers up
    front; this is for a user's pool.)
    """
    procs = getattr(executor, "_processes", None) if isinstance(executor, cf.ProcessPoolExecutor) else None
    before = len(procs) if isinstance(procs, dict) else None
    future = executor.submit(fn, *args)
    if before is not None:
        procs = getattr(executor, "_processes", None)
        if isinstance(procs, dict) and len(procs) != before:
            wakeup = getattr(executor, "_executor_manager_thread_wakeup", None)
            try:
                wakeup.wakeup()
            except Exception:  # pragma: no cover - closed meanwhile (a broken or shut-down pool)
                pass
    return future


def worker_setup(parent: int, started=None) -> None:
    """Run in each worker of the default pool when it starts; parent is the pid of the pool's owner,
    started a queue on which run_job reports when a task with a timeout starts.

    - Ctrl-C in a terminal signals the whole process group, workers included:
      the parent decides what a SIGINT means (save and stop), so workers
      ignore it and their fragments are not cut short.
    - A worker exits when its parent is gone, even killed with SIGKILL, so
      that no worker (nor the forkserver, which lives as long as a worker
      does) is left behind running an abandoned fragment.
    """
    import signal

    report_starts_to(started)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while process_alive(parent):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="flowvm-parent-watch", daemon=True).start()


def shutdown_default_executor(kill: bool = False) -> None:
    """Shut the default pool down (a later SPAWN makes a new one).

    With kill=True its worker processes are killed at once, running fragments
    included; this is what happens at interpreter exit, so that exiting never
    waits for a fragment to finish.
    """
    global _pool, _starting
    if _pool_pid is not None and os.getpid() != _pool_pid:
        _forget_in_child()  # a forked child exiting: the pool and its workers are its parent's
        return
    with _lock:
        pool, _pool = _pool, None
        _starting = None  # a start under way: its thread throws the pool away (see _start_pool)
        retired = list(_retired) if kill else []
        for old in retired:
            del _retired[old]
            _watched.pop(old, None)
    for old in retired:
        _kill_pool(old)
    if pool is None:
        return
    if kill:
        _kill_pool(pool)
    else:
        pool.shutdown(wait=True, cancel_futures=True)
        stop_reading(pool)


def _forget_in_child() -> None:
    """In a forked child: the default pool belongs to the parent; a SPAWN here makes the child its own."""
    global _pool, _pool_pid, _lock, _starting
    _pool = _pool_pid = _starting = None
    _retired.clear()
    _watched.clear()
    _lock = threading.RLock()  # the parent's may have been held by another thread at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _kill_pool(pool) -> None:
    """Kill a process pool's workers, running fragments included, and close it.

    ProcessPoolExecutor has no public way to stop running work before Python 3.14.
    With its workers gone the pool's manager thread ends at once; it is waited
    for, so that concurrent.futures' own exit hook finds the pool closed.
    """
    # Python 3.11's pool, finding its workers gone, sets an error on every task it still holds and
    # fails (InvalidStateError, printed by its thread) on one that was cancelled: drop those first.
    items = getattr(pool, "_pending_work_items", None)
    if isinstance(items, dict):
        for work_id, item in list(items.items()):
            if item.future.cancelled():
                items.pop(work_id, None)
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            proc.kill()
        except Exception:  # pragma: no cover - already gone
            pass
    manager = getattr(pool, "_executor_manager_thread", None)
    try:
        pool.shutdown(wait=False, cancel_futures=True)
    except Exception:  # pragma: no cover
        pass
    if manager is not None:
        manager.join(timeout=5)
    stop_reading(pool)


def retire_running(executor, future: cf.Future | None = None) -> None:
    """future, a fragment running in the default pool, was abandoned (timeout, WEAVE): stop it taking a
    worker.

    A process pool cannot stop one running task, and killing a worker breaks
    the whole pool.  So the pool stops being the default (the next SPAWN gets a
    fresh one); it is killed as soon as every task on it that was not abandoned
    is done (at once when there is none), or at exit.
    """
    global _pool
    with _lock:
        if executor is None:
            return
        if executor is _pool:
            _pool = None
            _retired[executor] = set()
        elif executor not in _retired:
            return
        if future is not None:
            _retired[executor].add(future)
        _move_unstarted(executor)
    _kill_when_idle(executor)


def _move_unstarted(pool) -> None:
    """The tasks of a retired pool that no worker has started may wait there behind abandoned ones for
    ever: they are cancelled where possible and marked moved, and their SPAWNs submit them again to the
    fresh default pool (a task that starts on the old pool meanwhile runs twice: at least once)."""
    move_unstarted(pool, _retired[pool])


def _kill_when_idle(pool) -> None:
    """Kill a retired pool if only abandoned tasks are left on it; else look again when one finishes."""
    with _lock:
        abandoned = _retired.get(pool)
        if abandoned is None:
            return
        items = list((getattr(pool, "_pending_work_items", None) or {}).values())
        others = [wi.future for wi in items if wi.future not in abandoned and not wi.future.done()]
        if not others:
            del _retired[pool]
        watched = _watched.setdefault(pool, set())
        fresh = [f for f in others if f not in watched]
        watched.update(fresh)
    if others:
        for f in fresh:  # one callback per task; callbacks run on the pool's own thread, which _kill_pool joins
            f.add_done_callback(lambda _, pool=pool: threading.Thread(target=_kill_when_idle, args=(pool,),
                                                                       daemon=True).start())
        return
    _watched.pop(pool, None)
    _kill_pool(pool)


def discard_broken(executor) -> None:
    """Forget the default pool if executor is it (a broken pool takes no more work)."""
    global _pool
    with _lock:
        if executor is not None and executor is _pool:
            _pool = None
        else:
            return
    try:
        executor.shutdown(wait=False, cancel_futures=True)
    except Exception:  # pragma: no cover
        pass
    stop_reading(executor)


def is_default_pool(executor) -> bool:
    """Whether executor is the default local pool (or a retired one), whose workers share this process's
    files: fragments go to it without shipping code or checking versions."""
    return executor is _pool or (executor is not None and executor in _retired)


def executor_token(executor) -> str:
    """A process-local reference to an executor instance, written in its place when a program is pickled."""
    token = f"{type(executor).__name__}@{id(executor):x}"
    _by_token[token] = executor
    return token


@stable("flowvm.pickled")
class ExecutorRef:
    """An executor instance as pickled: found again by token in the process that pickled it."""

    __slots__ = ("token",)

    def __init__(self, token: str):
        self.token = token

    def __reduce__(self):
        return ExecutorRef, (self.token,)

    def __repr__(self):
        return f"<executor {self.token}>"


def executor_by_token(token: str):
    """The executor a pickled ExecutorRef names, if it lives in this process; else None."""
    return _by_token.get(token)
