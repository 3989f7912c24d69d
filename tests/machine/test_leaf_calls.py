"""Where leaves are called: ``Driver._drive`` is the one call of a leaf on the general path (run(), arun()
and step() alike); the fast paths' loops (fastpaths.py) and step()'s repeated leaf call theirs inline, for
the speed docs/architecture.md measures.  Checked on the source with ast, and by running."""

from __future__ import annotations

import ast
from pathlib import Path

import flowvm
from flowvm import CALL, SEQ, WEAVE, LOOP, REPEAT, Registers
from flowvm.machine import driver as driver_module

ROOT = Path(flowvm.__file__).resolve().parent


def leaf_calls(tree: ast.AST) -> list[str]:
    """The functions (by qualified name) that call ``<something>._leaf()``."""
    found = []

    def visit(node: ast.AST, where: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, where + [child.name])
                continue
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "_leaf":
                found.append(".".join(where))
            visit(child, where)

    visit(tree, [])
    return found


def test_the_general_path_calls_a_leaf_in_one_place():
    calls = {}
    for path in sorted(ROOT.rglob("*.py")):
        for where in leaf_calls(ast.parse(path.read_text())):
            calls.setdefault(f"{path.relative_to(ROOT).as_posix()}:{where}", 0)
            calls[f"{path.relative_to(ROOT).as_posix()}:{where}"] += 1
    assert calls == {"machine/driver.py:Driver._drive": 1, "machine/driver.py:Driver.step": 1}


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
