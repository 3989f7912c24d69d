"""Where leaves are called: ``Driver._drive`` is the one call of a leaf on the general path (run(), arun()
and step() alike); the fast paths' loops (fastpaths.py) and step()'s repeated leaf call theirs inline, for
the speed docs/architecture.md measures.  Checked on the source with ast, in any call form (a leaf's
function read from ``._leaf`` or made by ``leaf_function``/``bind``, kept in locals and lists, passed to
another function of the module), and by running."""

from __future__ import annotations

import ast
from pathlib import Path

import flowvm
from flowvm import CALL, SEQ, WEAVE, LOOP, REPEAT, Registers
from flowvm.machine import driver as driver_module

ROOT = Path(flowvm.__file__).resolve().parent


def _makes_leaf(n: ast.AST) -> bool:
    """A leaf's function made: ``leaf_function(el, regs)`` (a simple leaf's) or ``el.bind(drv, frame)``."""
    if not isinstance(n, ast.Call):
        return False
    if isinstance(n.func, ast.Name):
        return n.func.id == "leaf_function"
    return isinstance(n.func, ast.Attribute) and n.func.attr == "bind" and len(n.args) == 2 and not n.keywords \
        and not any(isinstance(a, ast.Starred) for a in n.args)  # the leaf protocol's, not inspect's


def _mentions_leaf(node: ast.AST, held: set[str]) -> bool:
    """Whether an expression reads or makes a leaf's function: ``x._leaf``, ``leaf_function(...)``, or a local
    that holds one (or a list of them: ``leaves = [drv._leaf]``, ``leaves[pos]``)."""
    return any((isinstance(n, ast.Attribute) and n.attr == "_leaf" and isinstance(n.ctx, ast.Load))
               or (isinstance(n, ast.Name) and n.id in held and isinstance(n.ctx, ast.Load)) or _makes_leaf(n)
               for n in ast.walk(node))


def _called(func: ast.AST, held: set[str]) -> bool:
    """Whether a call's callee is a leaf's function, in any form: ``x._leaf()``, ``leaf()`` for a local
    assigned from one, ``leaves[pos]()``, ``(leaf or other)()``."""
    if isinstance(func, ast.Attribute) and func.attr == "_leaf":
        return True
    if isinstance(func, ast.Name):
        return func.id in held
    if isinstance(func, ast.Subscript):
        return _called(func.value, held)
    return isinstance(func, (ast.BoolOp, ast.IfExp)) and _mentions_leaf(func, held)


def _holders(fn: ast.AST, params: set[str] = frozenset()) -> set[str]:
    """The locals of a function that ever hold a leaf's function (assigned from an expression reading one,
    until nothing new is found: ``leaf = drv._leaf``, ``leaves = [leaf]``, ``f = leaves[0]``), starting from
    ``params``, its parameters that callers pass leaves in."""
    held: set[str] = set(params)
    while True:
        before = len(held)
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None else []
            if targets and _mentions_leaf(node.value, held):
                held |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        if len(held) == before:
            return held


def _passed(tree: ast.AST) -> dict[str, set[str]]:
    """For each function of the module (by name), the parameters its callers in the module pass leaves in
    (``_loop(drv, ..., leaves, ...)``), to a fixed point."""
    fns = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    seeds: dict[str, set[str]] = {name: set() for name in fns}
    changed = True
    while changed:
        changed = False
        for name, fn in fns.items():
            held = _holders(fn, seeds[name])
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
                callee = fns.get(call.func.id)
                if callee is None:
                    continue
                names = [a.arg for a in callee.args.posonlyargs + callee.args.args]
                new = {names[i] for i, arg in enumerate(call.args) if i < len(names) and _mentions_leaf(arg, held)}
                if not new <= seeds[call.func.id]:
                    seeds[call.func.id] |= new
                    changed = True
    return seeds


def leaf_calls(tree: ast.AST) -> list[str]:
    """The functions (by qualified name) that call a leaf's function, in any form (``_called``), their
    parameters holding what callers in the module pass them (``_passed``)."""
    found = []
    seeds = _passed(tree)

    def visit(node: ast.AST, where: list[str], held: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, where + [child.name], _holders(child, seeds.get(child.name, set())))
                continue
            if isinstance(child, ast.ClassDef):
                visit(child, where + [child.name], set())
                continue
            if isinstance(child, ast.Call) and _called(child.func, held):
                found.append(".".join(where))
            visit(child, where, held)

    visit(tree, [], set())
    return found


def test_the_scan_sees_a_leaf_called_in_any_form():
    code = ast.parse("""
def a(drv):
    drv._leaf()
def b(drv):
    leaf = drv._leaf
    leaf()
def c(drv):
    leaves, pos = [drv._leaf], 0
    leaves[pos]()
def d(drv, other):
    f = drv._leaf
    g = f
    (g or other)()
def e(drv):
    other()
    name = drv.name
    name()
def f(drv, el):
    loop(drv, [leaf_function(el, drv.registers)], 0)
def loop(drv, fns, pos):
    fns[pos]()
""")
    assert leaf_calls(code) == ["a", "b", "c", "d", "loop"]


# every place of flowvm/ that calls a leaf's function, and how many calls each holds
CALL_SITES = {"machine/driver.py:Driver._drive": 1, "machine/driver.py:Driver.step": 1,
              "machine/fastpaths.py:repeat_leaf": 3, "machine/fastpaths.py:_loop": 1,
              "machine/fastpaths.py:_one_weave_loop": 1}


def test_the_general_path_calls_a_leaf_in_one_place():
    calls = {}
    for path in sorted(ROOT.rglob("*.py")):
        for where in leaf_calls(ast.parse(path.read_text())):
            calls.setdefault(f"{path.relative_to(ROOT).as_posix()}:{where}", 0)
            calls[f"{path.relative_to(ROOT).as_posix()}:{where}"] += 1
    assert calls == CALL_SITES


def test_step_and_run_reach_the_leaf_through_drive(monkeypatch):
    seen = []
    drive = driver_module.Driver._drive

    def watching(self, *args):
        seen.append(self.steps)
        return drive(self, *args)

    monkeypatch.setattr(driver_module.Driver, "_drive", watching)
    reg = Registers(n=0)
    inc = CALL(lambda n: n + 1, reg("n"), store_to=reg("n"))
    drv = SEQ([inc, SEQ([inc]), WEAVE(1, [inc, LOOP(inc)])]).start()
    while drv.step() is flowvm.INCOMPLETE:
        pass
    assert reg["n"] == 3 and seen == list(range(drv.steps))  # every step() went through _drive
    seen.clear()
    assert REPEAT(5, inc).start().run() == 8 and len(seen) == 1
