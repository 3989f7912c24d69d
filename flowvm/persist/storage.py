"""Where checkpoints live: local files and fsspec URLs, read whole and written atomically.

``open_write(target)`` is a context manager giving a binary file object; what is written appears under
``target`` only when the block ends without an error, all at once: a reader never sees a partly written
checkpoint, and a crash (even SIGKILL) during a write leaves the previous one intact.  ``read_bytes(target)``
returns a checkpoint's bytes, ``open_read(target)`` a binary file to read it from, ``read_start(target, n)``
its first bytes.  Errors are ``CheckpointError``s naming the target, with the reason in words (no such
object, no such bucket, access denied, no credentials, ...).

A target is a local path (a str or an os.PathLike) or, as a str, an fsspec URL (``s3://bucket/key``,
``gs://...``, ``memory://...``, ``sftp://...``).  ``file://`` URLs are local paths.  fsspec is only
imported for URLs, so that local checkpoints need nothing beyond flowvm's own dependencies; a URL without
it installed is a CheckpointError saying ``pip install 'flowvm[s3]'``.

How each kind of store keeps the promise:

- Local paths: the data goes to a temporary file beside the target (named after the writing process, so
  that the next write removes those of killed processes), is flushed to disk, and is renamed over the
  target; the rename is flushed too.  A new file gets the permissions the umask gives; a replaced file keeps
  its own.  The replaced file is held open across the rename and closed by a background thread: freeing a
  large file's blocks (tens of milliseconds for 100 MB) then happens after the save returns, not in it.
- Object stores whose uploads are atomic (S3 and S3-compatible stores, Google Cloud Storage, Azure blobs):
  the object is written directly; it appears, whole, only when the upload completes (a single PUT, or the
  completion of a multipart/resumable upload), and replaces the previous object in one step.  fsspec's file
  objects complete the upload whenever they are closed, also when ``with`` ends on an exception and when
  they are garbage collected, so they are never closed on failure here: the upload is aborted (``discard``)
  and the file marked closed, which leaves the previous object as it was.  A process killed mid-upload
  leaves an unfinished multipart upload, invisible to readers but billed; on S3 the next successful save of
  the same key aborts those that were already pending when it started (a bucket lifecycle rule
  ``AbortIncompleteMultipartUpload`` does it too, for keys that are never saved again).  Reads of S3
  objects use one GET, which sees one version of the object (s3fs's concurrent ranged reads could mix two).
- ``memory://``: the data is gathered in memory and stored in one step when the block ends (fsspec's memory
  files are visible under their name from the moment they are opened).
- Other fsspec filesystems (sftp, hdfs, smb, ...): a temporary file beside the target, moved over it with
  the filesystem's ``mv``; that is as atomic as the filesystem's rename (sftp's posix-rename and most
  POSIX-like stores are).  A temporary left by a killed process is removed by the next save of the target
  from the same host.

S3 is configured as boto does it: the standard AWS environment variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``, ``AWS_PROFILE``), the AWS config
files and instance roles.  ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (an S3-compatible store, a local
test server) is passed to s3fs explicitly, since older botocore releases ignore it; an endpoint set in
fsspec's own configuration (``FSSPEC_S3='{"endpoint_url": ...}'``, which also sets any other s3fs option)
takes precedence.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from ..base.errors import CheckpointError
from .location import Location
from .remote import ATOMIC_STORES, Reading, dead, store_error, write_and_move, write_in_memory, write_object

__all__ = ["open_write", "read_bytes", "saved_location", "open_read", "read_start", "check_target",
           "is_url", "local_path", "Location"]

# ------------------------------------------------------------------ what a target is (see location.py)
def is_url(target: Any) -> bool:
    """Whether target is a URL handled by fsspec (``file://`` URLs are local paths)."""
    return Location.of(target).url is not None


def local_path(target: Any) -> Path | None:
    """The local path target names (a plain path or a ``file://`` URL), or None for another URL."""
    return Location.of(target).path


def saved_location(target: Any) -> Any:
    """What save() returns for target: a Path for a local file, the URL (a str) for any other."""
    return Location.of(target).saved


# ------------------------------------------------------------------ local files
@contextmanager
def _open_write_local(path: Path, given: Any) -> Iterator[BinaryIO]:
    directory = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise CheckpointError(given, "is a directory; give a file name to save to")
    if not directory.is_dir():
        raise CheckpointError(given, f"cannot save: no directory {directory}")
    try:
        fd, tmp = _create_temporary(path)
    except OSError as err:
        raise CheckpointError(given, f"cannot save: {err.strerror or err} in {directory}") from err
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        replace(tmp, path)
    except BaseException as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(err, OSError):  # a full disk, a quota, an immutable file: the previous file is kept
            raise CheckpointError(given, f"cannot save: {err.strerror or err}; the file there is as it "
                                        "was") from err
        raise
    _sync_directory(directory)  # make the rename itself durable


def _sync_directory(directory) -> None:
    try:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # a file system that cannot sync directories
        pass


def replace(tmp: str, path: Path) -> None:
    """os.replace(tmp, path), the file it replaces freed in the background (see the module docstring)."""
    try:
        old = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # a symlink: replaced, its target kept
    except OSError:
        old = None
    try:
        os.replace(tmp, path)
    finally:
        if old is not None:
            _closer.submit(os.close, old)


class _Closer:
    """One daemon thread that closes the file descriptors given to it (started on first use, and again in a
    forked child, which has no copy of it; an fd still queued at exit is closed by the exit)."""

    def __init__(self):
        self._queue = None

    def submit(self, fn, *args) -> None:
        if self._queue is None:
            import queue
            import threading

            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(self._queue,), name="flowvm-free-replaced",
                             daemon=True).start()
        self._queue.put((fn, args))

    @staticmethod
    def _work(jobs) -> None:
        while True:
            fn, args = jobs.get()
            try:
                fn(*args)
            except OSError:  # pragma: no cover - closed meanwhile
                pass

    def wait(self) -> None:
        """Return once the files given so far are closed (and freed)."""
        if self._queue is not None:
            import threading

            done = threading.Event()
            self._queue.put((done.set, ()))
            done.wait()

    def forget(self) -> None:
        self._queue = None


_closer = _Closer()
freed = _closer.wait  # storage.freed(): wait until the files replaced so far are freed (benchmarks use it)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_closer.forget)


def _read_local(target: Any, path: Path, limit: int | None = None) -> bytes:
    """The contents of path (the first limit bytes, with a limit)."""
    with _reading_errors(target):
        if limit is None:
            return path.read_bytes()
        with open(path, "rb") as f:
            return f.read(limit)


@contextmanager
def _reading_errors(target: Any) -> Iterator[None]:
    """A local file that cannot be read: a CheckpointError saying why."""
    try:
        yield
    except (FileNotFoundError, NotADirectoryError):  # the latter: a path through a file (run.ckpt/x)
        raise CheckpointError(target, "no such file") from None
    except IsADirectoryError:
        raise CheckpointError(target, "is a directory, not a checkpoint file") from None
    except PermissionError:
        raise CheckpointError(target, "permission denied") from None


def _remove_orphaned_temporaries(path: Path) -> None:
    """Remove temporary files that saves of path left behind when their process was killed mid-save
    (their names carry the saving process's id; those of live processes are left alone)."""
    prefix, suffix = f".{path.name}.", ".tmp"
    try:
        names = [n for n in os.listdir(path.parent) if n.startswith(prefix) and n.endswith(suffix)]
    except OSError:
        return
    for name in names:
        pid_text = name[len(prefix):-len(suffix)].partition("-")[0]
        if not (pid_text.isascii() and pid_text.isdigit()) or not dead(int(pid_text)):
            continue
        orphan = path.parent / name
        try:
            if orphan.is_dir():  # a save that wrote through a private directory
                shutil.rmtree(orphan, ignore_errors=True)
            else:
                os.unlink(orphan)
        except OSError:
            pass


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new temporary file beside path, with the permissions path has (a new file: those the umask
    gives, as open() would), to be renamed over it."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = None
    _remove_orphaned_temporaries(path)
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
        except FileExistsError:
            continue
        if mode is not None:
            os.fchmod(fd, mode)
        return fd, tmp
    raise FileExistsError(f"no free temporary name beside {path}")


# ------------------------------------------------------------------ the interface
def write_local_with(path: Path, save_to, target: Any = None) -> None:
    """Replace the local file path atomically with what save_to(name) writes to the file it is given by name
    (writers that open the file themselves, such as safetensors' save_file): a temporary beside path, with
    path's permissions, fsynced and renamed over it, the rename made durable."""
    target = path if target is None else target
    directory = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = _create_temporary(path)
        mode = stat.S_IMODE(os.fstat(fd).st_mode)  # path's, or those the umask gives a new file
        os.close(fd)
    except OSError as err:
        raise CheckpointError(target, f"cannot save: {err.strerror or err} in {directory}") from err
    try:
        save_to(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fchmod(fd, mode)  # the writer may have made its own file, with its own permissions
            os.fsync(fd)
        finally:
            os.close(fd)
        replace(tmp, path)
    except BaseException as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(err, OSError) or type(err).__name__ == "SafetensorError":  # a full disk, a quota, ...
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err).strip()[:200]
            raise CheckpointError(target, f"cannot save: {why}; the file there is as it was") from err
        raise
    _sync_directory(directory)  # make the rename itself durable


@contextmanager
def open_write(target: Any) -> Iterator[BinaryIO]:
    """A binary file whose contents replace target atomically when the block ends without an error."""
    loc = Location.of(target)
    if loc.path is not None:
        with _open_write_local(loc.path, loc.given) as f:
            yield f
        return
    fs, path = loc.filesystem()
    if loc.scheme == "memory":
        writer = write_in_memory(fs, path, loc.url)
    elif loc.scheme in ATOMIC_STORES:
        writer = write_object(fs, path, loc.url, loc.scheme)
    else:
        writer = write_and_move(fs, path, loc.url)
    with writer as f:
        yield f


def read_bytes(target: Any) -> bytes:
    """The whole contents of target."""
    loc = Location.of(target)
    if loc.path is not None:
        return _read_local(loc.given, loc.path)
    fs, path = loc.filesystem()
    try:
        if loc.scheme in ("s3", "s3a"):
            # One GET, which sees one version of the object; s3fs's concurrent ranged GETs (for objects
            # over its block size) could mix the old and the new object if a save replaced it meanwhile.
            try:
                return fs.cat_file(path, max_concurrency=1)
            except TypeError:  # an s3fs before concurrent reads: it reads with one GET anyway
                return fs.cat_file(path)
        return fs.cat_file(path)
    except Exception as err:
        raise store_error(loc.url, err) from err


def read_start(target: Any, n: int, missing_ok: bool = False) -> bytes | None:
    """The first n bytes of target (all of it when shorter); None if it does not exist and missing_ok."""
    loc = Location.of(target)
    try:
        if loc.path is not None:
            return _read_local(loc.given, loc.path, n)
        with open_read(loc) as f:
            return f.read(n)
    except CheckpointError as err:
        if missing_ok and err.reason in ("no such file", "no such object"):
            return None
        raise


@contextmanager
def open_read(target: Any) -> Iterator[BinaryIO]:
    """A binary file to read target from (on S3: reads of one version of the object; a replacement while
    it is read is an error, not a mix of the two)."""
    loc = Location.of(target)
    if loc.path is not None:
        with _reading_errors(loc.given):
            f = open(loc.path, "rb")
        with f:
            yield f
        return
    fs, path = loc.filesystem()
    try:
        f = fs.open(path, "rb")
    except Exception as err:
        raise store_error(loc.url, err) from err
    with Reading(f, loc.url) as reader:
        yield reader


def check_target(target: Any) -> None:
    """Raise a CheckpointError if target cannot be saved to for a reason known before saving: a directory,
    a missing directory, a URL whose filesystem is not installed, a URL naming a bucket.  Nothing is
    written."""
    loc = Location.of(target)
    if loc.path is not None:
        if loc.path.is_dir():
            raise CheckpointError(loc.given, "is a directory; give a file name")
        if not loc.path.parent.resolve().is_dir():
            raise CheckpointError(loc.given, f"no directory {loc.path.parent}")
        return
    loc.filesystem()
