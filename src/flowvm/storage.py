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
  its own.
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

import io
import os
import re
import secrets
import socket
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from .errors import CheckpointError

__all__ = ["open_write", "read_bytes", "saved_location", "open_read", "read_start", "check_target",
           "is_url", "local_path"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_LOCAL_SCHEMES = {"file", "local"}
# Stores where an object appears only when its upload completes, replacing the previous one in one step.
ATOMIC_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
_INSTALL = "pip install 'flowvm[s3]'"


# ------------------------------------------------------------------ what a target is
def _scheme(target: Any) -> str | None:
    """The URL scheme of target (lower case), or None for a local path.  Only a str can be a URL: a Path
    has already collapsed the ``//``."""
    if not isinstance(target, str):
        return None
    match = _SCHEME.match(target)
    return match.group(1).lower() if match else None


def is_url(target: Any) -> bool:
    """Whether target is a URL handled by fsspec (``file://`` URLs are local paths)."""
    scheme = _scheme(target)
    return scheme is not None and scheme not in _LOCAL_SCHEMES


def local_path(target: Any) -> Path | None:
    """The local path target names (a plain path or a ``file://`` URL), or None for another URL.

    ``file:///abs/path`` and ``file://localhost/abs/path`` are absolute; ``file://rel/path`` is relative to
    the current directory, as fsspec reads it.
    """
    scheme = _scheme(target)
    if scheme is None:
        return Path(target)
    if scheme not in _LOCAL_SCHEMES:
        return None
    rest = target[len(scheme) + 3:]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    return Path(rest)


def saved_location(target: Any) -> Any:
    """What save() returns for target: a Path for a local file, the URL (a str) for any other."""
    path = local_path(target)
    return path if path is not None else target


# ------------------------------------------------------------------ local files
@contextmanager
def _open_write_local(path: Path) -> Iterator[BinaryIO]:
    directory = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise CheckpointError(path, "is a directory; give a file name to save to")
    if not directory.is_dir():
        raise CheckpointError(path, f"cannot save: no directory {directory}")
    try:
        fd, tmp = _create_temporary(path)
    except OSError as err:
        raise CheckpointError(path, f"cannot save: {err.strerror or err} in {directory}") from err
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


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
    except FileNotFoundError:
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
        if not pid_text.isdigit() or not _dead(int(pid_text)):
            continue
        try:
            os.unlink(path.parent / name)
        except OSError:
            pass


def _dead(pid: int) -> bool:
    """Whether no process pid runs on this host (this process and other users' count as alive)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
        return False  # alive: perhaps saving right now
    except ProcessLookupError:
        return True
    except OSError:
        return False


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


# ------------------------------------------------------------------ fsspec URLs
def _storage_options(scheme: str) -> dict:
    """Options for the filesystem of scheme that fsspec would not find by itself."""
    if scheme not in ("s3", "s3a"):
        return {}
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        return {}
    from fsspec.config import conf

    configured = conf.get(scheme, {})
    if configured.get("endpoint_url") or (configured.get("client_kwargs") or {}).get("endpoint_url"):
        return {}  # fsspec's configuration names the endpoint: it wins, as it would without flowvm
    return {"endpoint_url": endpoint}


def _filesystem(url: str) -> tuple[Any, str, str]:
    """(filesystem, path within it, scheme) for an fsspec URL."""
    scheme = _scheme(url)
    try:
        import fsspec.core
    except ImportError:
        raise CheckpointError(url, f"{scheme}:// URLs need fsspec, which is not installed: {_INSTALL}") from None
    try:
        fs, path = fsspec.core.url_to_fs(url, **_storage_options(scheme))
    except ImportError as err:  # the scheme's backend (s3fs, gcsfs, adlfs, ...) is missing
        hint = _INSTALL if scheme in ("s3", "s3a") else "install the fsspec backend for it"
        raise CheckpointError(url, f"{scheme}:// URLs need a package that is not installed ({err}): "
                                   f"{hint}") from None
    except ValueError as err:
        raise CheckpointError(url, f"unsupported URL: {err}") from None
    if not path.strip("/") or url.endswith("/") or (scheme in ATOMIC_STORES and "/" not in path.strip("/")):
        raise CheckpointError(url, "names a bucket or a directory; give the name of an object to save to")
    return fs, path, scheme


def _error_code(err: BaseException) -> str | None:
    """The error code of the S3-style service error behind err (botocore's ClientError), if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            if code:
                return str(code)
        err = err.__cause__ or err.__context__
    return None


def _kind_named(err: BaseException, *names: str) -> bool:
    return any(cls.__name__ in names for cls in type(err).__mro__)


def _reason(err: BaseException, url: str) -> str:
    """What went wrong, in words, for an error the store raised."""
    code = _error_code(err)
    bucket = url[len(_scheme(url) or "") + 3:].partition("/")[0]
    if code == "NoSuchBucket":
        return f"no such bucket {bucket!r}"
    if code in ("NoSuchKey", "404", "NotFound"):
        return "no such object"
    if code in ("AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem",
                "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                "TokenRefreshRequired"):
        return f"access denied ({code}: {err})"
    if _kind_named(err, "NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "DefaultCredentialsError"):
        hint = ""
        if _scheme(url) in ("s3", "s3a"):
            hint = ": set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or use an instance role)"
        return f"no credentials ({err}){hint}"
    if _kind_named(err, "FileExpired"):
        return "replaced while it was being read; read it again"
    if _kind_named(err, "EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError"):
        return f"cannot reach the store ({err})"
    if isinstance(err, FileNotFoundError):
        return "no such object" if _scheme(url) in ATOMIC_STORES | {"memory"} else "no such file"
    if isinstance(err, IsADirectoryError):
        return "is a directory, not a checkpoint file"
    if isinstance(err, PermissionError):
        return f"access denied ({err})" if str(err) else "access denied"
    if isinstance(err, NotImplementedError):
        return f"the {_scheme(url)}:// filesystem does not support this ({err or 'not implemented'})"
    return f"{type(err).__name__}: {err}"


def _store_error(url: str, err: BaseException, doing: str = "") -> CheckpointError:
    return CheckpointError(url, doing + _reason(err, url))


class _Writing:
    """The file object open_write gives for a URL: writes go to the store's file, in pieces of at most its
    block size (so that a large write is uploaded as several parts while the rest is still in memory), and
    the store's errors become CheckpointErrors naming the URL.  Nothing else of the store's file (flush,
    close) is reachable from the block: only open_write completes or abandons the upload."""

    def __init__(self, f: Any, url: str):
        self._f, self._url = f, url
        self._piece = getattr(f, "blocksize", None) or (8 << 20)
        self._written = 0

    def write(self, data) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
        try:
            for start in range(0, len(view), self._piece):
                self._f.write(view[start:start + self._piece])
        except Exception as err:
            raise _store_error(self._url, err, "cannot save: ") from err
        self._written += len(view)
        return len(view)

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        """Nothing: the store's file uploads when it holds a full part, and completes only at the end."""

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return False


def _abandon(f: Any) -> None:
    """Give up an upload without completing it: abort it (a multipart or resumable upload) and mark the
    file closed, since closing or garbage-collecting an fsspec file completes its upload."""
    try:
        f.discard()
    except Exception:
        pass  # already completed, or the store is unreachable: an unfinished upload stays invisible
    finally:
        try:
            f.closed = True
        except Exception:
            pass


def _pending_uploads(fs: Any, path: str) -> set[str]:
    """The ids of the unfinished multipart uploads of the S3 object at path (best effort: empty when they
    cannot be listed)."""
    bucket, key, _ = fs.split_path(path)
    try:
        out = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    except Exception:
        return set()
    return {u["UploadId"] for u in out.get("Uploads", []) if u.get("Key") == key and u.get("UploadId")}


def _abort_uploads(fs: Any, path: str, ids: set[str]) -> None:
    """Abort the unfinished multipart uploads ids of path: left by saves that were killed (a save that
    completed after they began makes them obsolete).  Best effort."""
    bucket, key, _ = fs.split_path(path)
    for upload in ids:
        try:
            fs.abort_mpu(bucket, key, upload)
        except Exception:
            pass


@contextmanager
def _write_object(fs: Any, path: str, url: str, scheme: str) -> Iterator[Any]:
    """Write an object directly: it appears when its upload completes, at the end of a block that did not
    raise."""
    stale = _pending_uploads(fs, path) if scheme in ("s3", "s3a") else set()
    try:
        f = fs.open(path, "wb")
    except Exception as err:
        raise _store_error(url, err, "cannot save: ") from err
    done = False
    try:
        yield _Writing(f, url)
        try:
            f.close()  # completes the upload: the object is replaced now, whole
        except Exception as err:
            raise _store_error(url, err, "cannot save: ") from err
        done = True
    finally:
        if not done:
            _abandon(f)
    if stale:
        _abort_uploads(fs, path, stale)


@contextmanager
def _write_in_memory(fs: Any, path: str, url: str) -> Iterator[Any]:
    """Gather the data, then store it in one step (memory:// files are visible from the moment they are
    opened)."""
    buf = io.BytesIO()
    yield buf
    try:
        fs.pipe_file(path, buf.getvalue())
    except Exception as err:
        raise _store_error(url, err, "cannot save: ") from err


def _temporary_name(path: str, host_pid: str = "") -> str:
    """A temporary name beside path (with host_pid, this process's own, else the prefix of them all)."""
    base = path.rpartition("/")[2]
    return f"{path[:len(path) - len(base)]}.{base}.{host_pid}"


def _remove_orphaned_remote_temporaries(fs: Any, path: str) -> None:
    """Remove the temporaries that saves of path from this host left when they were killed (the names
    carry host and process id; those of other hosts are left alone: whether they are alive is unknown)."""
    mine = _temporary_name(path, f"{socket.gethostname()}-").rpartition("/")[2]
    try:
        entries = fs.ls(path[:len(path) - len(path.rpartition("/")[2])] or ".", detail=False)
    except Exception:
        return
    for entry in entries:
        name = entry.rstrip("/").rpartition("/")[2]
        if not (name.startswith(mine) and name.endswith(".tmp")):
            continue
        pid_text = name[len(mine):-len(".tmp")].partition("-")[0]
        if pid_text.isdigit() and _dead(int(pid_text)):
            try:
                fs.rm(entry)
            except Exception:
                pass


@contextmanager
def _write_and_move(fs: Any, path: str, url: str) -> Iterator[Any]:
    """Write a temporary file beside path and move it over path at the end of a block that did not raise."""
    _remove_orphaned_remote_temporaries(fs, path)
    tmp = _temporary_name(path, f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}.tmp")
    try:
        f = fs.open(tmp, "wb")
    except Exception as err:
        raise _store_error(url, err, "cannot save: ") from err
    try:
        yield _Writing(f, url)
        try:
            f.close()
            fs.mv(tmp, path)
        except Exception as err:
            raise _store_error(url, err, "cannot save: ") from err
    except BaseException:
        try:
            f.close()
        except Exception:
            pass
        try:
            fs.rm(tmp)
        except Exception:
            pass
        raise


# ------------------------------------------------------------------ the interface
@contextmanager
def open_write(target: Any) -> Iterator[BinaryIO]:
    """A binary file whose contents replace target atomically when the block ends without an error."""
    path = local_path(target)
    if path is not None:
        with _open_write_local(path) as f:
            yield f
        return
    fs, path, scheme = _filesystem(target)
    if scheme == "memory":
        writer = _write_in_memory(fs, path, target)
    elif scheme in ATOMIC_STORES:
        writer = _write_object(fs, path, target, scheme)
    else:
        writer = _write_and_move(fs, path, target)
    with writer as f:
        yield f


def read_bytes(target: Any) -> bytes:
    """The whole contents of target."""
    path = local_path(target)
    if path is not None:
        return _read_local(target, path)
    fs, path, scheme = _filesystem(target)
    try:
        if scheme in ("s3", "s3a"):
            # One GET, which sees one version of the object; s3fs's concurrent ranged GETs (for objects
            # over its block size) could mix the old and the new object if a save replaced it meanwhile.
            try:
                return fs.cat_file(path, max_concurrency=1)
            except TypeError:  # an s3fs before concurrent reads: it reads with one GET anyway
                return fs.cat_file(path)
        return fs.cat_file(path)
    except Exception as err:
        raise _store_error(target, err) from err


def read_start(target: Any, n: int, missing_ok: bool = False) -> bytes | None:
    """The first n bytes of target (all of it when shorter); None if it does not exist and missing_ok."""
    try:
        path = local_path(target)
        if path is not None:
            return _read_local(target, path, n)
        with open_read(target) as f:
            return f.read(n)
    except CheckpointError as err:
        if missing_ok and err.reason in ("no such file", "no such object"):
            return None
        raise


class _Reading(io.RawIOBase):
    """A store's file for reading, whose errors become CheckpointErrors naming the URL."""

    def __init__(self, f: Any, url: str):
        self._f, self._url = f, url

    def _guard(self, call, *args):
        try:
            return call(*args)
        except Exception as err:
            raise _store_error(self._url, err) from err

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._guard(self._f.read, len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def read(self, size: int = -1) -> bytes:
        return self._guard(self._f.read, size)

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._guard(self._f.seek, offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        try:
            self._f.close()
        except Exception:
            pass
        super().close()


@contextmanager
def open_read(target: Any) -> Iterator[BinaryIO]:
    """A binary file to read target from (on S3: reads of one version of the object; a replacement while
    it is read is an error, not a mix of the two)."""
    path = local_path(target)
    if path is not None:
        with _reading_errors(target):
            f = open(path, "rb")
        with f:
            yield f
        return
    fs, path, _ = _filesystem(target)
    try:
        f = fs.open(path, "rb")
    except Exception as err:
        raise _store_error(target, err) from err
    with _Reading(f, target) as reader:
        yield reader


def check_target(target: Any) -> None:
    """Raise a CheckpointError if target cannot be saved to for a reason known before saving: a directory,
    a missing directory, a URL whose filesystem is not installed, a URL naming a bucket.  Nothing is
    written."""
    path = local_path(target)
    if path is not None:
        if path.is_dir():
            raise CheckpointError(target, "is a directory; give a file name")
        if not path.parent.resolve().is_dir():
            raise CheckpointError(target, f"no directory {path.parent}")
        return
    _filesystem(target)
