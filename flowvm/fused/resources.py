"""What compiles in child processes share with every other program of the user on the machine
(flowvm/fused/outofprocess.py): a machine-wide limit on the compiles running at once, the temporary
directories a killed program leaves behind, resource errors that call for a later try, and the child's CPU
priority.

- *Slots*: a compile runs while it holds one of ``slots()`` lock files (``fcntl.flock``) in a directory of
  the user's under the temporary directory; the lock goes with the processes holding it (the program and
  its child), so a killed program frees its slot.  Two optimized programs queue instead of starting more
  compiles than the machine has cores for (about 1 GB and a core each).
- *Work directories* are named ``flowvm-aot-<pid>-...`` after the program that made them; the first compile
  of a process removes those of programs that no longer run (``sweep``).
- *Resource errors* (``resource_error``): no thread, process, memory or file left for now; the compile is
  tried again later (``backoff``), never reported as the step's failure.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import threading
import time
from typing import Callable, Iterator

WORKDIR_PREFIX = "flowvm-aot-"
STALE_SECONDS = 3600.0     # a work directory this old belongs to no running compile (they stop after 900 s)
MAX_TRIES = 8              # a compile short of resources this many times in a row gives up
_RESOURCE_ERRNOS = {errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC}
_RESOURCE_TEXT = ("can't start new thread", "Resource temporarily unavailable", "Cannot allocate memory",
                  "out of memory", "No space left on device", "Too many open files", "memory exhausted")


def slots() -> int:
    """How many child compiles may run at once on this machine: ``FLOWVM_COMPILE_PROCESSES``, else one
    less than its cores (at least one): the programs keep a core."""
    given = os.environ.get("FLOWVM_COMPILE_PROCESSES", "").strip()
    if given:
        try:
            return max(1, int(given))
        except ValueError:
            raise ValueError(f"FLOWVM_COMPILE_PROCESSES must be a whole number, got {given!r}") from None
    return max(1, (os.cpu_count() or 2) - 1)


def _slot_dir() -> str:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    path = os.path.join(tempfile.gettempdir(), f"flowvm-compile-slots-{uid}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


_local = threading.BoundedSemaphore(slots())  # where there is no fcntl: this process's compiles only


@contextlib.contextmanager
def slot(stopping: Callable[[], bool], poll: float = 0.25) -> Iterator[int | None]:
    """Hold a machine-wide compile slot, waiting for one (yields the lock's file descriptor, for the child
    to hold it too, or None without fcntl); raises ``Stopped`` when ``stopping()`` turns true meanwhile."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        while not _local.acquire(timeout=poll):
            if stopping():
                raise Stopped()
        try:
            yield None
        finally:
            _local.release()
        return
    directory = _slot_dir()
    while True:
        for k in range(slots()):
            fd = os.open(os.path.join(directory, f"slot-{k}"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            try:
                yield fd
            finally:
                os.close(fd)  # the lock goes with the last descriptor (the child's copy, if it still runs)
            return
        if stopping():
            raise Stopped()
        time.sleep(poll)


class Stopped(Exception):
    """The program is ending: no compile starts."""


def resource_error(exc: BaseException | None) -> bool:
    """Whether exc (or an error it was raised from) says the machine is short of threads, processes,
    memory, files or disk for now, rather than that the compile cannot succeed."""
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, MemoryError):
            return True
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
            return True
        if any(text in str(exc) for text in _RESOURCE_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def backoff(tries: int) -> float:
    """Seconds to wait before the next try, after ``tries`` tries short of resources."""
    return min(60.0, 2.0 ** tries)


def lowest_priority() -> None:
    """Run this process at the lowest CPU priority: nice 19 and, on Linux, the idle scheduling class (it
    gets a core only when no other process wants it)."""
    try:
        os.nice(19)
    except (AttributeError, OSError):
        pass
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def workdir() -> str:
    """A new work directory for one compile, named after this process (see ``sweep``)."""
    return tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")


_NAMED = re.compile(re.escape(WORKDIR_PREFIX) + r"(\d+)-")
_swept: list[int] = []  # the process that swept (a forked child sweeps again)


def sweep(force: bool = False) -> list[str]:
    """Remove the work directories of programs that no longer run (killed while they compiled); once per
    process unless force.  A directory whose program runs stays, unless it is older than any compile
    (``STALE_SECONDS``: the number is another process's now).  The directories removed."""
    if _swept and _swept[-1] == os.getpid() and not force:
        return []
    _swept.append(os.getpid())
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(WORKDIR_PREFIX) and _abandoned(path, name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _abandoned(path: str, name: str) -> bool:
    """Whether the work directory at path (named name) is this user's, a real directory, and of a program
    that no longer runs or older than any compile."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    uid = os.getuid() if hasattr(os, "getuid") else None
    if not os.path.isdir(path) or os.path.islink(path) or uid is not None and st.st_uid != uid:
        return False
    match = _NAMED.match(name)
    pid = int(match.group(1)) if match else None
    if pid == os.getpid():
        return False
    return time.time() - st.st_mtime > STALE_SECONDS or pid is not None and not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True
