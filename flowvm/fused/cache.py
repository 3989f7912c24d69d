"""A persistent cache of the packages compiled in child processes (flowvm/fused/outofprocess.py), so that a
second run of a program, or a resumed run on any machine sharing the cache, starts with its steps compiled.

An entry is a directory named by the job's key, holding the files the child wrote (``step.pt2``, or
``forward.pt2``, ``backward.pt2`` and ``meta.json``), and once a run has timed the package against eager,
``decision.json``: which form was faster, so that later runs take it from their first execution.  The key (``key``) hashes the job's pickle (the
generated step's code and constants, its inputs' layouts, the modules' structure with stand-in tensors, the
compiler's options and the torch settings) with what the package's code depends on besides: flowvm's,
torch's and python's versions, the machine's architecture and the CPU capability torch compiles for.

- Where: ``FLOWVM_CACHE_DIR``, else ``$XDG_CACHE_HOME/flowvm/compiled`` (``~/.cache/flowvm/compiled``);
  ``FLOWVM_CACHE_DIR=off`` (or empty) turns the cache off.
- How big: ``FLOWVM_CACHE_MAX_BYTES`` (default 2 GB); the least recently used entries go first.
- Writes are atomic (a temporary directory renamed into place): concurrent writers of one key leave one
  entry, and a reader never sees half of one.  An entry that fails to load or to verify is evicted.
- Safe to load from (flowvm/fused/cachetrust.py): a directory another user owns or may write is refused
  (one warning, then no cache in this process); each entry holds a manifest (``MANIFEST``: its key and the
  SHA-256 of each file, written last), checked before anything of the entry is loaded; an entry that fails
  the check, or whose load killed a process (a mark left by a dead process), is evicted and compiled anew.
- A read-only cache is read (nothing is written to it); a write that fails (a full disk) leaves neither an
  entry nor a hint naming one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import threading
import time
import warnings

from . import cachetrust
from .cachetrust import MANIFEST

FORMAT = 3                      # the entries' layout; a change makes every older entry a miss
MAX_BYTES = 2 * 1024 ** 3
TEMP_PREFIX = ".tmp-"
DECISION = "decision.json"      # what a run measured of the entry's package (see note)
HINTS = ".hints"                # empty files named by the hints of the steps stored (see may_hold)
_OFF = {"", "off", "0", "none", "false", "no"}
_refused: dict[str, str | None] = {}   # a cache directory's verdict in this process (cachetrust.refusal)
_refused_lock = threading.Lock()


class Damaged(OSError):
    """A cached entry does not match its manifest: it is not loaded."""


def root() -> str | None:
    """The cache's directory, or None when it is turned off or refused (another user owns it or may write
    it: cachetrust.refusal; warned once, then the cache is off for the process)."""
    where = location()
    if where is None or not _trusted(where):
        return None
    return where


def _trusted(where: str, again: bool = False) -> bool:
    """Whether the cache directory where may be used; a refusal is warned of once and kept for the process.
    A directory that does not exist yet is checked again once it does."""
    with _refused_lock:
        if where in _refused and not again:
            return _refused[where] is None
    why = cachetrust.refusal(where)
    with _refused_lock:
        if why is None and not os.path.isdir(where):
            return True  # checked again when it exists
        first = where not in _refused or _refused[where] is None
        _refused[where] = why
    if why is not None and first:
        from ..base.errors import FusionWarning

        warnings.warn(FusionWarning(
            f"flowvm: the cache of compiled steps at {where} is not used in this process: {why}; a cache "
            "another user may write could hold any code (docs/optimizer.md, the persistent cache). Give "
            "FLOWVM_CACHE_DIR a directory of your own, or FLOWVM_CACHE_DIR=off"), stacklevel=3)
    return why is None


def location() -> str | None:
    """The cache's directory as configured, or None when it is turned off (not checked: see ``root``)."""
    given = os.environ.get("FLOWVM_CACHE_DIR")
    if given is not None:
        return None if given.strip().lower() in _OFF else os.path.abspath(os.path.expanduser(given))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flowvm", "compiled")


def max_bytes() -> int:
    given = os.environ.get("FLOWVM_CACHE_MAX_BYTES", "").strip()
    if not given:
        return MAX_BYTES
    try:
        return int(float(given))
    except ValueError:
        raise ValueError(f"FLOWVM_CACHE_MAX_BYTES must be a number of bytes, got {given!r}") from None


_GENERATED = re.compile(rb"<flowvm FUSED [0-9a-f]+>")


def key(payload: bytes) -> str:
    """The key of a job: its pickle (the generated function's file name made the same in every process)
    and what its package's code depends on besides."""
    import torch

    from ..base.version import __version__

    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", lambda: "")()
    h = hashlib.sha256()
    for part in (f"flowvm-compiled {FORMAT}", __version__, torch.__version__, sys.version.split()[0],
                 platform.machine(), platform.system(), capability):
        h.update(str(part).encode() + b"\0")
    h.update(_GENERATED.sub(b"<flowvm FUSED>", payload))
    return h.hexdigest()[:40]


def may_hold(hint: str) -> bool:
    """Whether an entry of a step with this hint (``jobs.hint``: a cheap digest of the step's code, layouts and
    settings) may be in the cache: when not, a lookup need not pickle the step to compute its key.  A hint
    is only a hint: its entry may since have gone (``lookup`` then misses)."""
    where = root()
    return where is not None and os.path.exists(os.path.join(where, HINTS, hint))


def add_hint(hint: str, k: str | None = None) -> None:
    """Note that an entry of a step with this hint was stored (the cache is an optimization: errors pass).
    With its key k, only when that entry is there, whole (its manifest is written last): a write that
    failed leaves no hint naming nothing."""
    where = root()
    if where is None:
        return
    if k is not None and not os.path.isfile(os.path.join(where, k, MANIFEST)):
        return
    try:
        cachetrust.makedirs(os.path.join(where, HINTS))
        with open(os.path.join(where, HINTS, hint), "a"):
            pass
    except OSError:
        pass


def note_hint(hint: str, decision: dict) -> None:
    """Keep with a hint what a run measured of a step with it (as ``note`` does with an entry), so that a later
    run that would only run it eagerly need not pickle the step for its key (``hinted``).  Only where the hint
    is (an entry of it was stored); errors pass."""
    where = root()
    if where is None or not may_hold(hint):
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=os.path.join(where, HINTS))
        with os.fdopen(fd, "w") as f:
            json.dump(decision, f)
        os.replace(tmp, os.path.join(where, HINTS, hint))
    except OSError:
        pass


def hinted(hint: str) -> dict | None:
    """What the last run that measured a step with this hint kept (``note_hint``), or None.  A hint's note is
    advice on speed only: it never decides what runs compiled (an entry's own decision does)."""
    where = root()
    if where is None:
        return None
    try:
        with open(os.path.join(where, HINTS, hint)) as f:
            got = json.loads(f.read(4096) or "null")
    except (OSError, ValueError):
        return None
    ok = isinstance(got, dict) and isinstance(got.get("compiled"), bool) and isinstance(got.get("periods"), int) \
        and all(isinstance(got.get(k), float) and got[k] > 0 for k in ("compiled_s", "eager_s"))
    return got if ok else None


def lookup(k: str) -> str | None:
    """The entry's directory (marked as used now, when the cache is writable), or None.  The entry is
    checked first (``verify``): one that fails is evicted (when the cache is writable) and missed."""
    where = root()
    if where is None:
        return None
    path = os.path.join(where, k)
    try:
        verify(k, path)
    except FileNotFoundError:
        return None
    except OSError:
        evict(k)
        return None
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only cache: read all the same
    return path


def verify(k: str, path: str) -> None:
    """Raise unless the entry of key k at path may be loaded: its directory this user's (or root's) and
    writable by no one else, every file as its manifest (made for key k) says, none else, and no mark of a
    process that died loading it (cachetrust).  FileNotFoundError: there is no entry; Damaged: it fails."""
    why = cachetrust.entry_refusal(os.lstat(path))
    if why is None:
        names = os.listdir(path)
        why = cachetrust.check(path, k, names, {DECISION})
        if why is None:
            mark = cachetrust.dead_mark(path, names)
            if mark is not None:
                why = f"a process died while it loaded the entry ({mark})"
    if why is not None:
        raise Damaged(f"the cached entry {k} is not loaded: {why}")


def loading(path: str):
    """A context marking the entry at path as being loaded by this process (its libraries opened: a crash
    there leaves the mark, and the next process evicts the entry instead of crashing again)."""
    return cachetrust.loading(path)


def note(k: str, decision: dict) -> None:
    """Keep with entry k what a run measured of its package (``DECISION``: whether it ran faster than eager,
    the two times per execution), so that the next run takes the faster form at once (errors pass: the cache
    is an optimization)."""
    where = root()
    if where is None:
        return
    path = os.path.join(where, k)
    manifest = cachetrust.read_manifest(path, k)
    if manifest is None:
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path)
        with os.fdopen(fd, "w") as f:
            json.dump(decision, f)
        os.replace(tmp, os.path.join(path, DECISION))
        # the manifest names the decision's digest: a decision it does not name is none (``decision``)
        cachetrust.write_manifest(path, k, manifest["files"], cachetrust.digest(os.path.join(path, DECISION)),
                                  manifest.get("stamps"))
    except OSError:
        pass


def decision(path: str) -> dict | None:
    """What a run measured of the package in this entry's directory (see ``note``), or None: None too when
    its manifest does not name the decision's digest (a decision kept there lets a later run skip the check
    of its first call against eager)."""
    manifest = cachetrust.read_manifest(path, os.path.basename(os.path.normpath(path)))
    if manifest is None or "decision" not in manifest:
        return None
    try:
        fd = os.open(os.path.join(path, DECISION), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with open(fd, "rb") as f:
            data = f.read(1 << 16)
        if hashlib.sha256(data).hexdigest() != manifest["decision"]:
            return None
        got = json.loads(data)
    except (OSError, ValueError):
        return None
    ok = isinstance(got, dict) and isinstance(got.get("compiled"), bool) and all(
        isinstance(got.get(n), (int, float)) and got[n] >= 0 for n in ("compiled_s", "eager_s", "periods"))
    return got if ok else None


def store(k: str, workdir: str, names: list[str]) -> str | None:
    """Put these files of workdir in the cache as entry k (atomically; an entry already there is kept);
    the entry's directory, or None (cache off, or the disk refused: the cache is an optimization).  The
    files are copied, then the manifest of their digests written, then the whole renamed into place."""
    where = root()
    if where is None:
        return None
    final = os.path.join(where, k)
    try:
        if not os.path.isdir(where):
            cachetrust.makedirs(where)
            if not _trusted(where, again=True):  # someone else's directory made meanwhile: not ours
                return None
        tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=where)
        try:
            copies = {name: cachetrust.copy_with_digest(os.path.join(workdir, name), os.path.join(tmp, name))
                      for name in names}
            cachetrust.write_manifest(tmp, k, {name: d for name, (d, _) in copies.items()},
                                      stamps={name: st for name, (_, st) in copies.items()})
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(final):
                return None
        trim(where, max_bytes())
    except OSError:
        return None
    return final


def evict(k: str) -> None:
    """Remove entry k (it failed to load or to verify)."""
    where = root()
    if where is not None:
        _remove(os.path.join(where, k))


def _remove(path: str) -> None:
    # renamed away first, so that no reader finds a half-removed entry
    gone = f"{os.path.dirname(path)}{os.sep}{TEMP_PREFIX}gone-{os.path.basename(path)}-{os.getpid()}"
    try:
        os.rename(path, gone)
    except OSError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def trim(where: str, limit: int) -> None:
    """Evict the least recently used entries until the cache holds at most ``limit`` bytes; remove the
    temporary directories of writers that died (over an hour old)."""
    entries = []
    total = 0
    now = time.time()
    for name in os.listdir(where):
        path = os.path.join(where, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if name == HINTS:
            continue
        if name.startswith(TEMP_PREFIX):
            if now - st.st_mtime > 3600:
                shutil.rmtree(path, ignore_errors=True)
            continue
        size = _size(path)
        entries.append((st.st_mtime, size, path))
        total += size
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        _remove(path)
        total -= size


def _size(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    total = 0
    for name in os.listdir(path):
        try:
            total += os.path.getsize(os.path.join(path, name))
        except OSError:
            pass
    return total
