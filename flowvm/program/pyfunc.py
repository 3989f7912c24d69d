"""``@flowvm.program``: a plain Python function whose loops and branches become a resumable program.

    @flowvm.program
    def train(steps, lr=0.1):
        w = 0.0
        for i in range(steps):
            w = w - lr * (w - 3.0)
            if abs(w - 3.0) < 1e-3:
                break
        return w

    prog = train(100)          # a program (a SEQ of SWITCHes, WHILEs and CALLs): printable, pickles, resumes
    prog.run()                 # what train's body returns
    train.function(100)        # the function itself, run as Python

Locals are registers; each statement one CALL of a function generated from that statement (pylower.py,
pyplan.py).  The program holds the function's source: a pickled run rebuilds its statements' functions from
it in a process that never saw them, in the function's module's globals, and refuses to resume when the
function's source changed since (``SourceChanged``), unless ``FLOWVM_ACCEPT_CHANGED_SOURCE=1`` is set and the
new source lowers to the same program shape (then the run goes on with the new code).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import os
import sys
import types
from typing import Any, Callable

from ..base.errors import CheckpointError
from ..pickled import stable
from .elements import CALL, SEQ, SWITCH, WHILE
from .pylower import JUMP, UNBOUND, VALUE, ProgramSyntaxError
from .pyplan import HELPERS, lower
from .registers import Registers

ACCEPT_ENV = "FLOWVM_ACCEPT_CHANGED_SOURCE"


@stable("flowvm")
class SourceChanged(CheckpointError):
    """A run of a ``@flowvm.program`` function resumed where the function's source differs from the one it
    was saved with."""


# ------------------------------------------------------------------------------------------ run-time helpers
@stable("flowvm.pickled")
class Next:
    """A for loop's step: truthy with the next ``value``, falsy at the end (or when a jump ends the loop)."""

    __slots__ = ("value", "more")

    def __init__(self, value: Any = None, more: bool = False):
        self.value, self.more = value, more

    def __bool__(self) -> bool:
        return self.more

    def __reduce__(self):
        return (Next, (self.value, self.more))


_END = Next()
SAVEABLE_ITERATORS = tuple(type(x) for x in (iter([]), iter(()), iter(range(0)), iter(""), iter({}), iter({}.values()),
                                             iter({}.items()), iter(set()), iter(b""), reversed([]), iter(range(1 << 70))))


def _iterate(iterable: Any) -> Any:
    """iter(iterable), refused when a copy of the run could not keep its place (a generator, a file)."""
    it = iter(iterable)
    if isinstance(it, SAVEABLE_ITERATORS) or _has_state(it):
        return it
    raise TypeError(f"for over {type(iterable).__name__}: its iterator ({type(it).__name__}) cannot be saved with "
                    "the run; iterate over a list (list(...) of it, when it is finite), a range, a flowvm.Batches "
                    "or an object whose iterator pickles")


def _has_state(it: Any) -> bool:
    cls = type(it)
    return getattr(cls, "__flowvm_resumable__", False) or (
        cls.__module__ not in ("builtins", "itertools") and ("__getstate__" in vars(cls) or "__reduce__" in vars(cls)
                                                               or hasattr(it, "__dict__")))


def _advance(it: Any, jump: int) -> Next:
    if jump:
        return _END
    for value in it:
        return Next(value, True)
    return _END


def _bound(names: dict, wanted: tuple[str, ...]) -> Any:
    values = tuple(names.get(n, UNBOUND) for n in wanted)
    return values[0] if len(values) == 1 else values


_HELPER_VALUES = {"__U": UNBOUND, "__bound": _bound, "__iterate": _iterate, "__advance": _advance}
assert set(_HELPER_VALUES) == set(HELPERS)


# -------------------------------------------------------------------------------------------- the source
class FunctionSource:
    """A decorated function's source and where it lives: what a pickled program holds instead of code.
    ``functions()`` compiles its statements' functions once a process, in its module's globals."""

    def __init__(self, module: str, qualname: str, source: str, filename: str, firstlineno: int,
                 free: tuple[str, ...] = ()):
        self.module, self.qualname, self.source = module, qualname, source
        self.filename, self.firstlineno, self.free = filename, firstlineno, free
        self.digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        self._plan = self._functions = None

    @property
    def plan(self):
        if self._plan is None:
            self._plan = lower(self.source, self.filename, self.firstlineno, self.free)
        return self._plan

    def functions(self) -> dict[str, Callable]:
        if self._functions is None:
            self._functions = _compile(self.plan, self.filename, _module_globals(self.module, self.qualname))
        return self._functions

    def shape(self) -> list:
        return [(p.name, p.role, tuple(p.reads), tuple(p.writes)) for p in self.plan.pieces.values()]

    def __reduce__(self):
        return (restore_source, (self.module, self.qualname, self.source, self.filename, self.firstlineno, self.free))


_SOURCES: dict[tuple, FunctionSource] = {}


@stable("flowvm.pickled")
def restore_source(module, qualname, source, filename, firstlineno, free) -> FunctionSource:
    """A pickled FunctionSource in this process: the same object for every statement of one run; refused
    when the function's current source differs (see the module's docstring)."""
    key = (module, qualname, source)
    if key in _SOURCES:
        return _SOURCES[key]
    saved = FunctionSource(module, qualname, source, filename, firstlineno, free)
    current = _current(module, qualname)
    if current is not None and current.source != source:
        if os.environ.get(ACCEPT_ENV) != "1":
            raise SourceChanged(filename, f"the run was saved with another version of {qualname} (module {module}); "
                                          f"set {ACCEPT_ENV}=1 to go on with the function as it is now")
        if current.shape() != saved.shape():
            raise SourceChanged(filename, f"{qualname} changed shape since the run was saved (its statements, "
                                          "loops or the locals they use differ): the run cannot go on with it")
        saved = current
    _SOURCES[key] = saved
    return saved


def _current(module: str, qualname: str) -> FunctionSource | None:
    obj = sys.modules.get(module)
    if obj is None:
        try:
            obj = importlib.import_module(module)
        except Exception:
            return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj.source if isinstance(obj, PyFunction) else None


def _module_globals(module: str, qualname: str) -> dict:
    mod = sys.modules.get(module)
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except Exception as err:
            raise CheckpointError(module, f"the program's function {qualname} lives in module {module}, which this "
                                          f"process cannot import ({type(err).__name__}: {err})") from None
    return mod.__dict__


def _compile(plan, filename: str, globals_: dict) -> dict[str, Callable]:
    code = compile(plan.module, filename, "exec")
    scratch: dict = dict(_HELPER_VALUES)
    exec(code, scratch)  # noqa: S102 - the user's own function, rewritten
    out = {}
    for name in plan.pieces:
        made = scratch[name]
        out[name] = types.FunctionType(made.__code__, globals_, name, made.__defaults__)
    return out


@stable("flowvm.pickled")
class Statement:
    """The function of one statement (or condition, or loop step) of a ``@flowvm.program`` function: it pickles
    as its source and name, and is compiled again from them in another process."""

    __slots__ = ("source", "name", "fn", "__weakref__")
    __flowvm_code__ = True  # code, not state: a state file leaves it to the program built again (stateobjects.py)

    def __init__(self, source: FunctionSource, name: str):
        self.source, self.name = source, name
        self.fn = source.functions()[name]

    def __call__(self, *args):
        return self.fn(*args)

    @property
    def __flowvm_backward__(self) -> bool:
        """Whether the statement is a backward pass, ``loss.backward(...)``: fuse-torch joins it to the tensor
        statements before it and runs it eagerly (flowvm/fused/codegen.py, ``is_barrier``)."""
        piece = self.source.plan.pieces[self.name]
        return piece.role == "stmt" and is_backward(piece.body[0])

    @property
    def text(self) -> str:
        """The statement (or condition) as written."""
        return self.source.plan.pieces[self.name].text

    @property
    def __flowvm_text__(self) -> str:  # how a listing prints the CALL (flowvm.program.printer.call_text)
        piece = self.source.plan.pieces[self.name]
        return {"cond": f"({piece.text})", "guard": "(nothing jumped)"}.get(piece.role, piece.text)

    def __repr__(self) -> str:
        piece = self.source.plan.pieces[self.name]
        return f"<{self.source.qualname}, line {piece.line}: {piece.text}>"

    def __reduce__(self):
        return (Statement, (self.source, self.name))

    def __flowvm_value_source__(self) -> tuple:
        """How ``to_source`` writes the statement (in a program edited or optimized, no longer the function's
        own call): ``statement(f, name)``, f the decorated function, imported from its module."""
        from ..base.errors import SourceError

        function = _resolve(self.source.module, self.source.qualname)
        if not isinstance(function, PyFunction):
            raise SourceError(f"{self.source.module}.{self.source.qualname} is no @flowvm.program function in "
                              "this process")
        return statement, (function, self.name)


@stable("flowvm.pickled")
def statement(function: "PyFunction", name: str) -> Statement:
    """The statement (a generated function's name: ``_stmt_3``) of a ``@flowvm.program`` function, as
    ``to_source`` writes it."""
    if not isinstance(function, PyFunction) or name not in function.source.plan.pieces:
        raise LookupError(f"statement: {name!r} is no statement of {function!r}")
    return Statement(function.source, name)


def is_backward(node: ast.stmt) -> bool:
    """Whether node (inside per-statement ``with`` blocks) is ``name.backward(...)``, calling nothing else."""
    while isinstance(node, ast.With) and len(node.body) == 1:
        node = node.body[0]
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    func = node.value.func
    return (isinstance(func, ast.Attribute) and func.attr == "backward" and isinstance(func.value, ast.Name)
            and sum(isinstance(sub, ast.Call) for sub in ast.walk(node)) == 1)


# -------------------------------------------------------------------------------------------- the decorator
@stable("flowvm.pickled")
class PyFunction:
    """A function decorated with ``@flowvm.program``: calling it returns a new program, with its own registers,
    for these arguments; ``.function`` is the function itself."""

    def __init__(self, function: Callable):
        if not inspect.isfunction(function):
            raise TypeError(f"@flowvm.program takes a function, got {type(function).__name__}")
        functools.update_wrapper(self, function)
        self.function = function
        code = function.__code__
        try:
            text = inspect.getsource(function)
        except OSError as err:
            raise ProgramSyntaxError(f"@flowvm.program needs the source of {function.__qualname__}: {err}") from None
        self.source = FunctionSource(function.__module__, function.__qualname__, text, code.co_filename,
                                     code.co_firstlineno, tuple(code.co_freevars))
        self.source.plan  # refusals now, at decoration time
        _SOURCES.setdefault((self.source.module, self.source.qualname, self.source.source), self.source)

    def __call__(self, *args, **kwargs):
        bound = inspect.signature(self.function).bind(*args, **kwargs)
        bound.apply_defaults()
        return build(self.source, dict(bound.arguments), _closure(self.function))

    def __repr__(self) -> str:
        return f"<flowvm.program {self.function.__qualname__}>"


def _closure(function: Callable) -> dict:
    cells = function.__closure__ or ()
    return {name: cell.cell_contents for name, cell in zip(function.__code__.co_freevars, cells)}


PLAIN = (bool, int, float, str, bytes, type(None))


@stable("flowvm.pickled")
class PyProgram(SEQ):
    """The program of one call of a ``@flowvm.program`` function: a SEQ (its kind everywhere) that also knows
    the call it came from, so that ``to_source`` writes that call back (``from module import f``, ``program =
    f(3, lr=0.1)``).  Its arguments are kept when they are plain values (numbers, strings, None); a call with
    others is not written back (``to_source`` names the argument).  An edit makes it a plain SEQ."""

    def __init__(self, elements, call: tuple = ("", "", (), ())):
        super().__init__(elements)
        self._init(elements=self.elements, call=tuple(call))

    def __flowvm_source__(self):
        from ..base.errors import SourceError

        module, qualname, plain, other = self.call
        if other:
            raise SourceError(f"the call of {qualname} takes {other[0]}, which source cannot write: only a call "
                              "of plain values (numbers, strings, None) is written back")
        function = _resolve(module, qualname)
        if not isinstance(function, PyFunction):
            raise SourceError(f"{module}.{qualname} is no @flowvm.program function in this process")
        return function, (), dict(plain)


def _resolve(module: str, qualname: str) -> Any:
    obj = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def build(source: FunctionSource, arguments: dict, closure: dict) -> PyProgram:
    """The program of ``source``'s function for these arguments: its registers hold the arguments, what it
    closes over, and every other local unbound."""
    plan = source.plan
    reg = Registers()
    for name in plan.local_names:
        reg[name] = arguments[name] if name in arguments else closure.get(name, UNBOUND)
    reg[JUMP], reg[VALUE] = 0, None
    for name in plan.hidden[2:]:
        reg[name] = None
    plain = tuple((k, v) for k, v in arguments.items() if type(v) in PLAIN)
    other = tuple(k for k, v in arguments.items() if type(v) not in PLAIN)
    return PyProgram(_element(plan.tree, source, reg).elements, (source.module, source.qualname, plain, other))


def _element(spec, source: FunctionSource, reg: Registers):
    kind = spec[0]
    if kind == "seq":
        return SEQ([_element(s, source, reg) for s in spec[1]])
    if kind == "call":
        return _call(source, spec[1], reg, spec[2])
    if kind == "switch":
        _, cond, body, orelse = spec
        return SWITCH(_call(source, cond, reg, None), {True: _element(("seq", body), source, reg)},
                      default=_element(("seq", orelse), source, reg))
    if kind == "while":
        _, cond, stored, body = spec
        return WHILE(_call(source, cond, reg, stored), _element(("seq", body), source, reg))
    raise AssertionError(kind)


def _call(source: FunctionSource, name: str, reg: Registers, store) -> CALL:
    piece = source.plan.pieces[name]
    store_to = None if store is None else reg(store) if isinstance(store, str) else tuple(reg(s) for s in store)
    return CALL(Statement(source, name), *[reg(p) for p in piece.reads], store_to=store_to)


def program(function: Callable) -> PyFunction:
    """Decorate a function whose body is plain Python: calling it returns a resumable flowvm program that
    runs the body (docs/programs.md, "Plain Python loops")."""
    return PyFunction(function)


__all__ = ["program", "PyFunction", "PyProgram", "Statement", "FunctionSource", "SourceChanged", "ProgramSyntaxError",
           "Next", "ACCEPT_ENV"]
