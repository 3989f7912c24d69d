"""The module paths of flowvm 0.1 and 0.2, and those of 0.3 renamed for what they hold, kept working for one
release with a DeprecationWarning.

flowvm 0.1 and 0.2 were flat modules (``flowvm.checkpoint``, ``flowvm.driver``, ...); they are now folders, one
per layer (docs/architecture.md).  ``import flowvm.checkpoint`` and ``from flowvm.checkpoint import
read_header`` still work: the old path is a module of its own (``Moved``) whose names are looked up, when
asked for, where they live now (the new module, then the package's public names), each with a
DeprecationWarning naming the new path.  A name 0.1 had and flowvm no longer has is an AttributeError
(an ImportError for ``from ... import``).  docs/api.md lists the public surface and these paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# old module path -> the modules its names are in now, the first one being where the module went
MOVED: dict[str, tuple[str, ...]] = {
    # 0.3's modules renamed for what they hold (docs/architecture.md)
    "flowvm.fused.internals": ("flowvm.fused.torch_internals",),
    "flowvm.machine.history": ("flowvm.machine.metrics",),
    "flowvm.machine.compile": ("flowvm.machine.leafcode",),
    "flowvm.machine.running": ("flowvm.machine.live",),
    "flowvm.program.element": ("flowvm.program.protocol",),
    "flowvm.distributed.checkpoints": ("flowvm.distributed.coordinated",),
    "flowvm.distributed.launching": ("flowvm.distributed.agent",),
    # 0.1's and 0.2's flat modules
    "flowvm.analysis": ("flowvm.program.analysis",),
    "flowvm.checkpoint": ("flowvm.persist.checkpoint", "flowvm.persist.pickler", "flowvm.base.environment"),
    "flowvm.cli": ("flowvm.command.cli", "flowvm.command.targets", "flowvm.command.runs", "flowvm.command.places"),
    "flowvm.compile": ("flowvm.machine.leafcode",),
    "flowvm.data": ("flowvm.base.data",),
    "flowvm.depends": ("flowvm.machine.depends",),
    "flowvm.dot": ("flowvm.views.dot",),
    "flowvm.driver": ("flowvm.machine.driver", "flowvm.base.sentinels", "flowvm.machine.frames",
                      "flowvm.machine.live", "flowvm.program.analysis"),
    "flowvm.edit": ("flowvm.editing.edit", "flowvm.editing.match"),
    "flowvm.elements": ("flowvm.program.elements",),
    "flowvm.environment": ("flowvm.base.environment",),
    "flowvm.errors": ("flowvm.base.errors",),
    "flowvm.executors": ("flowvm.processes.executors", "flowvm.processes.job", "flowvm.processes.starts"),
    "flowvm.hotpatch": ("flowvm.editing.hotpatch",),
    "flowvm.idle": ("flowvm.machine.idle",),
    "flowvm.namespaces": ("flowvm.editing.namespaces", "flowvm.program.verify"),
    "flowvm.passes.fused_runtime": ("flowvm.fused.runtime", "flowvm.fused.codegen"),
    "flowvm.paths": ("flowvm.program.paths",),
    "flowvm.printer": ("flowvm.program.printer",),
    "flowvm.registers": ("flowvm.program.registers",),
    "flowvm.runner": ("flowvm.command.runner", "flowvm.program.analysis"),
    "flowvm.source": ("flowvm.views.source",),
    "flowvm.verify": ("flowvm.program.verify",),
    # the flat modules 0.2 added
    "flowvm.fastpaths": ("flowvm.machine.fastpaths",),
    "flowvm.fileformat": ("flowvm.persist.fileformat",),
    "flowvm.frames": ("flowvm.machine.frames",),
    "flowvm.job": ("flowvm.processes.job",),
    "flowvm.match": ("flowvm.editing.match",),
    "flowvm.pickler": ("flowvm.persist.pickler", "flowvm.base.environment"),
    "flowvm.remote": ("flowvm.persist.remote",),
    "flowvm.running": ("flowvm.machine.live",),
    "flowvm.sentinels": ("flowvm.base.sentinels",),
    "flowvm.storage": ("flowvm.persist.storage",),
    "flowvm.version": ("flowvm.base.version",),
}

# names of 0.1's flat modules that are packages now -> the module each name is in now
PACKAGE_NAMES: dict[str, dict[str, str]] = {
    "flowvm.processes": {"POPEN": "flowvm", "SPAWN": "flowvm", "CommandError": "flowvm", "SpawnError": "flowvm",
                         "SpawnTimeout": "flowvm", "default_executor": "flowvm.processes.executors",
                         "shutdown_default_executor": "flowvm.processes.executors"},
}


def public_path(name: str, module: str) -> str:
    """Where a user should take name from: ``flowvm.NAME`` when the package exports it, else module.NAME."""
    package = sys.modules.get("flowvm")
    return f"flowvm.{name}" if name in getattr(package, "__all__", ()) else f"{module}.{name}"


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} is deprecated and goes away in the next release: use {new}", DeprecationWarning,
                  stacklevel=stacklevel)


class Moved(types.ModuleType):
    """An old module path: each name is looked up where it lives now, with a DeprecationWarning."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        homes = MOVED[self.__name__]
        for home in homes + ("flowvm",):
            module = importlib.import_module(home)
            if not name.startswith("_") and name in vars(module):
                deprecated(f"{self.__name__}.{name}", public_path(name, homes[0] if home == "flowvm" else home))
                return vars(module)[name]
        raise AttributeError(f"module {self.__name__!r} (deprecated: see {homes[0]}) has no attribute {name!r}")

    def __dir__(self):
        return sorted(n for home in MOVED[self.__name__] for n in vars(importlib.import_module(home))
                      if not n.startswith("_"))


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return Moved(spec.name)

    def exec_module(self, module) -> None:
        deprecated(f"the module {module.__name__}", MOVED[module.__name__][0])


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, _Loader())
        return None


class _Package(types.ModuleType):
    """The flowvm package: importing an old path that names one of its functions (``flowvm.verify``) keeps
    the function as the package's attribute."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, Moved) and not isinstance(self.__dict__.get(name, value), types.ModuleType):
            return
        super().__setattr__(name, value)


def package_getattr(name: str):
    """flowvm.NAME for an old module name not imported yet (``flowvm.checkpoint``, ``flowvm.errors``): the
    old module, with the warning its import gives, said where flowvm.NAME is written."""
    old = f"flowvm.{name}"
    if old not in MOVED:
        raise AttributeError(f"module 'flowvm' has no attribute {name!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(old)
    deprecated(f"the module {old}", MOVED[old][0])
    return module


def _old_names(package: str):
    def __getattr__(name: str):
        home = PACKAGE_NAMES[package].get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        deprecated(f"{package}.{name}", public_path(name, home))
        return getattr(importlib.import_module(home), name)
    return __getattr__


def install(package: types.ModuleType) -> None:
    """Serve the old paths: a finder for the old modules, the old names of the packages that were modules."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
    package.__class__ = _Package
    for name in PACKAGE_NAMES:
        module = importlib.import_module(name)
        if "__getattr__" not in vars(module):
            module.__getattr__ = _old_names(name)
