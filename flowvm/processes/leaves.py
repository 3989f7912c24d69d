"""POPEN and SPAWN: leaves whose work runs in another process.

Both are leaves of the driver's *leaf protocol* (see flowvm/machine/driver.py): the
first step starts the work and every later step polls it without blocking,
returning ``PENDING`` (the step counts, ``step()`` returns INCOMPLETE) until
the work is done; the step that finds it done gives the leaf's value.  So
``WEAVE(-1, [SPAWN(a), SPAWN(b)])`` runs a and b at the same time, and a
CALL woven beside a POPEN keeps stepping while the command runs.

The running process or future lives in ``driver.live``, a cache that is never
pickled.  A copy of a driver made while a POPEN or SPAWN is in flight
(pickle, deepcopy, a checkpoint) therefore starts that work again when it is
resumed: the command is launched again and the fragment submitted again
(at-least-once), unless it had finished and been collected by a step before
the copy.  Make commands and fragments safe to repeat (write to a temporary
name and rename, for example).

Nothing outlives its driver: a POPEN's process (its whole process group) is
killed when the driver holding it is garbage-collected, when a WEAVE abandons
the POPEN, and at interpreter exit; a SPAWN's task is cancelled in the same
cases (a task already running in a process pool runs to its end and its
result is dropped).

Each live handle has ``ready_future()``: a ``concurrent.futures.Future`` done
when the next poll will finish the leaf, which ``Driver.run`` and
``Driver.arun`` wait on when every runnable leaf is pending, instead of
polling in a busy loop.
"""

from __future__ import annotations

import numbers
import os
import shlex
import subprocess
import time
from typing import Any

from ..pickled import stable
from ..program.analysis import writes
from ..base.sentinels import PENDING
from ..program.elements import Element, Leaf, check_element as _check_element, check_target as _check_target
from ..base.errors import CommandError, SpawnError, SpawnTimeout, VerifyError
from .executors import ExecutorRef, default_executor, executor_by_token, executor_token, shutdown_default_executor
from .named import check_executor, executor_name, register_executor, start_ahead
from .commands import RunningCommand
from .job import Job
from ..program.registers import Register, iter_registers

__all__ = ["POPEN", "SPAWN", "CommandError", "SpawnError", "SpawnTimeout", "register_executor", "default_executor",
           "shutdown_default_executor"]




def _check_timeout(timeout: Any, owner: str) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"{owner}: timeout must be None or a number of seconds > 0, got {timeout!r}")
    return float(timeout)


def _print_value(value: Any, limit: int = 60) -> str:
    from ..program.printer import fmt

    return fmt(value, limit)


# ===================================================================== POPEN



@stable("flowvm")
class POPEN(Leaf):
    """One leaf that runs an OS command: launched on its first step, polled by every later one.

    ``args`` is a list of arguments (Registers anywhere in it are read when
    the command is launched; numbers are turned into text) or a string split
    like a shell would (``shlex.split``; no shell runs).  ``cwd`` and ``env``
    may be Registers too; ``env``, as in ``subprocess``, replaces the whole
    environment.  The command's stdin is /dev/null and it runs in its own
    process group, killed as a whole when the POPEN is dropped.

    The value is the exit code; with ``capture=True`` it is a
    ``subprocess.CompletedProcess`` with ``stdout`` and ``stderr`` (text when
    ``text=True``).  ``check=True`` raises ``CommandError``, with the end of
    stderr, when the exit code is not 0 (without ``capture`` the command's
    stderr still reaches this process's stderr as it comes; its tail is
    kept for the message).  ``timeout`` kills the
    command after that many seconds and raises ``subprocess.TimeoutExpired``.
    A step that raises leaves the POPEN in place: the next step launches the
    command again.

    >>> import sys
    >>> from flowvm import SEQ, Registers
    >>> reg = Registers()
    >>> prog = SEQ([POPEN([sys.executable, "-c", "print(6 * 7)"], capture=True, store_to=reg("out"))])
    >>> prog.run().stdout
    '42\\n'
    """

    kind = "POPEN"
    is_leaf = True
    polls = True  # its steps poll work running elsewhere: how many depends on timing

    def __init__(self, args: Any, store_to: Register | None = None, cwd: Any = None, env: Any = None,
                 check: bool = False, capture: bool = False, text: bool = True, timeout: float | None = None):
        if isinstance(args, str):
            try:
                args = shlex.split(args)
            except ValueError as err:
                raise ValueError(f"POPEN: cannot split the command {args!r:.80} like a shell would ({err}); "
                                 "give a list of arguments instead") from None
        if isinstance(args, Register) or not isinstance(args, (list, tuple)):
            raise TypeError(f"POPEN: args must be a list of arguments or a command string, "
                            f"got {type(args).__name__} {args!r:.60}")
        if not args:
            raise ValueError("POPEN: args is empty; the first argument is the program to run")
        for i, a in enumerate(args):
            if isinstance(a, bool) or not isinstance(a, (str, bytes, os.PathLike, numbers.Number, Register)):
                raise TypeError(f"POPEN: argument {i} must be a str, path, number or Register, "
                                f"got {type(a).__name__} {a!r:.60}")
        if env is not None and not isinstance(env, (dict, Register)):
            raise TypeError(f"POPEN: env must be a dict (or a Register), got {type(env).__name__}")
        if cwd is not None and not isinstance(cwd, (str, bytes, os.PathLike, Register)):
            raise TypeError(f"POPEN: cwd must be a path (or a Register), got {type(cwd).__name__}")
        for flag, value in (("check", check), ("capture", capture), ("text", text)):
            if not isinstance(value, bool):
                raise TypeError(f"POPEN: {flag} must be True or False, got {value!r}")
        self._init(args=tuple(args), store_to=_check_target(store_to, "POPEN"), cwd=cwd, env=env,
                   check=check, capture=capture, text=text, timeout=_check_timeout(timeout, "POPEN"))

    def own_reads(self) -> list[Register]:
        return list(iter_registers([self.args, self.cwd, self.env]))

    def own_writes(self) -> list[Register]:
        return [self.store_to] if self.store_to is not None else []

    def header_text(self) -> str:
        target = f"{self.store_to.name} = " if self.store_to is not None else ""
        opts = [name for name in ("check", "capture") if getattr(self, name)]
        if self.timeout is not None:
            opts.append(f"timeout {self.timeout:g}s")
        if self.cwd is not None:
            opts.append(f"cwd {_print_value(self.cwd)}")
        return f"{target}POPEN {_print_value(list(self.args), 80)}" + (f" ({', '.join(opts)})" if opts else "")

    def __flowvm_source__(self):
        """(constructor, args, kwargs) rebuilding this element (flowvm.to_source)."""
        defaults = {"store_to": None, "cwd": None, "env": None, "check": False, "capture": False, "text": True,
                    "timeout": None}
        return POPEN, (list(self.args),), {k: getattr(self, k) for k, d in defaults.items() if getattr(self, k) != d}

    # -- the leaf protocol
    def bind(self, driver, frame):
        live, key, registers, el = driver.live, id(frame), driver.registers, self

        def leaf():
            proc = live.get(key)
            if proc is None:
                live[key] = RunningCommand.launch(el, registers)
                return PENDING
            if proc.popen.poll() is None:
                if el.timeout is not None and time.monotonic() - proc.started > el.timeout:
                    del live[key]
                    proc.kill()
                    out, err = proc.output()
                    raise subprocess.TimeoutExpired(proc.argv, el.timeout, out, err)
                return PENDING
            del live[key]
            value = proc.finish(el)
            if el.store_to is not None:
                registers[el.store_to.name] = value
            return value

        return leaf

    def abandon(self, driver, frame) -> None:
        proc = driver.live.pop(id(frame), None)
        if proc is not None:
            proc.kill()


# ===================================================================== SPAWN
@stable("flowvm")
class SPAWN(Leaf):
    """Run a program fragment in another process; merge back the registers it writes.

    Only the registers the fragment reads are shipped (their values when the
    SPAWN starts), and only those it writes come back, found by static
    analysis (``flowvm.program.analysis.reads``/``writes``); of those, the registers
    the fragment did write are merged into the parent's register file in the
    step that finds the fragment finished.  Objects the fragment reaches
    travel as copies: changes made to them in the child (a model trained in
    place) are lost unless the fragment stores them to a register.  The value
    is the fragment's, also stored to ``store_to``.

    ``executor``: None (a local process pool shared by the whole process,
    started in a background thread by the first SPAWN, whose steps poll
    PENDING meanwhile: the registers are read at its first step all the same),
    any ``concurrent.futures.Executor`` (``client.get_executor()`` for Dask;
    a Dask Client works too), or a name given to
    ``flowvm.register_executor``.  ``timeout`` bounds the
    fragment's run time (``SpawnTimeout``).

    A fragment that raises makes the parent's step raise the same exception,
    with the child's traceback text in a note and the parent's registers
    untouched; the next step submits the fragment again.  A dead worker, a
    broken pool or a cancelled task raises ``SpawnError``.

    >>> from flowvm import CALL, Registers
    >>> reg = Registers(x=20)
    >>> prog = SPAWN(CALL(abs, reg("x"), store_to=reg("y")))
    >>> print(prog)
    SPAWN:
        y = abs(x)
    """

    kind = "SPAWN"
    is_leaf = True
    polls = True  # its steps poll work running elsewhere: how many depends on timing

    def __init__(self, element: Element, executor: Any = None, store_to: Register | None = None,
                 timeout: float | None = None):
        _check_element(element, "SPAWN", "fragment")
        if executor is not None and not isinstance(executor, (str, ExecutorRef)):
            executor = check_executor(executor, "SPAWN")
        self._init(body=element, executor=executor, store_to=_check_target(store_to, "SPAWN"),
                   timeout=_check_timeout(timeout, "SPAWN"))
        self.own_reads()  # a fragment that cannot run fails here, where it is built

    @property
    def children(self):
        return (self.body,)

    def with_children(self, children):
        (body,) = children
        return SPAWN(body, self.executor, self.store_to, self.timeout)

    def own_reads(self) -> list[Register]:
        """The registers the fragment needs from outside (those it may read before writing them)."""
        return self._cached_subtree("outside_reads", self._outside_reads)

    def _outside_reads(self) -> list[Register]:
        from ..program.analysis import all_registers
        from ..program.verify import verify

        refs: dict[str, Register] = {}
        for r in all_registers(self.body):
            refs.setdefault(r.name, r)
        given: dict[str, None] = {}
        while True:
            try:
                verify(self.body, given)
                break
            except VerifyError as err:
                if err.register is None or err.register in given:
                    raise VerifyError(f"SPAWN fragment: {err}", err.path, err.register) from None
                given[err.register] = None
        return [refs[n] for n in given]

    def own_writes(self) -> list[Register]:
        own = [self.store_to] if self.store_to is not None else []
        return own + [r for r in _refs(self.body) if r.name in writes(self.body)]

    def run_starts(self) -> None:
        """A run holding this SPAWN starts (its driver is made, or a copy takes its first step): the default
        pool, if the fragment goes there, starts in the background now, not at this SPAWN's first step."""
        start_ahead(self.executor)

    def header_text(self) -> str:
        target = f"{self.store_to.name} = " if self.store_to is not None else ""
        opts = [f"executor {executor_name(self.executor)}"] if self.executor is not None else []
        if self.timeout is not None:
            opts.append(f"timeout {self.timeout:g}s")
        return f"{target}SPAWN" + (f" ({', '.join(opts)})" if opts else "") + ":"

    def __flowvm_source__(self):
        """(constructor, args, kwargs) rebuilding this element (flowvm.to_source)."""
        kwargs = {k: getattr(self, k) for k in ("executor", "store_to", "timeout") if getattr(self, k) is not None}
        return SPAWN, (self.body,), kwargs

    # -- an executor instance cannot be pickled: a copy refers to it in this process
    def __getstate__(self) -> dict:
        state = super().__getstate__()
        ex = state.get("executor")
        if ex is not None and not isinstance(ex, (str, ExecutorRef)):
            state["executor"] = ExecutorRef(executor_token(ex))
        return state

    def __setstate__(self, state: dict) -> None:
        ex = state.get("executor")
        if isinstance(ex, ExecutorRef):
            found = executor_by_token(ex.token)
            if found is not None:
                state = dict(state, executor=found)
        super().__setstate__(state)

    # -- the leaf protocol
    def bind(self, driver, frame):
        live, key, registers, el = driver.live, id(frame), driver.registers, self

        def leaf():
            job = live.get(key)
            if job is None:
                live[key] = Job.submit(el.body, el.executor, registers, el.timeout)
                return PENDING
            if job.future is None:  # waiting for the default pool to start
                try:
                    job.submitted()
                except BaseException:
                    del live[key]
                    raise
                return PENDING
            if job.moved():  # left unstarted on a retired pool: to the fresh one
                job.drop()
                live[key] = Job.submit(el.body, el.executor, registers, el.timeout)
                return PENDING
            if not job.future.done():
                if el.timeout is not None and job.overdue(el.timeout):
                    del live[key]
                    job.cancel()
                    raise SpawnTimeout(f"the fragment ran longer than the timeout of {el.timeout:g} s on the "
                                       f"{executor_name(el.executor)}, inside one step (the worker stops it "
                                       "only between steps); its task was cancelled (a fragment already "
                                       "running in a process pool runs on, its result dropped)")
                return PENDING
            del live[key]
            return job.finish(el.executor, el.store_to, registers)

        return leaf

    def abandon(self, driver, frame) -> None:
        job = driver.live.pop(id(frame), None)
        if job is not None:
            job.cancel()


def _refs(el: Element) -> list[Register]:
    from ..program.analysis import all_registers

    seen: dict[str, Register] = {}
    for r in all_registers(el):
        seen.setdefault(r.name, r)
    return list(seen.values())


POPEN.frame_kind = POPEN  # a subclass is a POPEN (Element.frame_kind)
SPAWN.frame_kind = SPAWN
