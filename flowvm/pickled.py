"""The names that saved runs refer to.

A pickled run (a checkpoint, or a pickle of a ``Driver``) names every class and function it is rebuilt
with by module and name.  Those names must outlive the code's layout: a file written today has to load
after the module that defines ``CALL`` or ``rebuild_driver`` has moved.  So every flowvm object a saved
run can name pickles under one of two stable names, whatever module defines it:

- ``flowvm.NAME`` for the public API (``flowvm.CALL``, ``flowvm.Registers``, ``flowvm.Batches``, ...);
- ``flowvm.pickled.NAME`` for the helpers that rebuild a run (``rebuild_driver``, ``sentinel``, ...).

The bundled programs' classes pickle under their public modules (``flowvm.programs.mlp.Trainer``).
Each such object is marked where it is defined, with the ``@stable(module)`` decorator below, which
points its ``__module__`` and ``__qualname__`` at its stable name; ``check()`` verifies the tables.  A name that must change all the same goes into ``LEGACY_NAMES``,
which the loader (``find_class``) reads, so older files keep loading.

>>> import pickle, flowvm
>>> b"flowvm.elements" in pickle.dumps(flowvm.SEQ([]))
False
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["rebuild_driver", "load_driver_bytes", "with_grad", "set_lbfgs_state", "global_generator",
           "rebuild_storage", "rebuild_typed_storage",
           "sentinel", "rebuild_error", "make_depends", "Scope", "DependsCALL", "FuseSettings", "ExecutorRef",
           "open_file_array", "PyFunction", "PyProgram", "Statement", "statement", "restore_source", "Next", "unbound", "BatchesEpoch",
           "find_class", "LEGACY_NAMES", "STABLE_MODULES", "stable", "check"]

# (module, name) a pickle names -> (module, name) it is found under now: for names that moved.  The
# names files of flowvm 0.1.0 (checkpoint format 1) use, which were module paths, come first.
LEGACY_NAMES: dict[tuple[str, str], tuple[str, str]] = {
    **{(f"flowvm.{module}", name): ("flowvm", name) for module, names in {
        "elements": ("Element", "CALL", "PRINT", "SEQ", "REPEAT", "LOOP", "WHILE", "SWITCH", "WEAVE", "BUFFER"),
        "registers": ("Register", "Registers"), "driver": ("Driver",),
        "processes": ("POPEN", "SPAWN", "CommandError", "SpawnError"), "passes.fuse_torch": ("FUSED",),
        "data": ("Batches",), "depends": ("Depends",),
        "errors": ("FlowError", "VerifyError", "CheckpointError", "RegisterError", "SwitchError"),
    }.items() for name in names},
    **{(f"flowvm.{module}", old): ("flowvm.pickled", new) for module, old, new in (
        ("checkpoint", "rebuild_driver", "rebuild_driver"), ("checkpoint", "load_driver_bytes", "load_driver_bytes"),
        ("checkpoint", "with_grad", "with_grad"), ("checkpoint", "_set_lbfgs_state", "set_lbfgs_state"),
        ("checkpoint", "global_generator", "global_generator"), ("driver", "_NOVALUE", "NOVALUE"),
        ("driver", "_PUSHED", "PUSHED"), ("driver", "PENDING", "PENDING"), ("driver", "INCOMPLETE", "INCOMPLETE"),
        ("errors", "_rebuild", "rebuild_error"),
        ("depends", "_make_depends", "make_depends"), ("depends", "DependsCALL", "DependsCALL"),
        ("namespaces", "Scope", "Scope"), ("passes.fuse_torch", "FuseSettings", "FuseSettings"),
        ("executors", "ExecutorRef", "ExecutorRef"),
    )},
}

# Modules under which saved runs may name flowvm objects (and the bundled programs' flowvm.programs.*).
STABLE_MODULES = ("flowvm", "flowvm.pickled")

# public name -> "module:attribute" where it is defined now
_PUBLIC = {
    name: f"flowvm.{where}:{name}" for where, names in {
        "program.elements": ("Element", "CALL", "PRINT", "SEQ", "REPEAT", "LOOP", "WHILE", "SWITCH", "WEAVE", "BUFFER"),
        "program.registers": ("Register", "Registers"),
        "machine.driver": ("Driver",),
        "processes.leaves": ("POPEN", "SPAWN"),
        "fused.element": ("FUSED",),
        "base.data": ("Batches",),
        "machine.depends": ("Depends",),
        "base.errors": ("FlowError", "VerifyError", "CheckpointError", "RegisterError", "SwitchError", "CommandError",
                   "SpawnError", "SpawnTimeout", "EditError", "SourceError", "PassError", "UnknownPassError",
                   "DataError"),
    }.items() for name in names
}
_HELPERS = {
    "rebuild_driver": "flowvm.persist.pickler:rebuild_driver",
    "load_driver_bytes": "flowvm.persist.pickler:load_driver_bytes",
    "with_grad": "flowvm.persist.pickler:with_grad",
    "set_lbfgs_state": "flowvm.persist.pickler:set_lbfgs_state",
    "global_generator": "flowvm.persist.pickler:global_generator",
    "rebuild_storage": "flowvm.persist.pickler:rebuild_storage",
    "rebuild_typed_storage": "flowvm.persist.pickler:rebuild_typed_storage",
    "sentinel": "flowvm.base.sentinels:sentinel",
    "rebuild_error": "flowvm.base.errors:rebuild_error",
    "make_depends": "flowvm.machine.depends:make_depends",
    "Scope": "flowvm.editing.namespaces:Scope",
    "DependsCALL": "flowvm.machine.depends:DependsCALL",
    "FuseSettings": "flowvm.fused.element:FuseSettings",
    "ExecutorRef": "flowvm.processes.executors:ExecutorRef",
    "open_file_array": "flowvm.base.dataset:open_file_array",
    # @flowvm.program: a call's program, its statements, the source they are compiled from again, a loop's step
    "PyFunction": "flowvm.program.pyfunc:PyFunction",
    "PyProgram": "flowvm.program.pyfunc:PyProgram",
    "Statement": "flowvm.program.pyfunc:Statement",
    "statement": "flowvm.program.pyfunc:statement",
    "restore_source": "flowvm.program.pyfunc:restore_source",
    "Next": "flowvm.program.pyfunc:Next",
    "unbound": "flowvm.program.pylower:unbound",
    "BatchesEpoch": "flowvm.base.epochs:BatchesEpoch",
}


# names found here that are not published (objects that pickle by name, not by __module__)
_ALIASES = {
    "NOVALUE": "flowvm.base.sentinels:NOVALUE",
    "PUSHED": "flowvm.base.sentinels:PUSHED",
    "PENDING": "flowvm.base.sentinels:PENDING",
    "INCOMPLETE": "flowvm.base.sentinels:INCOMPLETE",
}


def _resolve(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def __getattr__(name: str) -> Any:
    # flowvm.pickled.rebuild_driver and friends, imported where they are defined on first use
    if name in _HELPERS or name in _ALIASES:
        value = _resolve(_HELPERS.get(name) or _ALIASES[name])
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flowvm.pickled' has no attribute {name!r}")


def stable(module: str) -> Callable[[Any], Any]:
    """Decorator for a class or function that saved runs may name: it pickles as ``module.NAME``
    (``flowvm`` for the public API, ``flowvm.pickled`` for the helpers that rebuild a run), whatever
    module defines it; a class's methods follow it (a bound method pickles by its function's name)."""
    def mark(obj: Any) -> Any:
        name = obj.__name__
        obj.__module__ = module
        obj.__qualname__ = name
        if isinstance(obj, type):
            for attr, value in vars(obj).items():
                fn = getattr(value, "__func__", value)
                if callable(fn) and getattr(fn, "__qualname__", None) == f"{name}.{attr}":
                    fn.__module__ = module
        return obj
    return mark


def check() -> None:
    """Each object the tables above name is marked with its stable name and found under it (a test runs
    this): otherwise saved runs could not name it, or would name a module path that may move."""
    import sys

    for module, table in (("flowvm", _PUBLIC), ("flowvm.pickled", _HELPERS)):
        for name, spec in table.items():
            obj = _resolve(spec)
            if obj.__module__ != module or obj.__qualname__ != name:
                raise AssertionError(f"{spec} pickles as {obj.__module__}.{obj.__qualname__}, not {module}.{name}: "
                                     f"decorate it with @stable({module!r})")
            if module == "flowvm" and getattr(sys.modules["flowvm"], name, None) is not obj:
                raise AssertionError(f"{name} is not exported by flowvm, so a saved run could not name it")


def find_class(module: str, name: str) -> tuple[str, str]:
    """Where (module, name) named in a saved run is found now (a method, "Class.method", follows its
    class)."""
    head, dot, rest = name.partition(".")
    new_module, new_head = LEGACY_NAMES.get((module, head), (module, head))
    return new_module, new_head + dot + rest
