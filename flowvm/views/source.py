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
from ..program.kinds import KindTable
from ..base.errors import SourceError
from ..program.paths import format_path, walk
from ..program.registers import Registers
from .literals import describe_value, import_of, write_value

WIDTH = 100
_FLOWVM_NAMES = {SEQ: "SEQ", REPEAT: "REPEAT", LOOP: "LOOP", WHILE: "WHILE", SWITCH: "SWITCH", WEAVE: "WEAVE",
                 BUFFER: "BUFFER", CALL: "CALL", PRINT: "PRINT"}


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
        hook = getattr(type(obj), "__flowvm_value_source__", None)
        if hook is not None:  # (function, args): written as function(*args) (a @flowvm.program's statement)
            fn, args = hook(obj)
            return self.call(self.ref(fn), [self.value(a) for a in args])
        found = import_of(obj)
        if found is None:
            owner = getattr(obj, "__self__", None)
            if owner is not None and id(owner) in self.by_id and isinstance(getattr(obj, "__name__", None), str):
                return f"{self.by_id[id(owner)]}.{obj.__name__}"
            raise self.error(f"{describe_value(obj)} cannot be imported; pass names={{'name': obj}} to to_source "
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
        """Source for a value: a constant as a literal, a register as ``reg('name')``, an element as an
        element, an importable object by name (flowvm.views.literals)."""
        if id(v) in self.by_id:
            return self.by_id[id(v)]
        return write_value(self, v)

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
        hook = getattr(el, "__flowvm_source__", None)
        if hook is not None:
            # arguments are written as values, where an element (a SPAWN's fragment, the elements in a
            # list argument) is written as an element, shared ones by their variable
            ctor, args, kwargs = hook()
            for i, c in enumerate(el.children):
                self.child_paths.setdefault(id(c), path + (i,))
            texts = [self.value(a) for a in args] + [f"{k}={self.value(v)}" for k, v in kwargs.items()]
            return self.call(self.ref(ctor), texts)
        return SOURCE.of(el)(self, el, lambda i, c: self.element(c, path + (i,)))

    def kind_name(self, el: Element) -> str:
        """The name that constructs el's kind: flowvm's own from ``from flowvm import ...``, any other imported."""
        name = _FLOWVM_NAMES.get(type(el))
        if name is None:
            return self.ref(type(el))
        self.flowvm.add(name)
        return name


def _call_source(w: _Writer, el: CALL, sub) -> str:
    w.flowvm.add("CALL")  # a CALL of any kind (one with Depends arguments, say) is built by CALL(...)
    args = [w.ref(el.fn)] + [w.value(a) for a in el.args]
    if el.store_to is not None:
        args.append(f"store_to={w.value(el.store_to)}")
    odd = {}
    for k, v in el.kwargs.items():
        if k.isidentifier() and not keyword.iskeyword(k):
            args.append(f"{k}={w.value(v)}")
        else:
            odd[k] = v
    if odd:
        args.append("**" + w.value(odd))
    return w.call("CALL", args)


def _print_source(w: _Writer, el: PRINT, sub) -> str:
    args = [w.value(o) for o in el.objs] + ([f"sep={el.sep!r}"] if el.sep != " " else [])
    return w.call(w.kind_name(el), args)


def _counted_source(w: _Writer, el: REPEAT | BUFFER, sub, extra: str) -> str:
    args = [w.value(el.n), sub(0, el.body)]
    if getattr(el, extra) is not None:
        args.append(f"{extra}={w.value(getattr(el, extra))}")
    return w.call(w.kind_name(el), args)


def _switch_source(w: _Writer, el: SWITCH, sub) -> str:
    head = 1 if isinstance(el.selector, CALL) else 0
    selector = sub(0, el.selector) if head else w.value(el.selector)
    cases = [f"{w.value(k)}: {sub(head + i, c)}" for i, (k, c) in enumerate(el.cases.items())]
    args = [selector, w.seq("{", cases, "}")]
    if el.default is not None:
        args.append(f"default={sub(len(el.children) - 1, el.default)}")
    return w.call(w.kind_name(el), args)


def _weave_source(w: _Writer, el: WEAVE, sub) -> str:
    args = [repr(el.n_required), w.seq("[", [sub(i, c) for i, c in enumerate(el.elements)], "]")]
    if el.weights is not None:
        args.append(f"weights={w.value(list(el.weights))}")
    return w.call(w.kind_name(el), args)


def _no_source(w: _Writer, el: Element, sub) -> str:
    raise w.error(f"no source form for {el.kind} elements (define __flowvm_source__ on {type(el).__name__}, "
                  "or register its SOURCE entry)")


SOURCE = KindTable("source", _no_source, {
    CALL: _call_source, PRINT: _print_source,
    SEQ: lambda w, el, sub: w.call(w.kind_name(el), [w.seq("[", [sub(i, c) for i, c in enumerate(el.elements)], "]")]),
    REPEAT: lambda w, el, sub: _counted_source(w, el, sub, "counter"),
    BUFFER: lambda w, el, sub: _counted_source(w, el, sub, "store_to"),
    LOOP: lambda w, el, sub: w.call(w.kind_name(el), [sub(0, el.body)]),
    WHILE: lambda w, el, sub: w.call(w.kind_name(el), [sub(0, el.cond), sub(1, el.body)]),
    SWITCH: _switch_source, WEAVE: _weave_source,
})
"""The source that builds an element, by kind: ``fn(writer, el, sub)``, where ``sub(i, child)`` is the source
of child i and ``writer.value(v)``, ``writer.call(name, args)``, ``writer.kind_name(el)`` write the rest.  A kind
with ``__flowvm_source__()`` is written from it instead; the default is an error naming the kind."""


def to_source(program: Element, *, names: dict[str, Any] | None = None,
              registers: bool | Iterable[str] = True, reg_name: str = "reg") -> str:
    """Python source whose execution binds ``program`` to a program equal to this one.

    ``names`` maps free names of the source to objects that cannot be written
    as source or imported.  Raises ``SourceError`` naming the element that
    holds something else.
    """
    names = _checked_names(names)
    w = _Writer(program, names, reg_name)
    body = []
    paths = {id(el): p for p, el in reversed(list(walk(program)))}
    for k, el in enumerate(_shared_elements(program), 1):  # written once, as variables
        text = w.element(el, paths[id(el)])
        var = f"shared_{k}"
        w.taken.add(var)
        w.shared_vars[id(el)] = var
        body.append(f"{var} = {text}")
    body.append(f"program = {w.element(program, ())}")
    table = program.__dict__.get("_overrides")
    if table:
        w.path = ()
        body.append(f"program.dependency_overrides.update({w.overrides(table)})")
    values = _register_values(w, registers)
    text = "\n".join(body)
    regs = f"{reg_name} = Registers({w.seq('{', [f'{k!r}: {v}' for k, v in values.items()], '}')})" \
        if values else f"{reg_name} = Registers()"
    return "\n".join(_imports(w, text, values)) + "\n\n" + regs + "\n" + text


def _checked_names(names: Any) -> dict[str, Any]:
    if names is not None and not isinstance(names, dict):
        raise TypeError(f"to_source: names must be a dict of name -> object, got {type(names).__name__}")
    names = dict(names or {})
    for k in names:
        if not k.isidentifier():
            raise ValueError(f"to_source: names keys must be identifiers, got {k!r}")
    return names


def _shared_elements(program: Element) -> list[Element]:
    """The elements found at more than one place (but the root), each after the shared elements inside it:
    in the order a post-order walk finishes them."""
    counts: dict[int, int] = {}
    for _, el in walk(program):
        counts[id(el)] = counts.get(id(el), 0) + 1
    finished: list[Element] = []
    seen: set[int] = set()

    def post(el: Element) -> None:
        if id(el) in seen:
            return
        seen.add(id(el))
        for c in el.children:
            post(c)
        finished.append(el)

    post(program)
    return [el for el in finished if counts[id(el)] > 1 and el is not program]


def _register_values(w: _Writer, registers: bool | Iterable[str]) -> dict[str, str]:
    """The source of the values of the registers wanted (all, none, or those named)."""
    file = w.file
    if file is None or registers is False:
        return {}
    values = {}
    for name in (list(file) if registers is True else list(registers)):
        if name in file:
            try:
                values[name] = w.value(file[name])
            except SourceError:
                raise SourceError(f"register {name!r} holds {describe_value(file[name])}, which has no source "
                                  "form; pass registers=False or a list of register names to leave it out") from None
    return values


def _imports(w: _Writer, text: str, values: dict[str, str]) -> list[str]:
    """The import lines of the source: flowvm's names, the modules the text uses, the objects it names."""
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
    for module in ("functools", "numpy", "torch"):
        if f"{module}." in text or any(f"{module}." in v for v in values.values()):
            head.insert(0, f"import {module}")
    return head + _object_imports(w.imports)


def _object_imports(imports: dict) -> list[str]:
    """``import module [as local]`` for each module named, then ``from module import a, b as c`` per module."""
    lines, from_imports = [], {}
    for (module, attr), local in sorted(imports.items()):
        if attr:
            from_imports.setdefault(module, []).append(attr + (f" as {local}" if local != attr else ""))
        else:
            lines.append(f"import {module}" + (f" as {local}" if local != module else ""))
    return lines + [f"from {module} import {', '.join(items)}" for module, items in from_imports.items()]


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
