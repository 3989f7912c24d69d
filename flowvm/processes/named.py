"""Where a SPAWN's fragment runs: its executor field resolved in this process.

A SPAWN submits ``run_job(payload)`` (flowvm/processes/job.py) to a
``concurrent.futures.Executor``: the payload is one pickle of the fragment
and the values of the registers it reads; the child runs the fragment with a
fresh Driver and sends back its value and the registers it wrote, or the
error it raised with its traceback text, as data: any exception the future
itself raises is therefore a failure of the executor (a dead worker, a
cancelled task).

Executors:

- ``None``: the default pool (flowvm/processes/executors.py), started in the
  background when a run holding a SPAWN on it starts (``start_ahead``).
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
from typing import Any

from ..base.errors import SpawnError
from . import executors
from .executors import ExecutorRef, default_executor, executor_by_token, start_default_executor

_named: dict[str, Any] = {}
_modes: dict[str, str] = {}  # executor name -> "error" or "warn" (see register_executor)


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
        executor = executor_by_token(spec.token)
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

    if executors.default_pool_is_up() or getattr(process.current_process(), "_inheriting", False):
        return
    try:
        start_default_executor()
    except SpawnError:  # the main script has no file: the SPAWN's first step says so
        pass


def _default_or_start():
    pool, starting = start_default_executor()
    return pool if pool is not None else starting
