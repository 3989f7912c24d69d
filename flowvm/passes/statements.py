"""Which statements of a ``@flowvm.program`` function fuse-torch fuses: its *tensor statements*.

Each statement of such a program is a CALL of a function generated from it (flowvm/program/pyfunc.py), so
fuse-torch cannot ask the function, as it asks a CALL's; it reads the statement instead.  A statement is a
tensor statement when it is one assignment to one local (``=``, an augmented or annotated assignment) or one
expression, with no lambda, comprehension, f-string, ``and``/``or`` or conditional expression in it, and

- every call in it is a torch call: a function reached through the module's globals that fuse-torch fuses as a
  CALL (``torch.relu``, ``F.cross_entropy``, a module held in a global, a ``@flowvm.fusable`` function), a
  method that ``torch.Tensor`` has and no builtin type does (``x.view(...)``, ``logits.size(-1)``; never
  ``item``, ``tolist``, ``numpy``), or a call of a local that holds a torch module;
- and it makes at least one such call, or computes with operators on locals that hold tensors (``x = x + y``).

A local holds a module (a tensor) when its value does now, or, while it is unbound, when every assignment of it
makes one: ``model = GPT(...)`` (a call of an ``nn.Module`` class), ``h = torch.relu(x @ w)``.  A local bound
by a ``for``, by unpacking or by ``with ... as`` is neither.  ``loss.backward()`` is a backward pass
(``Statement.__flowvm_backward__``): it joins a run of tensor statements before it, as ``Tensor.backward``
joins a run of torch CALLs.

This only chooses what to fuse: a fused step's eager form runs the very statement functions in order, and its
compiled form is checked as any fused step's (docs/optimizer.md).
"""

from __future__ import annotations

import ast
import builtins
import functools
import sys
from dataclasses import dataclass, field
from typing import Any

from ..fused.codegen import is_barrier
from ..fused.element import NEVER_TENSOR, is_fusable
from ..program.pyfunc import Statement
from ..program.pylower import PER_STATEMENT_CONTEXTS, UNBOUND, context_name
from ..program.pyplan import parse
from ..program.registers import Register, iter_registers
from .rewrite import is_call

TORCH, BACKWARD, OTHER = "torch", "backward", "other"
# methods of builtin values: ``s.add(1)`` may be a set's, so a method by one of these names is not a torch call
_BUILTIN_METHODS = frozenset(n for t in (list, dict, set, frozenset, str, bytes, tuple, int, float, complex, bool)
                             for n in dir(t))
_NOT_TENSOR_RESULT = {"size", "dim", "numel", "nelement", "ndimension", "stride", "element_size", "is_contiguous",
                      "get_device", "is_floating_point", "is_complex", "equal"}
_TENSOR_ATTRIBUTES = {"T", "mT", "H", "mH", "grad", "data", "real", "imag"}
_UNSUPPORTED = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.JoinedStr, ast.NamedExpr,
                ast.BoolOp, ast.IfExp)
_WHY_UNSUPPORTED = {ast.Lambda: "a lambda", ast.ListComp: "a comprehension", ast.SetComp: "a comprehension",
                    ast.DictComp: "a comprehension", ast.GeneratorExp: "a generator expression",
                    ast.JoinedStr: "an f-string", ast.NamedExpr: "an assignment expression",
                    ast.BoolOp: "and/or (a branch)", ast.IfExp: "a conditional expression (a branch)"}


def fusion_kind(child: Any, memo: dict | None = None) -> str:
    """TORCH (fuse-torch puts it in a run), BACKWARD (it ends a run, inside it) or OTHER, for a child of a SEQ.
    memo (a dict kept for one pass over a program) keeps what was learnt of each function's locals."""
    if not is_call(child):
        return OTHER
    if isinstance(child.fn, Statement):
        return statement_kind(child, memo)[0]
    if is_fusable(child.fn) and not isinstance(child.store_to, tuple):
        return TORCH
    return BACKWARD if is_barrier(child.fn) else OTHER


def statement_kind(call: Any, memo: dict | None = None) -> tuple[str, str]:
    """(TORCH, BACKWARD or OTHER, why) for a CALL of a statement's function (``Statement``); why says, for
    OTHER, what keeps it from fusing."""
    stmt = call.fn
    piece = stmt.source.plan.pieces[stmt.name]
    if piece.role != "stmt":
        return OTHER, f"a {_ROLES.get(piece.role, piece.role)}, not a statement that computes"
    if getattr(stmt, "__flowvm_backward__", False):
        return BACKWARD, "a backward pass"
    node, why = _single(piece)
    if node is None:
        return OTHER, why
    if isinstance(call.store_to, tuple):
        return OTHER, "it binds several locals (unpacking): it runs as a step of its own"
    types_ = _types(stmt.source, _file(call), memo)
    return types_.judge(node)


_ROLES = {"cond": "condition", "guard": "guard after a jump", "iter": "loop's start", "next": "loop's step",
          "bind": "loop variable's binding", "jump": "jump (break, continue)", "reset": "loop's jump reset",
          "return": "return", "result": "function's result"}


def _single(piece) -> tuple[ast.stmt | None, str]:
    """The one simple statement a piece runs (inside per-statement ``with`` blocks), or None and why not."""
    body = [s for s in piece.body if not isinstance(s, ast.Return) or s is piece.body[0]]
    if len(body) != 1:
        return None, "not one assignment or expression"
    node = body[0]
    while isinstance(node, ast.With) and len(node.body) == 1 and all(
            not i.optional_vars and context_name(i.context_expr) in PER_STATEMENT_CONTEXTS for i in node.items):
        node = node.body[0]  # torch.no_grad() and the like (pylower.py): dynamo traces them
    why = _shape(node)
    if why:
        return None, why
    for sub in ast.walk(node):
        if isinstance(sub, _UNSUPPORTED):
            return None, f"it holds {_WHY_UNSUPPORTED[type(sub)]}"
    return node, ""


def _shape(node: ast.stmt) -> str:
    """Why node is no assignment of one local nor one expression that calls ("" when it is one)."""
    if isinstance(node, ast.Assign):
        one = len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        return "" if one else "an assignment to something other than one local (unpacking, an item, an attribute)"
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)) and not isinstance(node.target, ast.Name):
        return "an assignment to an item or an attribute (a write into a value)"
    if isinstance(node, ast.AnnAssign) and node.value is None:
        return "an annotation without a value"
    if isinstance(node, ast.Expr):
        return "" if isinstance(node.value, ast.Call) else "an expression that calls nothing"
    if not isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return f"a {type(node).__name__} statement, not an assignment or expression"
    return ""


def _file(call: Any):
    for r in [*iter_registers(call.args), *iter_registers(call.kwargs), *iter_registers(call.store_to)]:
        if isinstance(r, Register):
            return r.file
    return None


# ---------------------------------------------------------------------------------------- the locals' types
@functools.lru_cache(maxsize=64)
def _stores(source: str, filename: str, firstlineno: int) -> dict[str, list]:
    """For each local the function binds: the values assigned to it (an expression; None for a binding that is
    no plain assignment: a for, an unpacking, with ... as, an import, a def)."""
    fn = parse(source, filename, firstlineno)
    out: dict[str, list] = {}
    plain: set[int] = set()
    for node in _own_nodes(fn.body):
        for target, name, value in _bindings(node):
            out.setdefault(name, []).append(value)
            if target is not None:
                plain.add(id(target))
    for node in _own_nodes(fn.body):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and id(node) not in plain:
            out.setdefault(node.id, []).append(None)
    return out


def _bindings(node: ast.AST) -> list[tuple[ast.Name | None, str, ast.expr | None]]:
    """(target, name, value) for each name node binds by a plain assignment (value: what it assigns, the
    augmented one spelt out) or by a def, class or import (target and value None)."""
    if isinstance(node, ast.Assign):
        return [(t, t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
        name = node.target.id
        return [(node.target, name, ast.BinOp(ast.Name(name, ast.Load()), node.op, node.value))]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
        return [(node.target, node.target.id, node.value)]
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return [(None, node.name, None)]
    if isinstance(node, ast.alias):
        return [(None, (node.asname or node.name).split(".")[0], None)]
    return []


def _own_nodes(nodes):
    """The nodes and their descendants, not inside nested functions, lambdas, classes or comprehensions."""
    for node in nodes:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp,
                             ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        yield from _own_nodes(ast.iter_child_nodes(node))


def _types(source: Any, file: Any, memo: dict | None) -> "Types":
    key = (id(source), id(file))
    if memo is not None and key in memo:
        return memo[key]
    made = Types.of(source, file)
    if memo is not None:
        memo[key] = made
    return made


@dataclass
class Types:
    """Which locals hold modules and which tensors (see the module's docstring), and how names resolve."""

    locals: set[str]
    globals: dict
    modules: set[str] = field(default_factory=set)
    tensors: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, source: Any, file: Any) -> "Types":
        torch = sys.modules["torch"]
        plan = source.plan
        names = set(plan.local_names)
        try:
            globals_ = source.functions()[next(iter(plan.pieces))].__globals__
        except Exception:  # noqa: BLE001 - a module that no longer imports: nothing resolves, nothing fuses
            globals_ = {}
        stores = _stores(source.source, source.filename, source.firstlineno)
        values = {n: file[n] for n in names if file is not None and n in file}
        made = cls(names, globals_)

        def candidates(kind):
            out = set()
            for n in names:
                value = values.get(n, UNBOUND)
                if value is UNBOUND and n in stores or isinstance(value, kind):
                    out.add(n)
            return out

        made.modules = candidates(torch.nn.Module)
        made.tensors = candidates(torch.Tensor)
        for kind, test in (("modules", made._makes_module), ("tensors", made.tensor_valued)):
            settled = getattr(made, kind)
            changed = True
            while changed:  # the largest set consistent with every assignment
                changed = False
                for n in sorted(settled):
                    if values.get(n, UNBOUND) is UNBOUND and not all(v is not None and test(v)
                                                                     for v in stores.get(n, [None])):
                        settled.discard(n)
                        changed = True
        return made

    # -- names
    def resolve(self, node: ast.expr) -> tuple[bool, Any]:
        """(found, value) of a dotted name rooted at a global or builtin."""
        chain = _chain(node)
        if chain is None or chain[0] in self.locals:
            return False, None
        root = self.globals.get(chain[0], getattr(builtins, chain[0], UNBOUND))
        if root is UNBOUND:
            return False, None
        try:
            value = functools.reduce(getattr, chain[1:], root)
        except Exception:  # noqa: BLE001 - an attribute that does not exist (yet): not a torch call
            return False, None
        return True, value

    def _makes_module(self, value: ast.expr) -> bool:
        torch = sys.modules["torch"]
        if isinstance(value, ast.Name):
            return value.id in self.modules
        if isinstance(value, ast.Call):
            found, made = self.resolve(value.func)
            return found and isinstance(made, type) and issubclass(made, torch.nn.Module)
        return False

    # -- calls
    def call_kind(self, call: ast.Call) -> tuple[bool, str]:
        """(whether the call is a torch call, its description)."""
        func = call.func
        chain = _chain(func)
        if chain is not None and chain[0] in self.locals:
            if len(chain) == 1:
                return func.id in self.modules, func.id
        elif chain is not None:
            found, value = self.resolve(func)
            return found and is_fusable(value), ".".join(chain)
        if isinstance(func, ast.Attribute):
            torch = sys.modules["torch"]
            tensor_method = (callable(getattr(torch.Tensor, func.attr, None)) and func.attr not in NEVER_TENSOR
                             and func.attr not in _BUILTIN_METHODS)
            return tensor_method, f"{_short(func.value)}.{func.attr}"
        return False, _short(func)

    def tensor_valued(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.tensors
        if isinstance(node, ast.Call):
            torch_call, _ = self.call_kind(node)
            return torch_call and not (isinstance(node.func, ast.Attribute) and node.func.attr in _NOT_TENSOR_RESULT)
        if isinstance(node, ast.BinOp):
            return self.tensor_valued(node.left) or self.tensor_valued(node.right)
        if isinstance(node, ast.UnaryOp):
            return self.tensor_valued(node.operand)
        if isinstance(node, ast.Compare):
            return any(self.tensor_valued(x) for x in [node.left, *node.comparators])
        if isinstance(node, ast.Subscript):
            return self.tensor_valued(node.value)
        if isinstance(node, ast.Attribute):
            return node.attr in _TENSOR_ATTRIBUTES and self.tensor_valued(node.value)
        return False

    # -- a statement
    def judge(self, node: ast.stmt) -> tuple[str, str]:
        calls = [sub for sub in ast.walk(node) if isinstance(sub, ast.Call)]
        for call in calls:
            torch_call, name = self.call_kind(call)
            if not torch_call:
                return OTHER, _why_not_torch(name, call, self)
        if calls:
            return TORCH, "a tensor statement"
        value = node.value if not isinstance(node, ast.AugAssign) else ast.BinOp(node.target, node.op, node.value)
        if self.tensor_valued(value):
            return TORCH, "a tensor statement"
        return OTHER, "it calls no torch function and computes no tensor from locals that hold tensors"


def _why_not_torch(name: str, call: ast.Call, types_: Types) -> str:
    import types

    func = call.func
    if isinstance(func, ast.Name) and func.id in types_.locals:
        return (f"it calls the local {name}, which does not hold a torch module (as far as the program tells "
                "before it runs)")
    found, value = types_.resolve(func)
    if found and isinstance(getattr(value, "__func__", value), types.FunctionType) and not \
            (getattr(value, "__module__", None) or "").startswith(("torch", "flowvm")):
        return f"it calls {name}, a function of yours: mark it @flowvm.fusable if it only computes with torch"
    if found:
        return f"it calls {name}, which fuse-torch does not fuse (no torch function, module or Tensor method)"
    if isinstance(func, ast.Attribute):
        if func.attr in NEVER_TENSOR:
            return f"it calls {name}, which leaves torch's graph"
        if func.attr in _BUILTIN_METHODS:
            return f"it calls {name}: {func.attr} is a method of builtin values (a list's, a dict's, ...)"
        return f"it calls {name}: {func.attr} is no method of torch.Tensor"
    return f"it calls {name}, not a torch call"


def _chain(node: ast.expr) -> list[str] | None:
    """["torch", "nn", "functional", "relu"] for ``torch.nn.functional.relu``; None for other expressions."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


def _short(node: ast.expr) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 40 else text[:37] + "..."


__all__ = ["fusion_kind", "statement_kind", "TORCH", "BACKWARD", "OTHER"]
