"""Checkpoints behind fsspec URLs (``s3://``, ``memory://``, ...): the filesystems, their errors as
CheckpointErrors naming the URL, and the three ways of writing atomically (see flowvm.persist.storage, which
chooses among them and documents the rules per kind of store).
"""

from __future__ import annotations

import io
import os
import re
import secrets
import socket
from contextlib import contextmanager
from typing import Any, Iterator

from ..base.errors import CheckpointError

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
LOCAL_SCHEMES = {"file", "local"}
# Stores where an object appears only when its upload completes, replacing the previous one in one step.
ATOMIC_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
INSTALL_HINT = "pip install 'flowvm[s3]'"



def dead(pid: int) -> bool:
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


def scheme_of(target: Any) -> str | None:
    """The URL scheme of target (lower case), or None for a local path.  Only a str can be a URL: a Path
    has already collapsed the ``//``."""
    if not isinstance(target, str):
        return None
    match = SCHEME.match(target)
    return match.group(1).lower() if match else None


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


def filesystem(url: str) -> tuple[Any, str, str]:
    """(filesystem, path within it, scheme) for an fsspec URL."""
    scheme = scheme_of(url)
    try:
        import fsspec.core
    except ImportError:
        raise CheckpointError(url, f"{scheme}:// URLs need fsspec, which is not installed: {INSTALL_HINT}") from None
    try:
        fs, path = fsspec.core.url_to_fs(url, **_storage_options(scheme))
    except ImportError as err:  # the scheme's backend (s3fs, gcsfs, adlfs, ...) is missing
        hint = INSTALL_HINT if scheme in ("s3", "s3a") else "install the fsspec backend for it"
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
    bucket = url[len(scheme_of(url) or "") + 3:].partition("/")[0]
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
        if scheme_of(url) in ("s3", "s3a"):
            hint = ": set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or use an instance role)"
        return f"no credentials ({err}){hint}"
    if _kind_named(err, "FileExpired"):
        return "replaced while it was being read; read it again"
    if _kind_named(err, "EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError"):
        return f"cannot reach the store ({err})"
    return _os_reason(err, url)


def _os_reason(err: BaseException, url: str) -> str:
    """_reason of the errors fsspec raises as Python's own (a missing object, a directory, ...)."""
    if isinstance(err, FileNotFoundError):
        return "no such object" if scheme_of(url) in ATOMIC_STORES | {"memory"} else "no such file"
    if isinstance(err, IsADirectoryError):
        return "is a directory, not a checkpoint file"
    if isinstance(err, PermissionError):
        return f"access denied ({err})" if str(err) else "access denied"
    if isinstance(err, NotImplementedError):
        return f"the {scheme_of(url)}:// filesystem does not support this ({err or 'not implemented'})"
    return f"{type(err).__name__}: {err}"


def store_error(url: str, err: BaseException, doing: str = "") -> CheckpointError:
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
            raise store_error(self._url, err, "cannot save: ") from err
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
def write_object(fs: Any, path: str, url: str, scheme: str) -> Iterator[Any]:
    """Write an object directly: it appears when its upload completes, at the end of a block that did not
    raise."""
    stale = _pending_uploads(fs, path) if scheme in ("s3", "s3a") else set()
    try:
        f = fs.open(path, "wb")
    except Exception as err:
        raise store_error(url, err, "cannot save: ") from err
    done = False
    try:
        yield _Writing(f, url)
        try:
            f.close()  # completes the upload: the object is replaced now, whole
        except Exception as err:
            raise store_error(url, err, "cannot save: ") from err
        done = True
    finally:
        if not done:
            _abandon(f)
    if stale:
        _abort_uploads(fs, path, stale)


@contextmanager
def write_in_memory(fs: Any, path: str, url: str) -> Iterator[Any]:
    """Gather the data, then store it in one step (memory:// files are visible from the moment they are
    opened)."""
    buf = io.BytesIO()
    yield buf
    try:
        fs.pipe_file(path, buf.getvalue())
    except Exception as err:
        raise store_error(url, err, "cannot save: ") from err


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
        if pid_text.isdigit() and dead(int(pid_text)):
            try:
                fs.rm(entry)
            except Exception:
                pass


@contextmanager
def write_and_move(fs: Any, path: str, url: str) -> Iterator[Any]:
    """Write a temporary file beside path and move it over path at the end of a block that did not raise."""
    _remove_orphaned_remote_temporaries(fs, path)
    tmp = _temporary_name(path, f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}.tmp")
    try:
        f = fs.open(tmp, "wb")
    except Exception as err:
        raise store_error(url, err, "cannot save: ") from err
    try:
        yield _Writing(f, url)
        try:
            f.close()
            fs.mv(tmp, path)
        except Exception as err:
            raise store_error(url, err, "cannot save: ") from err
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


class Reading(io.RawIOBase):
    """A store's file for reading, whose errors become CheckpointErrors naming the URL."""

    def __init__(self, f: Any, url: str):
        self._f, self._url = f, url

    def _guard(self, call, *args):
        try:
            return call(*args)
        except Exception as err:
            raise store_error(self._url, err) from err

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
