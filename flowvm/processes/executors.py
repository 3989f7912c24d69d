"""Where SPAWN fragments run: the default process pool, named executors, and the job a child runs.

A SPAWN submits ``run_job(payload)`` to a ``concurrent.futures.Executor``.
The payload is one pickle (flowvm's pickler: lambdas, closures and global
generators by reference) of the fragment and the values of the registers it
reads; the parent's register file itself never travels: the fragment's
register references are rebuilt, in the child, over a fresh register file
holding only those values.  The child runs the fragment with a fresh Driver
and sends back its value and the registers it wrote, or the error it raised
with its traceback text, as data: any exception the future itself raises is
therefore a failure of the executor (a dead worker, a cancelled task).

Executors:

- ``None``: the default, one local process pool shared by all SPAWNs of this
  process, created on first use (``forkserver`` start method where there is
  one, else ``spawn``: never ``fork``, which is unsafe with threads around),
  one worker per available core, its workers killed at interpreter exit.
  A SPAWN starts it in a background thread (``start_default_executor``), all
  its workers at once, and waits for it without blocking its caller.
- any ``concurrent.futures.Executor`` instance, such as a Dask client's
  ``client.get_executor()``.  An executor cannot be pickled, so a program
  holding one pickles a reference to it, valid in this process only.
- a name given to ``register_executor(name, executor)``: a program that
  names its executor can be resumed in another process once that process
  registers an executor under the same name.

>>> register_executor("local", None)   # the name now means the default pool
>>> executor_name("local"), executor_name(None)
("'local'", 'default pool')
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
from .starts import move_unstarted, report_starts_to, stop_reading, watch_starts

_lock = threading.RLock()
_pool = None  # the default pool, created on first use
_starting: cf.Future | None = None  # done when the default pool being started in a background thread is up
_pool_pid = None  # the process that created it: a forked child must leave it alone
_exit_hook_installed = False
_retired: dict = {}  # former default pools -> their abandoned futures (killed when the rest is done, or at exit)
_watched: dict = {}  # retired pools -> their futures that already have a _kill_when_idle callback
_named: dict[str, Any] = {}
_modes: dict[str, str] = {}  # executor name -> "error" or "warn" (see register_executor)
_by_token: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def main_guard_hint() -> str:
    """A hint when the main script lacks ``if __name__ == '__main__':`` (workers re-run an unguarded script)."""
    import ast
    import sys

    missing = unimportable_main()
    if missing is not None:
        return f" Note: if the pool's workers start with forkserver or spawn, {unimportable_main_text(missing)}."
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not str(path).endswith(".py"):
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return ""
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return ""
    return (f" Note: {path} has no `if __name__ == '__main__':` guard; each new worker process imports the main "
            "script, so it runs the script's work again and fails: put that work under the guard.")


def unimportable_main() -> str | None:
    """The path a spawn or forkserver worker would run to import the main module, when no such file exists
    (a script piped on stdin: ``python - < script.py``); else None.

    Such a worker runs the main script's file again before it takes any work
    (as multiprocessing.spawn decides: a main module with a ``__spec__`` is
    imported by name instead), fails to find it and dies.
    """
    import sys

    main = sys.modules.get("__main__")
    if main is None or getattr(getattr(main, "__spec__", None), "name", None) is not None \
            or getattr(sys, "frozen", False):  # a frozen application's bundler takes care of its workers
        return None
    path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return None  # python -c, an interactive session: the workers leave the main module alone
    from multiprocessing import process

    if not os.path.isabs(path) and process.ORIGINAL_DIR is not None:
        path = os.path.join(process.ORIGINAL_DIR, path)
    return None if os.path.exists(path) else path


def unimportable_main_text(path: str) -> str:
    how = "was read from stdin" if os.path.basename(path) == "<stdin>" else "has no file"
    return (f"the main script {how}, so pool workers started with forkserver or spawn (never fork) cannot "
            f"import it: such a worker imports the main script again, from its file ({path!r} here, which "
            "does not exist), before it takes any work, and dies. Run the script from a file "
            "(python script.py), or give SPAWN an executor of your own")


def _check_main_importable() -> None:
    path = unimportable_main()
    if path is not None:
        raise SpawnError(f"the default pool cannot start: {unimportable_main_text(path)}.")


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
            _check_main_importable()
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


def register_executor(name: str, executor, *, versions: str = "error") -> None:
    """Make ``SPAWN(..., executor=name)`` run on executor in this process (None: the default pool).

    Register the name again in a process that loads a checkpoint of such a
    program before resuming it.  A fragment sent to any executor but the default
    pool takes along the code that no installed distribution holds, and its worker
    refuses it when its versions of the packages the fragment uses differ from
    this process's (see flowvm.processes.shipping); ``versions="warn"`` runs it
    anyway, with a SpawnVersionWarning here.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"executor name must be a non-empty str, got {name!r}")
    if versions not in ("error", "warn"):
        raise ValueError(f"register_executor({name!r}): versions must be 'error' or 'warn', got {versions!r}")
    if executor is not None:
        executor = check_executor(executor, f"register_executor({name!r})")
        from . import shipping

        shipping.warm()
    _named[name] = executor
    _modes[name] = versions


def version_mode(spec) -> str:
    """What a worker does when its package versions differ from this process's: "error" or "warn"."""
    return _modes.get(spec, "error") if isinstance(spec, str) else "error"


def is_default_pool(executor) -> bool:
    """Whether executor is the default local pool (or a retired one), whose workers share this process's
    files: fragments go to it without shipping code or checking versions."""
    return executor is _pool or (executor is not None and executor in _retired)


def check_executor(executor, owner: str):
    """executor itself if it can run jobs; a Dask Client becomes its executor."""
    if isinstance(executor, cf.Executor):
        return executor
    get = getattr(executor, "get_executor", None)
    if callable(get):  # dask.distributed.Client: its submit() does not return concurrent.futures
        return get()
    if not callable(getattr(executor, "submit", None)):
        raise TypeError(f"{owner}: executor must be a concurrent.futures.Executor, a name given to "
                        f"flowvm.register_executor, or None; got {type(executor).__name__}")
    return executor


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


def executor_name(spec) -> str:
    if spec is None:
        return "default pool"
    if isinstance(spec, str):
        return repr(spec)
    if isinstance(spec, ExecutorRef):
        return spec.token.split("@")[0]
    return type(spec).__name__


def resolve_executor(spec, wait: bool = True):
    """The executor a SPAWN's executor field stands for, in this process.

    With wait=False, a default pool that is not up yet is a future instead
    (see start_default_executor): done when it is, then ask again.
    """
    if spec is None:
        return default_executor() if wait else _default_or_start()
    if isinstance(spec, str):
        try:
            executor = _named[spec]
        except KeyError:
            known = ", ".join(repr(k) for k in sorted(_named)) or "none"
            raise SpawnError(f"no executor is registered under the name {spec!r} in this process "
                             f"(registered: {known}); call flowvm.register_executor({spec!r}, ...) "
                             "before running or resuming the program") from None
        if executor is None:
            return default_executor() if wait else _default_or_start()
        return executor
    if isinstance(spec, ExecutorRef):
        executor = _by_token.get(spec.token)
        if executor is None:
            raise SpawnError(f"the SPAWN's executor ({spec.token.split('@')[0]}) was pickled by reference and "
                             "does not exist in this process; to resume in another process, register it with "
                             "flowvm.register_executor(name, executor) and build the SPAWN with "
                             "executor=name")
        return executor
    return spec


def start_ahead(spec) -> None:
    """A run holding a SPAWN with this executor field starts: if its fragments go to the default pool, start
    the pool in the background now (see start_default_executor), so that its workers are up by the time the
    SPAWN's first step submits the fragment.  Never raises: a pool that cannot start fails that step.

    Nothing starts in a process that is itself starting as a worker (a spawn or forkserver child importing
    the main script): a script that makes a driver outside its ``__main__`` guard must not have every worker
    start a pool of its own.
    """
    if isinstance(spec, str):
        if _named.get(spec, spec) is not None:  # another executor, or a name not registered (yet)
            return
    elif spec is not None:
        return
    from multiprocessing import process

    if _pool is not None or getattr(process.current_process(), "_inheriting", False):
        return
    try:
        start_default_executor()
    except SpawnError:  # the main script has no file: the SPAWN's first step says so
        pass


def _default_or_start():
    pool, starting = start_default_executor()
    return pool if pool is not None else starting


def executor_by_token(token: str):
    """The executor a pickled ExecutorRef names, if it lives in this process; else None."""
    return _by_token.get(token)
