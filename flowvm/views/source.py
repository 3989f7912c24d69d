"""Python source that rebuilds a program: ``to_source`` and ``from_source``.

The source imports what the program calls (module functions, classes,
methods reached from a module, the global random generators' methods) and
writes constants as literals: numbers (NaN and infinities too), strings,
bytes, None, lists, tuples, dicts, sets, named tuples, numpy arrays and
scalars, torch tensors, ``functools.partial``.  Anything else (a dataset
object, a model) is named through ``names={'dataset': dataset}`` and given
back to ``from_source`` under the same name.  An element that appears at
several places is written once, as a variable, so the rebuilt program shares
it in the same way.  The register file's values are written too
(``registers=False``: an empty file; a list of names: only those).

>>> from flowvm import CALL, REPEAT, Registers
>>> reg = Registers(x=1.5)
>>> prog = REPEAT(3, CALL(max, reg('x'), 2, store_to=reg('x')), counter=reg('i'))
>>> text = to_source(prog)
>>> print(text)
from flowvm import CALL, REPEAT, Registers
<BLANKLINE>
reg = Registers({'x': 1.5})
program = REPEAT(3, CALL(max, reg('x'), 2, store_to=reg('x')), counter=reg('i'))
>>> str(from_source(text)) == str(prog)
True

New element kinds take part by defining ``__flowvm_source__()``, returning
``(constructor, args, kwargs)`` such that ``constructor(*args, **kwargs)``
rebuilds the element.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import keyword
import math
import sys
import textwrap
import types
from typing import Any, Iterable

from ..program.elements import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Element
from ..base.errors import SourceError
from ..program.paths import format_path, walk
from ..program.registers import Register, Registers

WIDTH = 100
_FLOWVM_NAMES = {SEQ: "SEQ", REPEAT: "REPEAT", LOOP: "LOOP", WHILE: "WHILE", SWITCH: "SWITCH", WEAVE: "WEAVE",
                 BUFFER: "BUFFER", CALL: "CALL", PRINT: "PRINT"}


def _import_of(obj: Any) -> tuple[str, str] | None:
    """(module, dotted attribute path) from which obj can be imported, or None."""
    if isinstance(obj, types.ModuleType):
        return (obj.__name__, "")
    owner = getattr(obj, "__self__", None)
    bound = owner is not None and not isinstance(owner, types.ModuleType)
    modules = [getattr(obj, "__module__", None)]
    if bound:
        modules.append(type(owner).__module__)
    attrs = [getattr(obj, "__qualname__", None), getattr(obj, "__name__", None)]
    objclass = getattr(obj, "__objclass__", None)  # a method descriptor: str.upper, torch.Tensor.add
    if isinstance(objclass, type) and isinstance(getattr(obj, "__name__", None), str):
        if objclass.__module__ == "torch._C" and objclass.__name__ == "TensorBase":
            modules.insert(0, "torch")  # written as torch.Tensor.NAME, the name users know
            attrs.insert(0, f"Tensor.{obj.__name__}")
        modules.append(objclass.__module__)
    for mod_name in modules:
        if not isinstance(mod_name, str):
            continue
        try:
            module = importlib.import_module(mod_name)
        except Exception:
            continue
        for attr in attrs:
            if not isinstance(attr, str) or "<" in attr:
                continue
            found: Any = module
            try:
                for part in attr.split("."):
                    found = getattr(found, part)
            except AttributeError:
                continue
            if found is obj or (bound and found == obj):
                return (mod_name, attr)
    return None


class _Writer:
    def __init__(self, program: Element, names: dict[str, Any], reg_name: str):
        self.program = program
        self.by_id = {id(v): k for k, v in names.items()}
        self.imports: dict[tuple[str, str], str] = {}  # (module, attribute) -> local name
        self.taken = set(names) | {reg_name, "program", "Registers", "Scope", "Depends", "functools", "numpy",
                                   "torch", "float"} | set(_FLOWVM_NAMES.values())
        self.flowvm: set[str] = {"Registers"}
        self.reg_name = reg_name
        self.file: Registers | None = None
        self.path: tuple = ()
        self.shared_vars: dict[int, str] = {}
        self.child_paths: dict[int, tuple] = {}  # children of the element being written, by id: their paths

    # -- names and imports
    def _local(self, module: str, attr: str) -> str:
        key = (module, attr)
        if key in self.imports:
            return self.imports[key]
        base = attr or module.rsplit(".", 1)[-1]
        name, k = base, 1
        while name in self.taken or keyword.iskeyword(name) or (hasattr(builtins, name) and module != "builtins"):
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        self.imports[key] = name
        return name

    def ref(self, obj: Any) -> str:
        """An expression naming an importable object."""
        if id(obj) in self.by_id:
            return self.by_id[id(obj)]
        found = _import_of(obj)
        if found is None:
            owner = getattr(obj, "__self__", None)
            if owner is not None and id(owner) in self.by_id and isinstance(getattr(obj, "__name__", None), str):
                return f"{self.by_id[id(owner)]}.{obj.__name__}"
            raise self.error(f"{_what(obj)} cannot be imported; pass names={{'name': obj}} to to_source "
                             "(and the same names to from_source)")
        module, attr = found
        first = attr.partition(".")[0]
        if module == "builtins" and attr and hasattr(builtins, first) and first not in self.by_id.values():
            return attr  # a builtin (or its method, str.upper) needs no import
        if not attr:
            return self._local(module, "")
        first, _, rest = attr.partition(".")
        return self._local(module, first) + (f".{rest}" if rest else "")

    def error(self, message: str) -> SourceError:
        from ..program.printer import describe

        try:
            from ..program.paths import get

            where = f"{describe(get(self.program, self.path))} at path {format_path(self.path) or '<root>'!r}: "
        except Exception:  # pragma: no cover
            where = ""
        return SourceError(where + message, format_path(self.path))

    # -- values
    def value(self, v: Any) -> str:
        if id(v) in self.by_id:
            return self.by_id[id(v)]
        if v is None or isinstance(v, (bool, str, bytes)):
            return repr(v)
        if type(v) is int:
            return repr(v)
        if type(v) is float:
            return repr(v) if math.isfinite(v) else f"float({repr(v)!r})"
        if type(v) is complex:
            return f"complex({self.value(v.real)}, {self.value(v.imag)})"
        if isinstance(v, Element):  # written as an element: its own path if it is a child, else its holder's
            return self.element(v, self.child_paths.get(id(v), self.path))
        if isinstance(v, Register):
            if self.file is None:
                self.file = v.file
            elif v.file is not self.file:  # pragma: no cover - start() rejects such programs
                raise self.error("registers of two register files")
            return f"{self.reg_name}({v.name!r})"
        from ..machine.depends import Depends

        if isinstance(v, Depends):
            self.flowvm.add("Depends")
            extra = ", use_cache=False" if not v.use_cache else ""
            return f"Depends({self.ref(v.dependency)}{extra})"
        if type(v) is list:
            return self.seq("[", [self.value(x) for x in v], "]")
        if type(v) is tuple:
            items = [self.value(x) for x in v]
            return self.seq("(", items, ",)" if len(items) == 1 else ")")
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            return self.call(self.ref(type(v)), [self.value(x) for x in v])
        if type(v) is dict:
            return self.seq("{", [f"{self.value(k)}: {self.value(x)}" for k, x in v.items()], "}")
        if type(v) in (set, frozenset):
            items = sorted((self.value(x) for x in v))
            return f"{type(v).__name__}({self.seq('[', items, ']')})"
        if isinstance(v, functools.partial):
            args = [self.ref(v.func)] + [self.value(a) for a in v.args]
            args += [f"{k}={self.value(x)}" for k, x in v.keywords.items()]
            return self.call("functools.partial", args)
        np = sys.modules.get("numpy")
        if np is not None and isinstance(v, np.ndarray) and v.dtype.kind in "biufc":
            text = self.call("numpy.array", [self.value(v.tolist()), f"dtype={str(v.dtype)!r}"])
            return text + (f".reshape({v.shape!r})" if v.size == 0 else "")
        if np is not None and isinstance(v, np.generic) and v.dtype.kind in "biufc":
            return f"numpy.{type(v).__name__}({self.value(v.item())})"
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.is_complex():
            text = self.call("torch.tensor", [self.value(v.detach().tolist()), f"dtype={v.dtype}"])
            text += f".reshape({tuple(v.shape)!r})" if v.numel() == 0 else ""
            return text + (".requires_grad_()" if v.requires_grad else "")
        if callable(v) or isinstance(v, types.ModuleType):
            return self.ref(v)
        raise self.error(f"{_what(v)} has no source form; pass names={{'name': obj}} to to_source "
                         "(and the same names to from_source)")

    def seq(self, open_: str, items: list[str], close: str) -> str:
        one = open_ + ", ".join(items) + close
        if len(one) <= WIDTH and "\n" not in one:
            return one
        inner = ",\n".join(textwrap.indent(i, "    ") for i in items)
        return f"{open_}\n{inner},\n{close.lstrip(',')}"

    def call(self, name: str, args: list[str]) -> str:
        one = f"{name}({', '.join(args)})"
        if len(one) <= WIDTH and "\n" not in one:
            return one
        head, last = args[:-1], args[-1] if args else ""
        if last[:1] in "[{" and "\n" in last and not any("\n" in a for a in head):
            prefix = f"{name}({', '.join(head + [''])}"
            if len(prefix) <= WIDTH // 2:  # hug a trailing list or dict: SEQ([ ... ])
                return f"{prefix}{last})"
        return self.seq(f"{name}(", args, ")")

    # -- elements
    def element(self, el: Element, path: tuple) -> str:
        if id(el) in self.shared_vars:
            return self.shared_vars[id(el)]
        outer = self.path, self.child_paths
        self.path, self.child_paths = path, {}
        text = self._element(el, path)
        self.path, self.child_paths = outer  # what follows (the rest of a list holding el) is the holder's
        if el.scope is not None:
            s = el.scope
            self.flowvm.add("Scope")
            shared = self.value(frozenset(s.shared)) if s.shared else "frozenset()"
            text += f".with_scope(Scope({s.namespace!r}, {s.template!r}, {shared}))"
        table = el.__dict__.get("_overrides")
        if table and path != ():  # the root's are a statement of their own (see to_source)
            text += f".with_overrides({self.overrides(table)})"
        if el.__dict__.get("_settings"):
            text += f".with_process_settings({el.__dict__['_settings']!r})"
        return text

    def overrides(self, table: dict) -> str:
        return self.seq("{", [f"{self.ref(k)}: {self.value(v)}" for k, v in table.items()], "}")

    def _element(self, el: Element, path: tuple) -> str:
        kind = type(el)
        sub = lambda i, c: self.element(c, path + (i,))  # noqa: E731
        hook = getattr(el, "__flowvm_source__", None)
        if hook is not None:
            # arguments are written as values, where an element (a SPAWN's fragment, the elements in a
            # list argument) is written as an element, shared ones by their variable
            ctor, args, kwargs = hook()
            for i, c in enumerate(el.children):
                self.child_paths.setdefault(id(c), path + (i,))
            texts = [self.value(a) for a in args] + [f"{k}={self.value(v)}" for k, v in kwargs.items()]
            return self.call(self.ref(ctor), texts)
        name = _FLOWVM_NAMES.get(kind) or ("CALL" if isinstance(el, CALL) else None)
        if name is None:
            raise self.error(f"no source form for {el.kind} elements (define __flowvm_source__ on {kind.__name__})")
        self.flowvm.add(name)
        if isinstance(el, CALL):
            args = [self.ref(el.fn)] + [self.value(a) for a in el.args]
            if el.store_to is not None:
                args.append(f"store_to={self.value(el.store_to)}")
            odd = {}
            for k, v in el.kwargs.items():
                if k.isidentifier() and not keyword.iskeyword(k):
                    args.append(f"{k}={self.value(v)}")
                else:
                    odd[k] = v
            if odd:
                args.append("**" + self.value(odd))
            return self.call(name, args)
        if kind is PRINT:
            args = [self.value(o) for o in el.objs] + ([f"sep={el.sep!r}"] if el.sep != " " else [])
            return self.call(name, args)
        if kind is SEQ:
            return self.call(name, [self.seq("[", [sub(i, c) for i, c in enumerate(el.elements)], "]")])
        if kind is REPEAT:
            args = [self.value(el.n), sub(0, el.body)]
            if el.counter is not None:
                args.append(f"counter={self.value(el.counter)}")
            return self.call(name, args)
        if kind is BUFFER:
            args = [self.value(el.n), sub(0, el.body)]
            if el.store_to is not None:
                args.append(f"store_to={self.value(el.store_to)}")
            return self.call(name, args)
        if kind is LOOP:
            return self.call(name, [sub(0, el.body)])
        if kind is WHILE:
            return self.call(name, [sub(0, el.cond), sub(1, el.body)])
        if kind is SWITCH:
            head = 1 if isinstance(el.selector, CALL) else 0
            selector = sub(0, el.selector) if head else self.value(el.selector)
            cases = [f"{self.value(k)}: {sub(head + i, c)}" for i, (k, c) in enumerate(el.cases.items())]
            args = [selector, self.seq("{", cases, "}")]
            if el.default is not None:
                args.append(f"default={sub(len(el.children) - 1, el.default)}")
            return self.call(name, args)
        if kind is WEAVE:
            args = [repr(el.n_required), self.seq("[", [sub(i, c) for i, c in enumerate(el.elements)], "]")]
            if el.weights is not None:
                args.append(f"weights={self.value(list(el.weights))}")
            return self.call(name, args)
        raise self.error(f"no source form for {el.kind}")  # pragma: no cover


def _what(obj: Any) -> str:
    from ..program.printer import fn_name

    if callable(obj):
        return f"{fn_name(obj)} ({type(obj).__name__})"
    return f"a {type(obj).__name__} value {obj!r:.40}"


def to_source(program: Element, *, names: dict[str, Any] | None = None,
              registers: bool | Iterable[str] = True, reg_name: str = "reg") -> str:
    """Python source whose execution binds ``program`` to a program equal to this one.

    ``names`` maps free names of the source to objects that cannot be written
    as source or imported.  Raises ``SourceError`` naming the element that
    holds something else.
    """
    if names is not None and not isinstance(names, dict):
        raise TypeError(f"to_source: names must be a dict of name -> object, got {type(names).__name__}")
    names = dict(names or {})
    for k in names:
        if not k.isidentifier():
            raise ValueError(f"to_source: names keys must be identifiers, got {k!r}")
    w = _Writer(program, names, reg_name)
    # elements found at more than one place are written once, as variables
    counts: dict[int, int] = {}
    objects: dict[int, Element] = {}
    for _, el in walk(program):
        counts[id(el)] = counts.get(id(el), 0) + 1
        if id(el) not in objects:
            objects[id(el)] = el
    # each written after the shared elements inside it: in the order a post-order walk finishes them
    finished: list[int] = []
    seen: set[int] = set()

    def post(el: Element) -> None:
        if id(el) in seen:
            return
        seen.add(id(el))
        for c in el.children:
            post(c)
        finished.append(id(el))

    post(program)
    shared = [i for i in finished if counts[i] > 1 and objects[i] is not program]
    body = []
    paths = {id(el): p for p, el in reversed(list(walk(program)))}
    for k, i in enumerate(shared, 1):
        text = w.element(objects[i], paths[i])
        var = f"shared_{k}"
        w.taken.add(var)
        w.shared_vars[i] = var
        body.append(f"{var} = {text}")
    body.append(f"program = {w.element(program, ())}")
    table = program.__dict__.get("_overrides")
    if table:
        w.path = ()
        body.append(f"program.dependency_overrides.update({w.overrides(table)})")
    file = w.file if w.file is not None else None
    values = {}
    if file is not None and registers is not False:
        wanted = list(file) if registers is True else list(registers)
        for name in wanted:
            if name in file:
                try:
                    values[name] = w.value(file[name])
                except SourceError:
                    raise SourceError(f"register {name!r} holds {_what(file[name])}, which has no source form; "
                                      "pass registers=False or a list of register names to leave it out") from None
    public = set(w.flowvm)
    for (module, attr), local in list(w.imports.items()):
        if module == "flowvm" and attr and local == attr:  # POPEN, SPAWN, FUSED, ...: one import line
            public.add(attr)
            del w.imports[(module, attr)]
    head = [f"from flowvm import {', '.join(sorted(public - {'Scope', 'Depends'}))}"]
    if "Depends" in w.flowvm:
        head.append("from flowvm.machine.depends import Depends")
    if "Scope" in w.flowvm:
        head.append("from flowvm.editing.namespaces import Scope")
    text = "\n".join(body)
    for module in ("functools", "numpy", "torch"):
        if f"{module}." in text or any(f"{module}." in v for v in values.values()):
            head.insert(0, f"import {module}")
    from_imports: dict[str, list[str]] = {}
    for (module, attr), local in sorted(w.imports.items()):
        if attr:
            from_imports.setdefault(module, []).append(attr + (f" as {local}" if local != attr else ""))
        else:
            head.append(f"import {module}" + (f" as {local}" if local != module else ""))
    head += [f"from {module} import {', '.join(items)}" for module, items in from_imports.items()]
    regs = f"{reg_name} = Registers({w.seq('{', [f'{k!r}: {v}' for k, v in values.items()], '}')})" \
        if values else f"{reg_name} = Registers()"
    return "\n".join(head) + "\n\n" + regs + "\n" + text


def from_source(text: str, names: dict[str, Any] | None = None) -> Element:
    """Run source written by to_source (with the same names) and return its program.

    The source runs as Python code: only pass text you trust.
    """
    if not isinstance(text, str):
        raise TypeError(f"from_source: text must be the str to_source wrote, got {type(text).__name__}")
    if names is not None and not isinstance(names, dict):
        raise TypeError(f"from_source: names must be a dict of name -> object, got {type(names).__name__}")
    namespace: dict[str, Any] = dict(names or {})
    exec(compile(text, "<flowvm source>", "exec"), namespace)
    program = namespace.get("program")
    if not isinstance(program, Element):
        raise SourceError("the source did not bind 'program' to a flowvm element")
    return program
