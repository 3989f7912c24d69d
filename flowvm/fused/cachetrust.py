"""What makes the persistent cache of compiled packages (flowvm/fused/cache.py) safe to load from: who may
write its directory, the digests of each entry's files, and the marks of entries being loaded.

- The directory: ``refusal(path)`` says why a cache directory must not be used (another user owns it, or one
  above it; group or others may write it), or None.  A cache that someone else may write could hold any
  library, and its manifests are no defence then: whoever writes an entry can write its manifest too.
- The manifest (``MANIFEST``, written into an entry after its files, and renamed into place with them): the
  entry's key and the SHA-256 digest of each of its files (and of the decision kept with it, when there is
  one).  ``check`` compares an entry with its manifest before anything of it is loaded: a file changed,
  swapped for another entry's, missing or added, or a manifest copied under another key's name, fails.
- The marks: an entry is marked as being loaded (``loading``) while its libraries are opened; a mark left
  by a process that died (``dead_mark``) means the load crashed it, and the entry is evicted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import stat
import time

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
LOADING = ".loading-"        # a mark: .loading-<pid>@<host>, while that process loads the entry
MARK_MAX_AGE = 600.0         # seconds: a mark older than this is a crash's, whoever left it
_CHUNK = 1 << 20


# ------------------------------------------------------------------------------------------ the directory
def refusal(path: str) -> str | None:
    """Why the cache directory ``path`` must not be used, or None.  The directory itself (when it exists)
    must be owned by this user or by root, and writable by neither group nor others; each directory above
    it, up to the first one this user owns (which flowvm created, or the user's own), must be owned by this
    user or root and writable by nobody else unless it has the sticky bit (as /tmp has)."""
    me = os.geteuid() if hasattr(os, "geteuid") else None
    if me is None:  # pragma: no cover - no owners to check (Windows)
        return None
    current = os.path.realpath(path)
    first = True
    while True:
        try:
            st = os.stat(current)
        except FileNotFoundError:
            st = None
        except OSError as err:
            return f"{current} cannot be examined ({err.strerror})"
        if st is not None:
            if not stat.S_ISDIR(st.st_mode):
                return f"{current} is not a directory"
            if st.st_uid not in (me, 0):
                return f"{current} is owned by another user ({_user(st.st_uid)})"
            if st.st_mode & 0o022 and (first or not st.st_mode & stat.S_ISVTX):
                return f"{current} is writable by {_who(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):o})"
            if not first and st.st_uid == me:
                return None  # the user's own directory: what is above it is the system's
        up = os.path.dirname(current)
        if up == current:
            return None
        current, first = up, False


def entry_refusal(st: os.stat_result) -> str | None:
    """Why an entry's directory (its ``lstat``) must not be read, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if hasattr(os, "geteuid") and st.st_uid not in (os.geteuid(), 0):
        return f"owned by another user ({_user(st.st_uid)})"
    if st.st_mode & 0o022:
        return f"writable by {_who(st.st_mode)}"
    return None


def _who(mode: int) -> str:
    return " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if mode & bit)


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name}, uid {uid}"
    except (ImportError, KeyError):
        return f"uid {uid}"


def makedirs(path: str) -> None:
    """Create path and the directories missing above it, each readable and writable by this user alone."""
    missing = []
    current = os.path.abspath(path)
    while not os.path.isdir(current):
        missing.append(current)
        up = os.path.dirname(current)
        if up == current:
            break
        current = up
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass


# ------------------------------------------------------------------------------------------- the digests
def digest(path: str) -> str:
    """The SHA-256 of the regular file at path (never through a symbolic link)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        h = hashlib.sha256()
        view = memoryview(bytearray(_CHUNK))
        while n := f.readinto(view):
            h.update(view[:n])
        return h.hexdigest()


def copy_with_digest(src: str, dst: str) -> tuple[str, list[int]]:
    """Copy the file src to dst (a new file, readable and writable by this user alone); the SHA-256 of the
    bytes written, and the copy's ``stamp`` once written."""
    h = hashlib.sha256()
    with open(src, "rb") as f, open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            out.write(chunk)
        out.flush()
        return h.hexdigest(), stamp(os.fstat(out.fileno()))


def stamp(st: os.stat_result) -> list[int]:
    """What changes whenever a file's bytes change, or the file is swapped for another: its device and inode,
    its size, and its modification and status-change times (the kernel sets the last at every write, rename
    into place or metadata change; no user can set it back)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _unchanged(path: str, want: list[int] | None) -> bool:
    """Whether the regular file at path is, by its ``stamp``, the very file whose digest was taken."""
    if want is None:
        return False
    st = os.lstat(path)
    return stat.S_ISREG(st.st_mode) and stamp(st) == want


def write_manifest(folder: str, key: str, files: dict[str, str], decision: str | None = None,
                   stamps: dict[str, list[int]] | None = None) -> None:
    """Write the manifest of the entry in folder (atomically: a temporary file renamed over it); ``stamps``:
    each file's ``stamp`` when its digest was taken."""
    record = {"format": MANIFEST_FORMAT, "key": key, "files": dict(sorted(files.items()))}
    if decision is not None:
        record["decision"] = decision
    if stamps:
        record["stamps"] = stamps
    tmp = os.path.join(folder, f".tmp-{MANIFEST}-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with open(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, MANIFEST))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_manifest(folder: str, key: str) -> dict | None:
    """The manifest of the entry in folder when it is well formed and made for this key, else None."""
    try:
        fd = os.open(os.path.join(folder, MANIFEST), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with open(fd, "rb") as f:
            got = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(got, dict) or got.get("format") != MANIFEST_FORMAT or got.get("key") != key:
        return None
    files = got.get("files")
    if not _digests(files) or not _stamps(got.get("stamps", {}), files):
        return None
    if "decision" in got and not isinstance(got["decision"], str):
        return None
    return got


def _digests(files) -> bool:
    """Whether a manifest's files are a non-empty {plain name: SHA-256 in hex}."""
    return isinstance(files, dict) and bool(files) and all(
        isinstance(n, str) and _plain_name(n) and isinstance(d, str) and len(d) == 64 for n, d in files.items())


def _stamps(stamps, files: dict) -> bool:
    """Whether a manifest's stamps are {a name it lists: five integers} (``stamp``)."""
    return isinstance(stamps, dict) and all(
        n in files and isinstance(v, list) and len(v) == 5 and all(type(i) is int for i in v)
        for n, v in stamps.items())


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..", MANIFEST) and os.sep not in name and not name.startswith(".") and \
        (os.altsep is None or os.altsep not in name)


def check(folder: str, key: str, names: list[str], extra: set[str]) -> str | None:
    """Why the entry in folder (its files: names) does not match its manifest for this key, or None.  Files
    besides those it lists, the manifest, ``extra`` and temporary or mark files fail too."""
    manifest = read_manifest(folder, key)
    if manifest is None:
        return "no manifest made for its key"
    files = manifest["files"]
    for name in names:
        if name not in files and name != MANIFEST and name not in extra and not name.startswith("."):
            return f"a file its manifest does not list ({name})"
    stamps = manifest.get("stamps", {})
    for name, want in files.items():
        path = os.path.join(folder, name)
        try:
            if _unchanged(path, stamps.get(name)):  # the file hashed when it was stored, untouched since
                continue
            got = digest(path)
        except OSError:
            return f"{name} is missing or unreadable"
        if got != want:
            return f"{name} does not match its digest"
    return None


# ---------------------------------------------------------------------------------------------- the marks
def _host() -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:64] or "host"


@contextlib.contextmanager
def loading(folder: str):
    """Mark the entry in folder as being loaded by this process while the block runs (best effort: a
    read-only cache is loaded unmarked)."""
    mark = os.path.join(folder, f"{LOADING}{os.getpid()}@{_host()}")
    try:
        os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600))
        made = True
    except OSError:
        made = False
    try:
        yield
    finally:
        if made:
            with contextlib.suppress(OSError):
                os.unlink(mark)


def dead_mark(folder: str, names: list[str]) -> str | None:
    """The mark among names (an entry's files) left by a process that died while it loaded the entry, or
    None.  A mark of another host's process counts as dead once older than ``MARK_MAX_AGE`` (a load takes
    milliseconds), as does any mark that old (its process id may since have been reused)."""
    marks = [n for n in names if n.startswith(LOADING)]
    if not marks:
        return None
    host, now = _host(), time.time()
    for name in marks:
        pid_text, _, where = name[len(LOADING):].partition("@")
        try:
            age = now - os.lstat(os.path.join(folder, name)).st_mtime
        except OSError:
            continue  # its process finished loading
        if age > MARK_MAX_AGE:
            return name
        if where == host and pid_text.isdigit() and not _alive(int(pid_text)):
            return name
    return None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    import psutil

    try:
        return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
