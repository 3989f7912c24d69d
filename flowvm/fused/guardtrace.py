"""In the child process: what a stateful step's code of the user's reads, from dynamo's trace of it
(flowvm/fused/guards.py describes the guards and checks them in the program's process).  The stages: the
functions pickled by value and their globals (``_by_value_globals``), dynamo's trace as one graph with no
other effect (``torch_internals.dynamo_trace``), the globals it added (``_imports``), each guard as the parent
checks it (``_guard``), and the values a module pickled partly by value reads both ways (``_same_in_both``).
Each refusal is a ``Refused`` naming what the parent could not check."""

from __future__ import annotations

import ast
import builtins
import os
import sys
import types
from typing import Any, Callable

from . import torch_internals
from .guards import GUARD_CHECKS, GLOBALS_OF, GUARD_NAMES, SKIPPED_GUARDS, STATE_GUARD, class_names, user_classes, describe
from .refused import Refused



def _by_value_globals(roots: list) -> dict[str, dict]:
    """For each module name, the globals of the functions reachable from roots that the parent pickled by
    value (a ``__main__`` script's): their globals are not their module's in this process."""
    found: dict[str, dict] = {}
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) not in seen:
            seen.add(id(obj))
            todo.extend(_reached(obj, found))
    return found


def _reached(obj: Any, found: dict[str, dict]) -> list:
    """What the code of obj reaches (a class's attributes, a function's globals and closure cells), noting in
    ``found`` the globals of a function pickled by value."""
    if isinstance(obj, type):
        return [v for base in obj.__mro__ for v in vars(base).values()]
    if isinstance(obj, (staticmethod, classmethod)):
        return [obj.__func__]
    if isinstance(obj, property):
        return [f for f in (obj.fget, obj.fset) if f is not None]
    if not isinstance(obj, types.FunctionType):
        return []
    return _function_reached(obj, found)


def _function_reached(obj: Any, found: dict[str, dict]) -> list:
    reached = []
    g = obj.__globals__
    name = g.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    if name is not None and (module is None or vars(module) is not g):
        found.setdefault(name, {}).update(g)
        reached += [v for v in g.values() if isinstance(v, (types.FunctionType, type))]
    for cell in obj.__closure__ or ():
        try:
            reached.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return reached


def trace(head: Callable, modules: list, inputs: list, grad: bool) -> dict:
    """In the child: dynamo's guards of ``head(*inputs)`` (its modules as unpickled here), as
    ``{"guards": [[kind, source, description, extra]...], "imports": {global name: module name},
    "classes": {the user's class.method: its code}}`` (raises Refused)."""
    by_value = _by_value_globals(_roots(head, modules))
    own = set(head.__globals__)  # dynamo adds the modules it reads through to them
    saved = {name: sys.modules.get(name) for name in by_value}
    made: dict[str, Any] = {}
    try:
        made.update(_stand_ins(by_value, saved))
        seen = _dynamo(head, inputs, grad)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    extra = {name: value for name, value in seen.scope.items() if name not in own}
    imports = _imports(extra)
    state = {id(t) for module in modules for t in (*module.parameters(), *module.buffers())}
    guards = [g for g in (_guard(e, state) for e in seen.guards) if g is not None]
    _same_in_both(head, guards, _by_value_scopes(extra, made, saved, by_value))
    named = [type(e.value) for e in seen.guards if e.kind == "TYPE_MATCH" and e.has_value]
    return {"guards": guards, "imports": imports, "classes": class_names(user_classes(modules, named))}


def _roots(head: Callable, modules: list) -> list:
    """What the step may run: its head, the functions among its globals, its modules' classes and the
    functions set on them."""
    roots: list = [head] + [v for v in head.__globals__.values() if callable(v)]
    for module in modules:
        for sub in module.modules():
            roots.append(type(sub))
            roots.extend(v for v in vars(sub).values() if callable(v))
    return roots


def _stand_ins(by_value: dict[str, dict], saved: dict[str, Any]) -> dict[str, Any]:
    """Put in ``sys.modules`` a module of the by-value globals for each of their module names (torch 2.13
    reads a by-value function's globals through its module): the stand-ins."""
    made = {}
    for name, g in by_value.items():
        stand_in = types.ModuleType(name)
        if saved[name] is not None and name != "__main__":  # imported here too, for code pickled by reference
            stand_in.__dict__.update(vars(saved[name]))
        stand_in.__dict__.update(g)
        sys.modules[name] = made[name] = stand_in
    return made


def _dynamo(head: Callable, inputs: list, grad: bool) -> torch_internals.DynamoTrace:
    """Dynamo's trace of the step as one graph changing no object of the program's (raises Refused)."""
    try:
        seen = torch_internals.dynamo_trace(head, inputs, grad)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise Refused(f"dynamo cannot trace it as one graph ({first})") from None
    if seen.changed:
        raise Refused(f"it changes objects of the program ({seen.changed[0]})")
    return seen


def _imports(extra: dict[str, Any]) -> dict[str, str]:
    """What each global dynamo added to the step's (the modules it read code through, a function's globals)
    is, by a name the parent resolves in its own process."""
    imports: dict[str, str] = {}
    for name, value in extra.items():
        if isinstance(value, types.ModuleType):
            imports[name] = value.__name__
        elif value is vars(builtins):
            imports[name] = "builtins.__dict__"
        elif torch_internals.is_globals_scope(name):
            module = value.get("__name__") if isinstance(value, dict) else None
            if not isinstance(module, str):
                raise Refused(f"it reads the globals of code that is not a module's ({name})")
            imports[name] = GLOBALS_OF + module
    return imports


def _by_value_scopes(extra: dict[str, Any], made: dict[str, Any], saved: dict[str, Any],
                     by_value: dict[str, dict]) -> dict[str, Any]:
    """The globals of the step (by their names in ``G``) through which it read code of a module that is
    also imported here, pickled by value (a stand-in module on torch 2.13, the function's own globals on
    2.14), each with the module as imported here."""
    real = {name for name in made if saved[name] is not None and name != "__main__"}
    found: dict[str, Any] = {}
    for key, value in extra.items():
        if isinstance(value, types.ModuleType) and value.__name__ in real and value is made[value.__name__]:
            found[key] = saved[value.__name__]
        elif torch_internals.is_globals_scope(key) and isinstance(value, dict):
            name = value.get("__name__")
            if name in real and value is not vars(saved[name]):
                found[key] = vars(saved[name])
    return found


def _guard(e: Any, state: set[int]) -> list | None:
    """One of dynamo's guards as ``[kind, source, description, extra]`` for the parent (None: checked
    elsewhere or not at all); raises Refused for one the parent cannot check."""
    kind, source = e.kind, e.source
    if kind == "TENSOR_MATCH" and not source.startswith("L["):
        return _tensor_guard(e, state)
    if e.has_value and isinstance(e.value, os._Environ):
        raise Refused(f"it reads environment variables ({source}), which dynamo's guards do not check")
    if kind in SKIPPED_GUARDS or not source:
        return None  # tensors; the grad mode and torch's global settings (checked or sent as settings)
    if kind not in GUARD_CHECKS:
        raise Refused(f"a guard of a kind not checked here ({kind} on {source})")
    names = {n.id for n in ast.walk(ast.parse(source, mode="eval")) if isinstance(n, ast.Name)}
    if not names <= GUARD_NAMES:
        raise Refused(f"a guard on something not global ({kind} on {source})")
    extra = e.keywords["source_b"].name if kind == "DUPLICATE_INPUT" else e.keywords.get("attr", e.keywords.get("key"))
    if not (extra is None or type(extra) in (str, int, float, bool)):
        raise Refused(f"a guard on a key that is not a plain value ({kind} on {source})")
    if not e.has_value:
        raise Refused(f"a guard whose value dynamo could not read ({kind} on {source})")
    return [kind, source, describe(kind, e.value, extra), extra]


def _tensor_guard(e: Any, state: set[int]) -> list | None:
    """A tensor read through the step's globals: a parameter or buffer of its modules (the state check's;
    one reached through a global must be the same one at each call), never a constant."""
    if id(e.value) not in state:
        raise Refused(f"a tensor constant: {e.source} is not a parameter, buffer or input of the step "
                      "(the package would hold its values)")
    if not STATE_GUARD.fullmatch(e.source):
        return ["ID_MATCH", e.source, describe("ID_MATCH", e.value), None]
    return None


def _same_in_both(head: Callable, guards: list, swapped: dict[str, Any]) -> None:
    """A module whose code is partly pickled by value (a lambda of it, with the program's values of its
    globals) and partly imported here (its classes, with the values of its import): each guard read through
    it must describe alike in both, or the package would compute with values the guards do not name."""
    if not swapped:
        return
    scope = dict(head.__globals__, **swapped)
    for kind, source, want, extra in guards:
        if not any(f"G[{key!r}]" in source for key in swapped):
            continue
        try:
            got = describe(kind, eval(compile(source, "<flowvm guard>", "eval"), {"G": scope}), extra)  # noqa: S307
        except Exception as err:
            got = f"unreadable ({type(err).__name__})"
        if got != want:
            raise Refused(f"{source} is {got} for the module's code imported here but {want} for code of it "
                              "pickled with the program's values")
