"""Late binding: ``Depends(provider)`` as a CALL argument, resolved each time the CALL runs.

A program can name *what* it needs (the device, the data source, a model)
without fixing *which* one: the provider is called when the CALL runs, and
``dependency_overrides`` on the program or on a driver replaces a provider
without rebuilding the program, for instance a stub in tests:

>>> from flowvm import CALL, SEQ, Registers
>>> def get_device():
...     return "cuda"
>>> reg = Registers()
>>> prog = CALL(lambda device: f"running on {device}", Depends(get_device), store_to=reg('msg'))
>>> prog.run()
'running on cuda'
>>> prog.dependency_overrides[get_device] = lambda: "cpu"
>>> prog.run()
'running on cpu'

Rules, as in FastAPI's dependency injection:

- a provider is called with no arguments, except that its own parameters whose
  default is a ``Depends`` are resolved the same way (sub-dependencies);
- within one run of one CALL a provider is called once, however many
  arguments or sub-dependencies use it (``Depends(fn, use_cache=False)``
  calls it for each use);
- a driver's ``dependency_overrides`` take precedence over those of the
  program it runs; overrides set on a sub-program apply to the CALLs inside
  it, and where an enclosing program overrides the same provider, the
  outermost wins (whoever composes has the last word); all are dicts
  ``{provider: replacement}`` and are pickled with the driver or the program
  (so replacements must be picklable, by cloudpickle at least).

A CALL with a ``Depends`` anywhere in its arguments (also inside lists, tuples
and dicts) is built as a ``DependsCALL``, a leaf that resolves them through the
driver's leaf protocol; every other CALL keeps the compiled fast path.
"""

from __future__ import annotations

import keyword

import inspect
from typing import Any, Callable

from ..pickled import stable
from .driver import Driver
from .frames import ELEMENT
from ..program.protocol import store_source
from ..program.elements import CALL, provide
from ..base.errors import FlowError
from ..program.registers import Register, Registers, has_registers, resolve, same_kind_of_dict


@stable("flowvm")
class Depends:
    """A CALL argument that stands for ``provider()``, called when the CALL runs.

    >>> Depends(len)
    Depends(len)
    """

    __slots__ = ("dependency", "use_cache")

    def __init__(self, dependency: Callable[..., Any], *, use_cache: bool = True):
        if not callable(dependency):
            raise TypeError(f"Depends: the provider must be callable, got {type(dependency).__name__} "
                            f"{dependency!r:.60}")
        object.__setattr__(self, "dependency", dependency)
        object.__setattr__(self, "use_cache", bool(use_cache))

    def __setattr__(self, name, value):
        raise AttributeError("Depends is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Depends):
            return NotImplemented
        return self.dependency == other.dependency and self.use_cache == other.use_cache

    def __hash__(self) -> int:
        try:
            return hash(("flowvm.Depends", self.dependency))
        except TypeError:
            return hash("flowvm.Depends")

    def __reduce__(self):
        return (make_depends, (self.dependency, self.use_cache))

    def __repr__(self) -> str:
        from ..program.printer import fn_name

        extra = ", use_cache=False" if not self.use_cache else ""
        return f"Depends({fn_name(self.dependency)}{extra})"


@stable("flowvm.pickled")
def make_depends(dependency, use_cache):
    return Depends(dependency, use_cache=use_cache)


def has_depends(obj: Any) -> bool:
    """Whether obj is a Depends or holds one inside lists, tuples or dicts."""
    if isinstance(obj, Depends):
        return True
    if isinstance(obj, (list, tuple)):
        return any(has_depends(item) for item in obj)
    if isinstance(obj, dict) and not isinstance(obj, Registers):
        return any(has_depends(k) or has_depends(v) for k, v in obj.items())
    return False


def iter_depends(obj: Any):
    """Every Depends in obj (also inside lists, tuples and dicts)."""
    if isinstance(obj, Depends):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_depends(item)
    elif isinstance(obj, dict) and not isinstance(obj, Registers):
        for k, v in obj.items():
            yield from iter_depends(k)
            yield from iter_depends(v)


# ----------------------------------------------------------------- overrides
def provider_for(drv: Driver, dependency: Callable, within: tuple = ()) -> Callable:
    """The callable that stands for dependency in drv's run: an override, or dependency itself.

    within holds the elements the CALL runs inside, outermost first: the
    driver's overrides win, then those of the outermost element that has one.
    """
    table = drv.__dict__.get("dependency_overrides")
    if table:
        try:
            return table[dependency]
        except (KeyError, TypeError):  # an unhashable provider cannot be overridden
            pass
    for el in within or (drv.program,):
        table = el.__dict__.get("_overrides")
        if table:
            try:
                return table[dependency]
            except (KeyError, TypeError):
                pass
    return dependency


_SIGNATURES: dict = {}


def _sub_dependencies(fn: Callable) -> tuple:
    """(parameter name, Depends) for each parameter of fn whose default is a Depends."""
    try:
        return _SIGNATURES[fn]
    except (KeyError, TypeError):
        pass
    try:
        params = inspect.signature(fn).parameters.values()
        subs = tuple((p.name, p.default) for p in params if isinstance(p.default, Depends))
    except (TypeError, ValueError):  # builtins without a signature take no sub-dependencies
        subs = ()
    try:
        _SIGNATURES[fn] = subs
    except TypeError:
        pass
    return subs


def resolve_dependency(drv: Driver, dep: Depends, cache: dict, chain: tuple = (), within: tuple = ()) -> Any:
    """The value of dep in drv's run (providers called once per CALL run unless use_cache=False)."""
    key = dep.dependency
    if dep.use_cache:
        try:
            return cache[key]
        except KeyError:
            pass
        except TypeError:
            key = None
    if chain and any(key is c for c in chain):
        from ..program.printer import fn_name

        names = " -> ".join(fn_name(c) for c in chain + (key,))
        raise FlowError(f"Depends: circular dependency {names}")
    provider = provider_for(drv, dep.dependency, within)
    subs = _sub_dependencies(provider)
    try:
        if subs:
            inner = chain + (dep.dependency,)
            value = provider(**{name: resolve_dependency(drv, sub, cache, inner, within) for name, sub in subs})
        else:
            value = provider()
    except Exception as err:
        if not getattr(err, "_flowvm_dep_noted", False):
            from ..program.printer import fn_name

            err.add_note(f"flowvm: while resolving {dep!r} (provider {fn_name(provider)})")
            err._flowvm_dep_noted = True
        raise
    if dep.use_cache and key is not None:
        cache[key] = value
    return value


def _resolve_arg(value: Any, drv: Driver, regs: dict, cache: dict, within: tuple = ()) -> Any:
    if isinstance(value, Depends):
        return resolve_dependency(drv, value, cache, (), within)
    if isinstance(value, Register):
        return regs[value.name]
    if isinstance(value, list):
        return [_resolve_arg(v, drv, regs, cache, within) for v in value]
    if isinstance(value, tuple):
        items = [_resolve_arg(v, drv, regs, cache, within) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict) and not isinstance(value, Registers):
        pairs = {_resolve_arg(k, drv, regs, cache, within): _resolve_arg(v, drv, regs, cache, within)
                 for k, v in value.items()}
        return pairs if type(value) is dict else same_kind_of_dict(value, pairs)
    return resolve(value, regs)


def _arg_source(value: Any, name: str, ns: dict) -> str:
    """Python source for one argument: a register lookup, a dependency, a resolved container, or a constant."""
    if isinstance(value, Register):
        return f"R[{value.name!r}]"
    ns[name] = value
    if isinstance(value, Depends):
        return f"dep({name}, cache)"
    if has_depends(value) or has_registers(value):
        return f"resolve_arg({name}, cache)"
    return name


def _factory(el: "DependsCALL") -> Callable:
    """A function (fn, R, dep, resolve_arg) -> the leaf's closure, compiled once per element (a cache)."""
    ns: dict[str, Any] = {}
    parts = [_arg_source(a, f"a{i}", ns) for i, a in enumerate(el.args)]
    for i, (key, value) in enumerate(el.kwargs.items()):
        if key.isidentifier() and not keyword.iskeyword(key):
            parts.append(f"{key}={_arg_source(value, f'k{i}', ns)}")
        else:
            ns[f"kw{i}"] = {key: value}
            parts.append(f"**resolve_arg(kw{i}, cache)")
    store = f"    {store_source(el.store_to)} = v\n" if el.store_to is not None else ""
    src = (f"def factory(fn, R, dep, resolve_arg):\n"
           f"  def leaf():\n"
           f"    cache = {{}}\n"
           f"    v = fn({', '.join(parts)})\n"
           f"{store}"
           f"    return v\n"
           f"  return leaf\n")
    exec(compile(src, "<flowvm CALL with Depends>", "exec"), ns)
    return ns["factory"]


@stable("flowvm.pickled")
class DependsCALL(CALL):
    """A CALL with ``Depends`` arguments (``CALL(...)`` builds one by itself when it sees a Depends).

    It runs through the driver's leaf protocol so that it can reach the
    driver's ``dependency_overrides``; it prints, verifies, matches and
    pickles like any CALL.
    """

    simple_leaf = False  # it reads the driver's overrides and stack

    def bind(self, drv: Driver, frame: list) -> Callable[[], Any]:
        factory = self._cached("depends_leaf", lambda: _factory(self))
        regs = drv.registers
        within = tuple(f[ELEMENT] for f in drv.frames)  # the elements this CALL runs inside, for their overrides

        def dep(d: Depends, cache: dict) -> Any:
            return resolve_dependency(drv, d, cache, (), within)

        def resolve_arg(value: Any, cache: dict) -> Any:
            return _resolve_arg(value, drv, regs, cache, within)

        return factory(self.fn, regs, dep, resolve_arg)


def call_kind(args: tuple, kwargs: dict) -> type:
    """The class of a CALL with these arguments: a DependsCALL when they hold a Depends."""
    return DependsCALL if has_depends(args) or has_depends(kwargs) else CALL


provide("call_kind", call_kind)  # CALL(...)
