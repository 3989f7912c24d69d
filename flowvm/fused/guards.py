"""Guards for a stateful step that computes with the user's own code (a module's ``forward``, a function of
theirs), so that it can compile in a child process (flowvm/fused/stateful.py) without freezing a value the
program may change.

The user's code may read anything of the program's process: a global (``SCALE``), a class attribute, a
setting of a config object, a function it calls.  The child unpickles that code with the values the parent
had when the step was planned, and a package built from them is right only while they stay so.  Dynamo
knows what such code reads, so the child asks it:

- in the child (``trace``), dynamo traces the step as one graph (``fullgraph``: a print, a call it cannot
  trace, or control flow on a tensor's value refuses the step) and the step must change no object that
  existed before it (a counter ``self.calls += 1``, an ``append`` to a global list refuse it too);
- the guards dynamo builds name each value read by a *source*, an expression such as
  ``G['__import___main__'].SCALE`` or ``G['f0'].temp`` over the step's globals, and a kind (its value, its
  type, the object itself, a dict's keys...); each comes back with a description of what the child saw
  (``describe``), and kinds this module does not know refuse the step;
- in the parent (``check``), each source is evaluated against the program's own objects when the package
  arrives and must describe as the child's did (else the package is not used), and a generated function
  checks all of them, against the parent's objects, before every call of the package.

The parent's check adds what dynamo's guards leave out: the methods of the user's classes (replaced or
added since), a class attribute read from a base class (shadowed since by a class between), hooks of a
module reached through a global.  Guards the state check of stateful.py already covers are not checked
twice (``_covered``).  Tensors are not described here: the state check covers every parameter, buffer and
input, and the child refuses a tensor read from elsewhere (its values would be constants of the package).
A module whose code reached the child partly by value (a lambda of it, with the program's values of its
globals) and partly by import (its classes) must read the same values both ways (``_same_in_both``).
"""

from __future__ import annotations

import ast
import builtins
import collections
import copy
import hashlib
import re
import sys
import types
from typing import Any, Callable

from .refused import Refused

# what a kind checks before each call, given the source's value ``v`` and what the parent recorded ``o``
GUARD_CHECKS = {
    "CONSTANT_MATCH": "type({v}) is {o}[0] and {v} == {o}[1]",
    "EQUALS_MATCH": "type({v}) is {o}[0] and {v} == {o}[1]",
    "TYPE_MATCH": "type({v}) is {o}",
    "ID_MATCH": "{v} is {o}",
    "MODULE_MATCH": "{v} is {o}",
    "BUILTIN_MATCH": "{v} is {o}",
    "FUNCTION_MATCH": "{v} is {o}",
    "CLASS_MATCH": "{v} is {o}",
    "CLOSURE_MATCH": "{v}.__code__ is {o}",
    "EMPTY_NN_MODULE_HOOKS_DICT": "not {v}",
    "SEQUENCE_LENGTH": "len({v}) == {o}",
    "DICT_LENGTH": "len({v}) == {o}",
    "LENGTH_CHECK": "len({v}) == {o}",
    "DICT_KEYS_MATCH": "list(dict.keys({v})) == {o}",
    "NOT_PRESENT_IN_GENERIC_DICT": "{o} not in {v}.__dict__",
    "HASATTR": "hasattr({v}, {o}[0]) is {o}[1]",
    "DICT_CONTAINS": "({o}[0] in {v}) is {o}[1]",
    "DICT_NOT_CONTAINS": "({o}[0] in {v}) is {o}[1]",
    "SET_CONTAINS": "({o}[0] in {v}) is {o}[1]",
    "SET_NOT_CONTAINS": "({o}[0] in {v}) is {o}[1]",
    "BOOL_MATCH": "type({v}) is {o}[0] and {v} == {o}[1]",
    "NONE_MATCH": "type({v}) is {o}[0] and {v} == {o}[1]",
    "NOT_NONE_MATCH": "{v} is not None",
    "DUPLICATE_INPUT": "{v} is {o}",  # the same object as at arrival, and so as the other source
}
SKIPPED_GUARDS = {"TENSOR_MATCH"}  # the state check's
_VALUES = ("CONSTANT_MATCH", "EQUALS_MATCH", "BOOL_MATCH", "NONE_MATCH")
_CONTAINS = ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS", "SET_NOT_CONTAINS")
# what a source may name: the step's globals and a few functions (a class attribute's source is
# ``dict(type(G['x'].config).__dict__)['shift']``)
GUARD_NAMES = {"G", "type", "dict", "len", "getattr", "___odict_getitem"}


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


def _constant(value: Any) -> str:
    """A constant of code, or a default value, in words both processes give alike."""
    if isinstance(value, types.CodeType):
        return f"code {_fingerprint(value)}"
    if isinstance(value, (frozenset, set)):
        return "{" + ", ".join(sorted(_constant(v) for v in value)) + "}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_constant(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_constant(k)}: {_constant(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType)):
        return _name(value) if not isinstance(value, types.ModuleType) else value.__name__
    return f"a {_name(type(value))}"


def _stable(value: Any) -> str:
    """repr, the same in every process: sets sorted (their order follows string hashes and addresses),
    functions, classes and modules by name."""
    if isinstance(value, (frozenset, set)):
        return f"{type(value).__name__}({{{', '.join(sorted(_stable(v) for v in value))}}})"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_stable(v) for v in value)
        return f"({inner},)" if isinstance(value, tuple) and len(value) == 1 else (
            f"({inner})" if isinstance(value, tuple) else f"[{inner}]")
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_stable(k)}: {_stable(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return _name(value)
    if isinstance(value, types.ModuleType):
        return value.__name__
    return repr(value)


def _fingerprint(code: Any) -> str:
    parts = [code.co_code.hex(), repr(code.co_names), repr(code.co_varnames), _constant(code.co_consts)]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def _code(fn: Any) -> str:
    """A function's code, its constants (nested code included) and its defaults."""
    return f"{_fingerprint(fn.__code__)} {_constant(fn.__defaults__)} {_constant(fn.__kwdefaults__)}"


def describe(kind: str, value: Any, extra: Any = None) -> str:
    """What a guard of this kind saw at its source, in words both processes compute alike."""
    if kind in _VALUES:
        return f"{_name(type(value))} {_stable(value)}"
    if kind == "NOT_NONE_MATCH":
        return f"not None: {value is not None}"
    if kind == "TYPE_MATCH":
        return _name(type(value))
    if kind in ("ID_MATCH", "MODULE_MATCH", "BUILTIN_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "CLOSURE_MATCH",
                "DUPLICATE_INPUT"):
        if isinstance(value, types.ModuleType):
            return f"module {value.__name__}"
        if isinstance(value, types.FunctionType):
            return f"function {_name(value)} {_code(value)}"
        if hasattr(value, "__qualname__") or isinstance(value, types.BuiltinFunctionType):
            return f"{type(value).__name__} {_name(value)}"
        return f"a {_name(type(value))}"
    if kind == "EMPTY_NN_MODULE_HOOKS_DICT":
        return f"empty {not value}"
    if kind in ("SEQUENCE_LENGTH", "DICT_LENGTH", "LENGTH_CHECK"):
        return f"length {len(value)}"
    if kind == "DICT_KEYS_MATCH":
        return f"keys {_stable(list(dict.keys(value)))}"
    if kind == "NOT_PRESENT_IN_GENERIC_DICT":
        return f"{extra!r} not in its dict: {extra not in vars(value)}"
    if kind == "HASATTR":
        return f"has {extra!r}: {hasattr(value, extra)}"
    if kind in _CONTAINS:
        return f"has {extra!r}: {extra in value}"
    raise ValueError(kind)


def _recorded(kind: str, value: Any, extra: Any) -> Any:
    """What the parent's check compares the source's value with before each call (see GUARD_CHECKS)."""
    if kind in _VALUES:
        return (type(value), copy.deepcopy(value))  # a set of the user's may change in place
    if kind == "TYPE_MATCH":
        return type(value)
    if kind == "CLOSURE_MATCH":
        return value.__code__
    if kind in ("SEQUENCE_LENGTH", "DICT_LENGTH", "LENGTH_CHECK"):
        return len(value)
    if kind == "DICT_KEYS_MATCH":
        return list(dict.keys(value))
    if kind == "NOT_PRESENT_IN_GENERIC_DICT":
        return extra
    if kind == "HASATTR":
        return (extra, hasattr(value, extra))
    if kind in _CONTAINS:
        return (extra, extra in value)
    return value



GLOBALS_OF = "globals of "  # an import that is a module's globals dict (torch >= 2.14 names them so)
Untraceable = Refused  # dynamo cannot make the step one graph of tensor operations with no other effect


def user_classes(modules: list, named: list[type]) -> list[type]:
    """The classes of the user's (and their bases) among the modules' and the types the guards name (a
    helper object's class): neither torch's, numpy's nor Python's own."""
    found: dict[int, type] = {}
    for cls in [type(sub) for module in modules for sub in module.modules()] + list(named):
        for base in cls.__mro__:
            top = (getattr(base, "__module__", None) or "builtins").partition(".")[0]
            if top not in sys.stdlib_module_names and top not in ("builtins", "torch", "numpy"):
                found.setdefault(id(base), base)
    return list(found.values())


def class_names(classes: list[type]) -> dict[str, str]:
    """The code of these classes, method by method (a file edited since the program imported it would give
    the child other code than the program runs)."""
    return {f"{_name(cls)}.{name}": describe("FUNCTION_MATCH", fn) for cls in classes
            for name, fn in vars(cls).items() if isinstance(fn, types.FunctionType)}


# ----------------------------------------------------------------------------------------------- the parent
def _scope(head: Callable, imports: dict[str, str]) -> dict:
    """The ``G`` the sources read: the step's globals and the modules dynamo reached them through."""
    scope = dict(head.__globals__)
    for name, module in imports.items():
        if module == "builtins.__dict__":
            scope[name] = vars(builtins)
        elif module.startswith(GLOBALS_OF) and module[len(GLOBALS_OF):] in sys.modules:
            scope[name] = vars(sys.modules[module[len(GLOBALS_OF):]])
        elif module in sys.modules:
            scope[name] = sys.modules[module]
        else:
            raise ValueError(f"the step reads module {module}, which this process has not imported")
    return scope


_MODULE_DICTS = ("_parameters", "_buffers", "_modules")
_SUBMODULE = re.compile(r"G\['f\d+'\](?:\._modules\['[^']*'\])*")  # a step's module, or a submodule of it
STATE_GUARD = re.compile(_SUBMODULE.pattern + r"\._(?:parameters|buffers)\['[^']*'\]")  # its state: the state check's
_INHERITED = re.compile(r"dict\(type\((.+)\)\.__mro__\[(\d+)\]\.__dict__\)\[('[^']*'|\"[^\"]*\")\]")
_BARE = re.compile(r"G\[('[^']*'|\"[^\"]*\")\]")


def _covered(kind: str, source: str, value: Any, extra: Any) -> bool:
    """Whether a guard needs no check of its own before each call: its source is an entry of the step's
    globals, which never changes (``G['f0']``, a module dynamo reached code through), or the state check
    of stateful.py already checks it for one of the step's modules, reached from the step's own globals
    through submodules only (its hooks, type, submodules, training flag, no ``forward`` on the instance).
    A module reached through a global of the user's is checked here: the global may be bound to another."""
    if kind in ("ID_MATCH", "MODULE_MATCH", "TYPE_MATCH", "BUILTIN_MATCH", "FUNCTION_MATCH", "CLASS_MATCH") \
            and _BARE.fullmatch(source):
        return True
    owner, _, leaf = source.rpartition(".")
    if kind == "EMPTY_NN_MODULE_HOOKS_DICT" or (kind == "TYPE_MATCH" and leaf in _MODULE_DICTS) or \
            (kind == "CONSTANT_MATCH" and leaf == "training"):
        return bool(_SUBMODULE.fullmatch(owner))
    if kind == "TYPE_MATCH" or (kind == "NOT_PRESENT_IN_GENERIC_DICT" and extra == "forward"):
        return bool(_SUBMODULE.fullmatch(source))
    return False


def check(head: Callable, modules: list, traced: dict) -> Callable[[], bool]:
    """In the parent, when the package arrives: a generated function telling whether every value the
    child's dynamo guarded is still what the child saw (raises ValueError when one already differs, or when
    the child's classes have other code than the program's)."""
    G = _scope(head, traced["imports"])
    ns: dict[str, Any] = {"G": G, "___odict_getitem": collections.OrderedDict.__getitem__}
    parts: list[str] = []
    seen: set[tuple] = set()
    named: list[type] = []
    for k, (kind, source, want, extra) in enumerate(traced["guards"]):
        if (kind, source, extra) in seen:
            continue
        seen.add((kind, source, extra))
        value = _read_as_compiled(kind, source, want, extra, ns)
        if kind == "TYPE_MATCH":
            named.append(type(value))
        if not _covered(kind, source, value, extra):
            parts.extend(_guard_parts(k, kind, source, value, extra, ns))
    parts.extend(_class_parts(user_classes(modules, named), traced["classes"], ns))
    body = " and ".join(parts) or "True"
    code = f"def guards():\n    try:\n        return bool({body})\n    except Exception:\n        return False\n"
    exec(compile(code, "<flowvm FUSED guards>", "exec"), ns)  # noqa: S102
    return ns["guards"]


def _read_as_compiled(kind: str, source: str, want, extra, ns: dict):
    """The value a guard's source reads here; ValueError unless it is what the child's compile saw."""
    expr = compile(source, "<flowvm guard>", "eval")
    try:
        value = eval(expr, ns)  # noqa: S307 - a source dynamo wrote in the child for this step
    except Exception as err:
        raise ValueError(f"{source} cannot be read here ({type(err).__name__}: {err})") from None
    got = describe(kind, value, extra)
    if got != want:
        raise ValueError(f"{source} is {got} here, the compile saw {want}")
    if kind == "DUPLICATE_INPUT" and eval(compile(extra, "<flowvm guard>", "eval"), ns) is not value:  # noqa: S307
        raise ValueError(f"{source} is not {extra} here, as it was for the compile")
    return value


def _guard_parts(k: int, kind: str, source: str, value, extra, ns: dict) -> list[str]:
    """The expressions checking guard k before each call (its recorded values put in ns)."""
    ns[f"o{k}"] = _recorded(kind, value, extra)
    parts = ["(" + GUARD_CHECKS[kind].format(v=f"({source})", o=f"o{k}") + ")"]
    inherited = _INHERITED.fullmatch(source)
    if inherited:  # a class attribute found in a base class: not shadowed since in a class before it
        obj, depth, key = inherited.groups()
        ns[f"a{k}"] = ast.literal_eval(key)
        parts.append(f"not any(a{k} in c.__dict__ for c in type({obj}).__mro__[:{int(depth)}])")
    return parts


def _class_parts(classes: list, traced_classes: dict, ns: dict) -> list[str]:
    """The expressions checking that the user's classes keep their methods (ValueError when their code
    already differs from the child's)."""
    mine = class_names(classes)
    for name, want in traced_classes.items():
        if mine.get(name) != want:
            raise ValueError(f"{name} has other code here than the compile saw (a file edited since it was imported?)")
    parts = []
    for j, cls in enumerate(classes):  # a method or other descriptor replaced or added since: other code
        methods = {n: v for n, v in vars(cls).items() if hasattr(type(v), "__get__")}
        ns[f"cd{j}"], ns[f"cv{j}"] = vars(cls), methods  # (a counter of the class's may change)
        parts.append(f"len(cd{j}) == {len(vars(cls))} and all(cd{j}.get(n) is v for n, v in cv{j}.items())")
    return parts
