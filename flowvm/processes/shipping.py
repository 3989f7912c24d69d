"""What a SPAWN fragment takes along to a worker that may not have this process's files, and what the worker
checks before it runs anything.

Every executor but the default local pool (Dask, a named executor, a user's pool) gets its fragments this way:

- **Code that is no installed distribution travels with the fragment.**  The main script, a program file
  imported under its name (``flowvm run train.py``), modules from the working directory or any other path
  outside an installed distribution ("local" modules): the functions and classes of theirs that the
  fragment reaches are written by value (cloudpickle's by-value pickling, decided by this pickler alone:
  cloudpickle's process-wide registry is never touched), so the worker never imports them.  A local
  package whose module objects the fragment reaches (``import helpers`` used as a global) or that a shipped
  function imports in its body travels as source instead, every ``.py`` file of it, and is pickled by name:
  the worker imports it from those sources while the fragment runs (fragments with the same sources share
  them; another version of a module in use waits), then forgets it.  The local modules such a package
  imports travel too, and the installed ones it imports are version-checked.  A package never travels both ways: its classes would come twice, as two
  classes, and ``is``/``isinstance`` would fail.
- **Installed distributions, the standard library and flowvm travel by reference**: the worker imports
  them.  The payload's manifest (plain JSON, read before anything is unpickled) names the version of every
  distribution the pickle refers to by name (numpy, torch, scikit-learn, a pure-Python package alike), and
  the Python and flowvm versions.  The worker compares them with its own (read again on any difference)
  and refuses the fragment (``SpawnVersionError``, naming the package and both versions) on any difference,
  or on a distribution it lacks; an executor registered with ``versions="warn"`` runs it anyway and the
  parent warns (``SpawnVersionWarning``), except for another Python minor version, always refused (its
  bytecode would not load).  Equal versions are what a pickle by name needs: bit-for-bit equal results
  across different numpy or torch versions are not promised even then.
- **A compiled extension outside any distribution cannot travel**: the manifest names it with its path, and
  a worker that cannot import it refuses the fragment naming it.

A module belongs to a distribution when ``importlib.metadata`` maps its top-level name to one and its file
lies under that distribution's install location (distributions sharing a top-level name, as namespace
packages do, are told apart by their RECORDs): an editable install (``pip install -e``) of the user's own
project therefore travels with the fragment, as the worker would not have it.  A module named like a
standard one is standard only when its file lies in the standard library (a user's ``profile.py`` is local).
"""

from __future__ import annotations

import dis
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import platform
import site
import sys
import sysconfig
import threading
import types

import cloudpickle

from ..base.errors import SpawnError
from ..base.version import __version__
from ..persist.pickler import Pickler
from .arrival import ShippedSources, check, refusal, version_of  # noqa: F401 - the worker's side, here too

MODES = ("error", "warn")

# Kinds of module: how it travels
STDLIB, FLOWVM, INSTALLED, DIST, LOCAL, COMPILED = "stdlib", "flowvm", "installed", "dist", "local", "compiled"

_kinds: dict[str, tuple[int, tuple]] = {}  # module name -> (id of the module object, its kind)
_top_dists: dict[str, list[str]] | None = None
_dist_files: dict[str, set[str]] = {}


class ShippingPickler(Pickler):
    """flowvm's pickler, deciding for itself (cloudpickle's process-wide registry is left alone) what
    travels how, and noting it:

    - a function or class of a local module (no installed distribution holds it) is written by value,
      unless its top-level package is in ``source_tops`` (then by name: the worker imports it from the
      sources that travel with the fragment);
    - a module object, and a module that a function imports in its body, are written and imported by name:
      a local one's top-level package goes to ``needs_source``;
    - ``noted``: every module the pickle refers to by name (for the versions the worker checks);
      ``valued_tops``: the local packages whose code went by value.
    """

    def __init__(self, *args, source_tops=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.source_tops = frozenset(source_tops)
        self.noted: set[str] = set()
        self.needs_source: set[str] = set()
        self.valued_tops: set[str] = set()

    def reducer_override(self, obj):
        t = type(obj)
        reduced = NotImplemented
        if t is types.FunctionType or isinstance(obj, type):
            top = _local_top(getattr(obj, "__module__", None))
            if top is not None and top not in self.source_tops and _named_in_module(obj):
                self.valued_tops.add(top)
                reduced = self._dynamic_function_reduce(obj) if t is types.FunctionType \
                    else cloudpickle.cloudpickle._dynamic_class_reduce(obj)
        if reduced is NotImplemented:
            reduced = super().reducer_override(obj)
        note = self.noted.add
        note(t.__module__)
        if t is types.ModuleType:
            note(obj.__name__)
            self._needs(obj.__name__)
        elif reduced is NotImplemented:  # by name: a class, a function of an importable module, a builtin
            module = getattr(obj, "__module__", None)
            if isinstance(module, str):
                note(module)
        elif t is types.FunctionType:  # by value: the modules it imports in its body are imported by name
            package = obj.__globals__.get("__package__") or None
            for name in _imports_in(obj.__code__, package):
                note(name)
                self._needs(name)
        return reduced

    def _needs(self, name: str) -> None:
        top = _local_top(name)
        if top is not None:
            self.needs_source.add(top)


def _local_top(module: str | None) -> str | None:
    """The top-level name of module when no installed distribution holds it (and it is no main script)."""
    if not isinstance(module, str) or module in ("__main__", "__mp_main__"):
        return None
    return module.partition(".")[0] if kind_of(module)[0] == LOCAL else None


def _named_in_module(obj) -> bool:
    """Whether obj is what its module's attribute of its qualified name holds (else cloudpickle decides)."""
    module = sys.modules.get(obj.__module__)
    found = module
    for part in getattr(obj, "__qualname__", "<").split("."):
        found = getattr(found, part, None)
    return found is obj


def _imports_in(code: types.CodeType, package: str | None):
    """The absolute names of the modules that code imports (relative imports resolved against package)."""
    instructions = list(dis.get_instructions(code))
    for k, ins in enumerate(instructions):
        if ins.opname == "IMPORT_NAME" and isinstance(ins.argval, str):
            # the level is pushed two instructions before (LOAD_CONST; LOAD_SMALL_INT on newer Pythons)
            level = instructions[k - 2].argval if k >= 2 and type(instructions[k - 2].argval) is int else 0
            if level == 0:
                yield ins.argval
            elif package:
                try:
                    yield importlib.util.resolve_name("." * level + ins.argval, package)
                except (ImportError, ValueError):
                    pass
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _imports_in(const, package)


def warm() -> None:
    """Read every installed distribution's metadata now, in a background thread, so that the first fragment
    sent to another executor does not wait for it."""
    threading.Thread(target=_dists_of, args=("",), name="flowvm-shipping-warm", daemon=True).start()


def kind_of(name: str) -> tuple:
    """How the module called name travels: (STDLIB,), (FLOWVM,), (INSTALLED,) for site-packages files of
    no known distribution, (DIST, distribution name), (LOCAL, file) or (COMPILED, file)."""
    module = sys.modules.get(name)
    cached = _kinds.get(name)
    if cached is not None and cached[0] == id(module):
        return cached[1]
    kind = _kind(name, module)
    _kinds[name] = (id(module), kind)
    return kind


def _kind(name: str, module) -> tuple:
    top = name.partition(".")[0]
    if top in sys.builtin_module_names or top == "builtins":
        return (STDLIB,)
    if top in ("flowvm", "flowvm_cli"):
        return (FLOWVM,)
    if module is None:
        module = sys.modules.get(top)
    path = _file_of(module) if module is not None else _found_file(top)
    if top in sys.stdlib_module_names and (path is None or any(_under(path, p) for p in _stdlib_paths())):
        return (STDLIB,)  # (a file of the user's named like one, profile.py, is not)
    if path is None:  # not loaded here, or no file (a builtin, a frozen module): the worker imports it
        dists = _dists_of(top)
        return (DIST, dists[0]) if dists else (INSTALLED,)
    return _kind_of_file(top, path)


def _kind_of_file(top: str, path: str) -> tuple:
    """How a module that is not standard travels, by the file it was loaded from."""
    holder = _dist_holding(path, _dists_of(top))
    if holder is not None:
        return (DIST, holder)
    if any(_under(path, p) for p in _install_paths()):
        return (INSTALLED,)
    if path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
        return (COMPILED, path)
    return (LOCAL, path)


def _file_of(module) -> str | None:
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        paths = getattr(module, "__path__", None)  # a namespace package
        path = next(iter(paths), None) if paths is not None else None
    return os.path.realpath(path) if isinstance(path, str) else None


def _found_file(top: str) -> str | None:
    """Where the import system would load the top-level module from (nothing is imported)."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    origin = spec.origin if spec.has_location else None
    if origin is None and spec.submodule_search_locations:
        origin = next(iter(spec.submodule_search_locations), None)
    return os.path.realpath(origin) if isinstance(origin, str) else None


def _dist_holding(path: str, names: list[str]) -> str | None:
    """The distribution among names whose installed files include path (when several share a top-level
    name, as namespace packages do: their RECORDs tell them apart), else None."""
    under = []
    for dist_name in names:
        try:
            dist = importlib.metadata.distribution(dist_name)
            root = os.path.realpath(dist.locate_file(""))
        except Exception:  # pragma: no cover - a broken installation's metadata
            continue
        if _under(path, root):
            if len(names) == 1:
                return dist_name
            under.append(dist_name)
            files = _dist_files.get(dist_name)
            if files is None:
                files = _dist_files[dist_name] = {os.path.realpath(dist.locate_file(f)) for f in dist.files or ()}
            if path in files or any(f.startswith(path.rstrip(os.sep) + os.sep) for f in files):
                return dist_name
    return under[0] if under else None


def _stdlib_paths() -> list[str]:
    return [os.path.realpath(p) for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")} if p]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _install_paths() -> list[str]:
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        paths.update(site.getsitepackages())
        paths.add(site.getusersitepackages())
    except AttributeError:  # pragma: no cover - a virtualenv's old site.py
        pass
    return [os.path.realpath(p) for p in paths if p]


def _dists_of(top: str) -> list[str]:
    global _top_dists
    if _top_dists is None:
        _top_dists = importlib.metadata.packages_distributions()
    return _top_dists.get(top, [])


def manifest(noted: set[str], mode: str, source_tops=()) -> str:
    """What the worker checks before it unpickles the fragment (JSON): the versions of Python, flowvm and
    every distribution among the noted modules, the compiled modules that could not be shipped, and the
    sources of the local packages in source_tops (see sources_of)."""
    packages: dict[str, str] = {}
    compiled: dict[str, str] = {}
    _note(sorted(noted), packages, compiled)
    sources, source_packages, source_files, imported = _shipped_sources(source_tops)
    _note(sorted(imported - set(noted)), packages, compiled)
    return json.dumps({"python": platform.python_version(), "flowvm": __version__, "packages": packages,
                       "compiled": compiled, "sources": sources, "source_packages": sorted(source_packages),
                       "source_files": source_files, "mode": mode, "host": platform.node()})


def _note(names, packages: dict, compiled: dict) -> None:
    """Note the distributions (with their versions) and the compiled modules among the modules names."""
    for name in names:
        kind = kind_of(name)
        if kind[0] == DIST:
            version = version_of(kind[1])
            if version is not None:
                packages[kind[1]] = version
        elif kind[0] == COMPILED:
            compiled[name] = kind[1]


def _shipped_sources(source_tops) -> tuple[dict, set, dict, set]:
    """(sources, package names, files, imported module names) of the local packages in source_tops and of the
    local packages their modules import, in turn: those travel too (the installed ones are checked)."""
    sources: dict[str, str] = {}
    shipped: set[str] = set()
    imported: set[str] = set()
    source_packages: set[str] = set()
    source_files: dict[str, str] = {}
    pending = sorted(source_tops)
    while pending:
        top = pending.pop()
        if top in shipped:
            continue
        shipped.add(top)
        found = sources_of(top, source_packages, source_files)
        sources.update(found)
        for name in _imports_of_sources(found, source_packages):
            imported.add(name)
            local = _local_top(name)
            if local is not None and local not in shipped:
                pending.append(local)
    return sources, source_packages, source_files, imported


def _imports_of_sources(found: dict[str, str], packages: set):
    """The absolute names of the modules that the sources (module name -> text) import."""
    for name, text in found.items():
        try:
            code = compile(text, f"<{name}>", "exec")
        except (SyntaxError, ValueError):
            continue
        package = name if name in packages else name.rpartition(".")[0]
        yield from _imports_in(code, package or None)


SOURCE_LIMIT = 8 << 20  # bytes of source shipped for one local package


def sources_of(top: str, packages: set | None = None, files: dict | None = None) -> dict[str, str]:
    """{module name: source} of a local module, or of every .py file of a local package: what the worker
    imports from when a shipped function runs ``import top`` (or one of its submodules) in its body; the
    names that are packages (their ``__init__.py``) are added to packages, and each module's file to files
    (the worker gives it as the module's ``__file__``: a path computed at import works, and a data file
    read from it is found where the parent's files are shared)."""
    module = sys.modules.get(top)
    path = _file_of(module) if module is not None else _found_file(top)
    if path is None:
        return {}
    if os.path.basename(path) == "__init__.py":
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        if not path.endswith(".py"):
            return {}
        if files is not None:
            files[top] = path
        return {top: _read(path)}
    found = _package_sources(top, path, packages, files)
    size = sum(len(text) for text in found.values())
    if size > SOURCE_LIMIT:
        raise SpawnError(f"the fragment imports the local package {top!r} ({path}), whose {size >> 20} MB of "
                         "source is too much to ship with every fragment: install it on the workers")
    return found


def _package_sources(top: str, path: str, packages: set | None, files: dict | None) -> dict[str, str]:
    """{module name: source} of every .py file under the folder path of the package top."""
    found: dict[str, str] = {}
    for folder, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        rel = os.path.relpath(folder, path)
        prefix = top if rel == "." else top + "." + rel.replace(os.sep, ".")
        for name in sorted(names):
            if name.endswith(".py"):
                text = _read(os.path.join(folder, name))
                module_name = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
                found[module_name] = text
                if name == "__init__.py" and packages is not None:
                    packages.add(prefix)
                if files is not None:
                    files[module_name] = os.path.join(folder, name)
    return found


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
