"""What a worker does with a fragment that another executor's SPAWN sent it with a manifest
(flowvm/processes/shipping.py writes both): it checks the manifest's versions against its own before it
unpickles anything (``check``, ``refusal``), and serves the imports of the local packages that travelled as
source while the fragment runs (``ShippedSources``)."""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.metadata
import importlib.util
import json
import platform
import sys
import threading

from ..base.errors import SpawnVersionError
from ..base.version import __version__

_versions: dict[str, str | None] = {}


def version_of(dist_name: str, cached: bool = True) -> str | None:
    """The installed version of a distribution here (None: not installed); looked up once per process
    unless cached is False (a worker checks afresh: a package may be installed while it runs)."""
    if not cached or dist_name not in _versions:
        try:
            _versions[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            _versions[dist_name] = None
    return _versions[dist_name]


class _Served(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The worker's one finder for shipped sources (after its own: a copy the worker has itself wins):
    name -> [source, digest, fragments using it].  Fragments bringing the same source of a name share it;
    one bringing another source of a name in use waits until no fragment uses it (and its modules are gone)."""

    def __init__(self):
        self.served: dict[str, list] = {}
        self.changed = threading.Condition()

    def find_spec(self, fullname, path=None, target=None):
        entry = self.served.get(fullname)
        if entry is not None:
            return importlib.util.spec_from_loader(fullname, self, origin=f"<shipped {fullname}>",
                                                   is_package=entry[3] or _is_package(fullname, self.served))
        if any(name.startswith(fullname + ".") for name in list(self.served)):  # a namespace package's prefix
            return importlib.util.spec_from_loader(fullname, self, origin=f"<shipped {fullname}>", is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        entry = self.served.get(module.__name__)
        if entry is not None:
            if entry[4]:
                module.__file__ = entry[4]  # the parent's path to it
            exec(compile(entry[0], entry[4] or f"<shipped {module.__name__}>", "exec"), module.__dict__)

    def enter(self, sources: dict[str, str], packages=(), files=None) -> None:
        files = files or {}
        digests = {name: hashlib.sha256(f"{name in packages}:{files.get(name)}:{text}".encode()).hexdigest()
                   for name, text in sources.items()}
        with self.changed:
            while any(name in self.served and self.served[name][1] != digest for name, digest in digests.items()):
                self.changed.wait()
            for name, digest in digests.items():
                entry = self.served.setdefault(name, [sources[name], digest, 0, name in packages, files.get(name)])
                entry[2] += 1
            if self not in sys.meta_path:
                sys.meta_path.append(self)

    def leave(self, sources: dict[str, str]) -> None:
        with self.changed:
            for name in sources:
                entry = self.served[name]
                entry[2] -= 1
                if not entry[2]:
                    del self.served[name]
                    for loaded in [m for m in list(sys.modules) if m == name or m.startswith(name + ".")]:
                        sys.modules.pop(loaded, None)
            if not self.served and self in sys.meta_path:
                sys.meta_path.remove(self)
            self.changed.notify_all()


def _is_package(name: str, names) -> bool:
    return any(other.startswith(name + ".") for other in list(names))


_served = _Served()


class ShippedSources:
    """In the worker, while a fragment runs: imports served from the sources its manifest carries (see
    _Served); the modules imported from them are forgotten once no running fragment uses them."""

    def __init__(self, sources: dict[str, str], packages=(), files=None):
        self.sources, self.packages, self.files = sources, frozenset(packages), dict(files or {})

    def __enter__(self):
        if self.sources:
            _served.enter(self.sources, self.packages, self.files)
        return self

    def __exit__(self, *exc):
        if self.sources:
            _served.leave(self.sources)
        return False


def check(text: str) -> tuple[list[SpawnVersionError], list[str]]:
    """In the worker: (refusals, warnings) for a fragment's manifest.  A version that differs is a refusal,
    or a warning in "warn" mode; a missing distribution or compiled module is always a refusal."""
    wanted = json.loads(text)
    where = f"the worker ({platform.node()}, Python {platform.python_version()}, {sys.executable})"
    parent = f"the parent ({wanted.get('host', '?')})"
    refusals: list[SpawnVersionError] = []
    differ: list[SpawnVersionError] = []
    here_python, there_python = wanted["python"], platform.python_version()
    if here_python.split(".")[:2] != there_python.split(".")[:2]:  # refused even in "warn" mode
        refusals.append(SpawnVersionError(
            f"Python is {here_python} in {parent} and {there_python} in {where}: a fragment pickled by one "
            "Python minor version may not load or run under another", "python", here_python, there_python))
    if wanted["flowvm"] != __version__:
        differ.append(SpawnVersionError(f"flowvm is {wanted['flowvm']} in {parent} and {__version__} in {where}",
                                        "flowvm", wanted["flowvm"], __version__))
    for dist_name, version in wanted["packages"].items():
        theirs = version_of(dist_name)
        if theirs != version:  # read again: it may have been installed or upgraded since
            theirs = version_of(dist_name, cached=False)
        if theirs is None:
            refusals.append(SpawnVersionError(
                f"the fragment's code uses the package {dist_name!r} ({version} in {parent}), which is not "
                f"installed in {where}: install {dist_name}=={version} there", dist_name, version, None))
        elif theirs != version:
            differ.append(SpawnVersionError(
                f"the fragment's code uses the package {dist_name!r}, which is {version} in {parent} and {theirs} "
                f"in {where}: install {dist_name}=={version} on the worker (or register the executor with "
                "versions='warn' to run it anyway)", dist_name, version, theirs))
    for name, path in wanted["compiled"].items():
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            refusals.append(SpawnVersionError(
                f"the fragment uses the module {name!r}, a compiled extension ({path} in {parent}) that belongs "
                f"to no installed distribution: compiled code cannot be shipped, and {where} cannot import it; "
                "install it on the workers (as a package) or keep it out of the fragment", name, path, None))
    if wanted.get("mode", "error") == "warn":
        return refusals, [str(err) for err in differ]
    return refusals + differ, []


def refusal(errors: list[SpawnVersionError]) -> SpawnVersionError:
    """One error for the worker's refusals: the first, with the others as notes."""
    first = errors[0]
    err = SpawnVersionError(f"the worker refused the fragment before running it: {first}", first.package,
                            first.here, first.there)
    for other in errors[1:]:
        err.add_note(f"also: {other}")
    return err
