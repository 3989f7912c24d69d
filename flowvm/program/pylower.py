"""A Python function's body lowered to elements (``flowvm.program``, pyfunc.py): each simple statement one CALL
of a function generated from that statement alone, ``if`` a SWITCH, ``while`` and ``for`` a WHILE; locals are
registers.

``break``, ``continue`` and ``return`` set one hidden register, ``__jump`` (BREAK, CONTINUE, RETURN; 0 when
running on): a statement that may set it ends its block early through a SWITCH guarding the statements after
it, a loop's condition ends the loop when it is set, the loop clears BREAK after it and CONTINUE at the end of
each iteration; RETURN stays set to the end (its value in ``__rv``).  ``for x in E`` keeps ``iter(E)`` in a
register (an iterator that pickles: a list's, a range's, a ``Batches``'s keeps its place) and takes the next
value in its condition.

What cannot run resumably is refused here, naming the line (``ProgramSyntaxError``): ``try``, ``yield``,
``await``, ``global``, ``nonlocal``, a ``with`` other than the listed context managers around statements
that loop, ``for``/``while`` with an ``else``, a nested function or lambda that reads a local assigned more
than once, ``async`` anything.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

from ..base.errors import FlowError
from ..pickled import stable

BREAK, CONTINUE, RETURN = 1, 2, 3
JUMP, VALUE = "__jump", "__rv"

# context managers a `with` may hold around statements that loop: each statement inside runs in its own
# `with` (they hold no state across statements)
PER_STATEMENT_CONTEXTS = {"no_grad", "enable_grad", "inference_mode", "autocast", "set_grad_enabled"}


@stable("flowvm")
class ProgramSyntaxError(FlowError, SyntaxError):
    """A function given to ``@flowvm.program`` holds what cannot run as a resumable program; the message
    names the line."""


class _Unbound:
    """The value of a local before its first assignment (reading it raises UnboundLocalError)."""

    def __repr__(self) -> str:
        return "<unbound>"

    def __reduce__(self):
        return (unbound, ())

    def __flowvm_value_source__(self) -> tuple:  # to_source writes it flowvm.pickled.unbound()
        return unbound, ()


UNBOUND = _Unbound()


@stable("flowvm.pickled")
def unbound() -> _Unbound:
    """UNBOUND, as a saved run names it (flowvm.pickled.unbound)."""
    return UNBOUND


@dataclass
class Piece:
    """One generated function: its name, the statement(s) it runs, the locals it reads (its parameters) and
    writes (its return value), and what it is for ("stmt", "cond", "iter", "next")."""

    name: str
    body: list[ast.stmt]
    reads: list[str]
    writes: list[str]
    role: str
    line: int
    text: str = ""


@dataclass
class Plan:
    """The lowered function: the tree of element specs (nested tuples, built into elements by pyfunc.py),
    the generated module's AST, the locals (registers) and the function's parameters."""

    tree: Any
    module: ast.Module
    pieces: dict[str, Piece]
    local_names: list[str]
    params: list[str]
    hidden: list[str] = field(default_factory=list)


def refuse(node: ast.AST, what: str, filename: str) -> ProgramSyntaxError:
    """The refusal of node's construct: ``str()`` names the file and line (as Python's SyntaxError does)."""
    line = getattr(node, "lineno", 0)
    return ProgramSyntaxError(what, (filename, line, getattr(node, "col_offset", 0) + 1, None))


# -------------------------------------------------------------------------------------------- analysis
def assigned_names(nodes) -> list[str]:
    """The names the statements bind in the function's own scope (not inside nested functions)."""
    found: list[str] = []

    def add(name):
        if name not in found:
            found.append(name)

    for node in nodes:
        for sub in _own_scope(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                add(sub.id)
            elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                add(sub.name)
            elif isinstance(sub, ast.alias):
                add((sub.asname or sub.name).split(".")[0])
            elif isinstance(sub, ast.NamedExpr):
                add(sub.target.id)
    return found


def _own_scope(node):
    """The node and its descendants, but not the bodies of nested functions, lambdas and comprehensions."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield child
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                yield from (d for dec in child.decorator_list for d in _own_scope(dec))
            continue
        if isinstance(child, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            yield from _own_scope(child.generators[0].iter)
            continue
        yield from _own_scope(child)


def read_names(nodes, local_names: set[str]) -> list[str]:
    """The locals the nodes read, nested functions' and comprehensions' reads included, in order."""
    found: list[str] = []
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id in local_names and sub.id not in found:
                if isinstance(sub.ctx, ast.Load) or isinstance(sub.ctx, ast.Del):
                    found.append(sub.id)
            elif isinstance(sub, ast.AugAssign) and isinstance(sub.target, ast.Name) \
                    and sub.target.id in local_names and sub.target.id not in found:
                found.append(sub.target.id)
    return found


def _has(nodes, kinds) -> bool:
    return any(isinstance(sub, kinds) for node in nodes for sub in ast.walk(node))


def jumps(nodes, loop_level: bool = True) -> bool:
    """Whether the statements may break, continue (out of their own block: not inside a loop of theirs)
    or return."""
    for node in nodes:
        if isinstance(node, ast.Return):
            return True
        if isinstance(node, (ast.Break, ast.Continue)) and loop_level:
            return True
        if isinstance(node, (ast.For, ast.While)):
            if jumps(node.body, loop_level=False):
                return True
        elif isinstance(node, ast.If):
            if jumps(node.body, loop_level) or jumps(node.orelse, loop_level):
                return True
        elif isinstance(node, ast.With):
            if jumps(node.body, loop_level):
                return True
    return False


def loops(nodes) -> bool:
    """Whether the statements hold a loop or a jump (so cannot run as one leaf)."""
    return _has(nodes, (ast.For, ast.While, ast.Break, ast.Continue, ast.Return, ast.AsyncFor))


def context_name(expr: ast.expr) -> str | None:
    """The called name of a `with` item's context expression (``torch.no_grad()`` -> "no_grad")."""
    if isinstance(expr, ast.Call):
        func = expr.func
        return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return None


# -------------------------------------------------------------------------------------------- checks
class Checker:
    """Refuses what cannot run resumably (see the module's docstring), naming the line."""

    def __init__(self, filename: str, local_names: set[str], reassigned: set[str]):
        self.filename, self.local_names, self.reassigned = filename, local_names, reassigned

    def check(self, fn: ast.FunctionDef) -> None:
        for node in ast.walk(fn):
            if node is fn:
                continue
            self._node(node)

    def _node(self, node: ast.AST) -> None:
        for check in (self._frame_bound, self._compound, self._closure, self._own_name):
            check(node)

    def _frame_bound(self, node: ast.AST) -> None:
        what = {ast.Yield: "yield", ast.YieldFrom: "yield from", ast.Await: "await", ast.Global: "global",
                ast.Nonlocal: "nonlocal", ast.AsyncFor: "async for", ast.AsyncWith: "async with",
                ast.AsyncFunctionDef: "an async function"}.get(type(node))
        if what is not None:
            raise refuse(node, f"{what} cannot run as a resumable program (its state lives in a Python frame)",
                         self.filename)

    def _compound(self, node: ast.AST) -> None:
        if isinstance(node, (ast.Try, ast.TryStar)) and loops(node.body + node.orelse + node.finalbody
                                                              + [h for h in node.handlers]):
            raise refuse(node, "try around statements that loop or jump cannot run as a resumable program "
                               "(put the try inside a function the program calls)", self.filename)
        if isinstance(node, (ast.For, ast.While)) and node.orelse:
            raise refuse(node, f"{'for' if isinstance(node, ast.For) else 'while'} ... else is not supported "
                               "(set a flag before break instead)", self.filename)
        if isinstance(node, ast.With) and loops(node.body) and any(
                context_name(item.context_expr) not in PER_STATEMENT_CONTEXTS or item.optional_vars
                for item in node.items):
            raise refuse(node, "with around statements that loop or jump: only "
                               f"{', '.join(sorted(PER_STATEMENT_CONTEXTS))} (torch's, without 'as') "
                               "can hold them", self.filename)

    def _closure(self, node: ast.AST) -> None:
        if not isinstance(node, (ast.FunctionDef, ast.Lambda, ast.ClassDef)):
            return
        changing = sorted(set(read_names([node], self.local_names)) & self.reassigned)
        if changing:
            kind = "a lambda" if isinstance(node, ast.Lambda) else f"{node.name}"
            raise refuse(node, f"{kind} reads the local{'s' if len(changing) > 1 else ''} "
                               f"{', '.join(changing)}, assigned more than once: a copy of the run could not "
                               "keep what it sees (pass it as an argument instead)", self.filename)

    def _own_name(self, node: ast.AST) -> None:
        if isinstance(node, ast.Name) and (node.id in (JUMP, VALUE) or node.id.startswith(("__it", "__nx"))):
            raise refuse(node, f"the name {node.id} is flowvm's own", self.filename)


def reassigned_names(fn: ast.FunctionDef, params: list[str]) -> set[str]:
    """Locals bound in more than one place, or inside a loop, or parameters bound again."""
    counts: dict[str, int] = {p: 1 for p in params}

    def visit(nodes, in_loop):
        for node in nodes:
            for name in assigned_names([node]) if not isinstance(node, (ast.For, ast.While, ast.If, ast.With)) \
                    else []:
                counts[name] = counts.get(name, 0) + (2 if in_loop else 1)
            if isinstance(node, ast.For):
                for name in assigned_names([ast.Assign(targets=[node.target], value=ast.Constant(0))]):
                    counts[name] = counts.get(name, 0) + 2
                visit(node.body, True)
            elif isinstance(node, ast.While):
                visit(node.body, True)
            elif isinstance(node, ast.If):
                visit(node.body, in_loop)
                visit(node.orelse, in_loop)
            elif isinstance(node, ast.With):
                for item in node.items:
                    if item.optional_vars is not None:
                        for name in assigned_names([ast.Assign(targets=[item.optional_vars],
                                                               value=ast.Constant(0))]):
                            counts[name] = counts.get(name, 0) + (2 if in_loop else 1)
                visit(node.body, in_loop)

    visit(fn.body, False)
    return {name for name, n in counts.items() if n > 1}


__all__ = ["ProgramSyntaxError", "UNBOUND", "BREAK", "CONTINUE", "RETURN", "JUMP", "VALUE", "Piece", "Plan",
           "Checker", "assigned_names", "read_names", "jumps", "loops", "context_name", "reassigned_names",
           "refuse", "PER_STATEMENT_CONTEXTS"]
