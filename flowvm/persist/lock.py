"""One run per checkpoint: a lock held while a run saves to a location, so that a second run saving to the
same place is refused, naming the process that holds it, instead of the last writer silently winning.

``holding(target)`` is a context manager around a run that saves to target:

- A local path: an advisory lock (``fcntl.flock``) on the file ``.NAME.lock`` beside it, which holds the
  owner's process id, host name and start time (for the message a second run gets).  The operating system
  releases the lock when its process ends, however it ends (SIGKILL too): the lock file of a dead process is
  taken over by the next run, and removed when a run ends.  On NFS the lock works where the server supports
  POSIX locks (NFSv4, or v3 with lockd); where ``fcntl`` does not exist (Windows) there is no lock.
- A URL: the lock is the object ``NAME.lock`` beside it, created with the store's conditional write (fsspec's
  exclusive mode ``"xb"``: on S3 a PUT with ``If-None-Match: *``), removed when the run ends.  A process
  killed mid-run leaves it behind: a later run from the same host takes it over when that process is gone;
  from another host it is refused, naming the owner, until the lock object is deleted.  A store whose fsspec
  filesystem has no exclusive mode gets no lock.
"""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..base.errors import CheckpointError
from .location import Location
from .remote import dead

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["holding", "hold_as_rank", "lock_name", "ranks_lock_name", "owner_text"]


def lock_name(path: Path) -> Path:
    """The lock file of a local checkpoint path."""
    return path.parent / f".{path.name}.lock"


def _owner() -> bytes:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode()


def _read_owner(data: bytes) -> dict:
    try:
        owner = json.loads(data[:4096].decode())
        return owner if isinstance(owner, dict) else {}
    except (ValueError, UnicodeDecodeError):
        return {}


def owner_text(owner: dict) -> str:
    """The process holding a lock, in words (from what its lock file says)."""
    pid, host, since = owner.get("pid"), owner.get("host"), owner.get("since")
    who = f"process {pid}" if type(pid) is int else "another process"
    if isinstance(host, str):
        who += f" on {host[:100]!r}"
    if isinstance(since, str):
        who += f" (since {since[:40]})"
    return who


def _refusal(target: Any, owner: dict, where: str) -> CheckpointError:
    return CheckpointError(target, f"in use: {owner_text(owner)} is running a run that saves here (lock {where}); "
                                   "wait until it ends or stop it, or give this run another --checkpoint")


@contextmanager
def holding(target: Any) -> Iterator[None]:
    """Hold the lock of the checkpoint location target for the block; a CheckpointError naming the owner
    if another process holds it."""
    loc = Location.of(target)
    target, path = loc.given, loc.path
    if path is None:
        with _holding_object(loc):
            yield
        return
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = _lock_local(target, Path(path))
    try:
        _no_ranks_left(target, Path(path))
    except BaseException:
        os.close(fd)
        raise
    try:
        yield
    finally:
        _remove_ranks_lock(Path(path))
        try:
            os.unlink(lock_name(Path(path)))  # while still holding it: a waiting opener sees a fresh file
        except OSError:
            pass
        os.close(fd)


def _remove_ranks_lock(path: Path) -> None:
    """The ranks' lock file, once no rank holds it (the run's ranks have ended)."""
    try:
        fd = os.open(ranks_lock_name(path), os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(ranks_lock_name(path))
    except OSError:
        pass
    finally:
        os.close(fd)


def ranks_lock_name(path: Path) -> Path:
    """The lock file the ranks of a data-parallel run saving to path hold, shared, while they live."""
    return path.parent / f".{path.name}.ranks.lock"


def hold_as_rank(target: Any) -> None:
    """A rank of a data-parallel run saving to target holds the ranks' lock, shared, until its process ends:
    a run whose launcher died while its ranks live still holds its checkpoint (``holding`` refuses)."""
    loc = Location.of(target)
    if loc.path is None or fcntl is None:
        return
    name = ranks_lock_name(Path(loc.path))
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # kept open, never closed: released when the rank ends
        os.pwrite(fd, _owner(), 0)
    except OSError:  # another launcher's check holds it for a moment, or no lock here: the launcher's lock stands
        pass


def _no_ranks_left(target: Any, path: Path) -> None:
    """Refused while ranks of an earlier run saving to path still run (their launcher gone)."""
    name = ranks_lock_name(path)
    if not name.exists():
        return
    fd = os.open(name, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner = _read_owner(os.pread(fd, 4096, 0))
        raise CheckpointError(target, f"in use: ranks of an earlier run still save here ({owner_text(owner)}, whose "
                                      f"launcher is gone; lock {name}); wait until they end or stop them") from None
    finally:
        os.close(fd)


def _lock_local(target: Any, path: Path) -> int:
    name = lock_name(path)
    for _ in range(10):
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:  # a read-only directory: saving names the problem
            raise CheckpointError(target, f"cannot create the lock file {name}: {err.strerror or err}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = _read_owner(os.pread(fd, 4096, 0))
            os.close(fd)
            raise _refusal(target, owner, str(name)) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(name).st_ino
        except OSError:
            same = False
        if not same:  # removed by its owner between our open and our lock: take the new one
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, _owner(), 0)
        return fd
    raise CheckpointError(target, f"cannot take the lock {name}: it keeps being replaced")


@contextmanager
def _holding_object(loc: Location) -> Iterator[None]:
    fs, path = loc.filesystem()
    target = loc.given
    name = f"{path}.lock"
    if not _create_object(fs, name, target):
        yield
        return
    try:
        yield
    finally:
        try:
            fs.rm_file(name)
        except Exception:  # the store is gone: the lock object stays, and names its owner
            pass


def _create_object(fs: Any, name: str, target: Any) -> bool:
    """Create the lock object name exclusively; False when the store has no exclusive writes."""
    for attempt in range(2):
        try:
            with fs.open(name, "xb") as f:
                f.write(_owner())
            return True
        except FileExistsError:
            pass
        except (ValueError, NotImplementedError, TypeError):  # no exclusive mode: no lock (documented)
            return False
        try:
            owner = _read_owner(fs.cat_file(name))
        except Exception:
            owner = {}
        pid = owner.get("pid")
        if attempt == 0 and owner.get("host") == socket.gethostname() and type(pid) is int and dead(pid):
            try:
                fs.rm_file(name)  # its process is gone: take it over
            except Exception:
                pass
            continue
        raise _refusal(target, owner, f"object {name}")
    return False
