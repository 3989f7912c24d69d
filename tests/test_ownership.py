"""The Driver owns its run state: no module outside flowvm/machine/ reads or writes a Driver's underscore
attributes (they go through snapshot, restore, replace_frames, frames, ...: docs/driver.md), and a private
name of one module is not imported by another.  Checked on the source of the installed package with ast."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import flowvm
from flowvm.machine.driver import Driver

ROOT = Path(flowvm.__file__).resolve().parent

# Private imports across modules that predate this rule, outside the folders it was first applied to: each
# one goes when its module is next reworked; none may be added.
KNOWN_PRIVATE_IMPORTS = {
    ("fused/outofprocess.py", "_at_exit"), ("fused/runtime.py", "_direct_caller"), ("passes/fuse_torch.py", "_MARK"),
    ("persist/state.py", "_key_bytes"), ("persist/stateshow.py", "_key_bytes"),
    ("persist/statedecoder.py", "_GLOBALS"), ("persist/statedecoder.py", "_float_value"),
    ("persist/statedecoder.py", "_step"), ("persist/stateobjects.py", "_reduce_patched_method"),
}


def driver_classes() -> list[type]:
    """Driver and its base classes of flowvm's own (RunStateAccess, ...)."""
    return [Driver] + [c for c in Driver.__mro__[1:] if c.__module__.startswith("flowvm.")]


def source_of(cls: type) -> Path:
    if cls is Driver:  # (its __module__ is "flowvm", the name it pickles by)
        return ROOT / "machine" / "driver.py"
    return Path(sys.modules[cls.__module__].__file__)


def driver_private_names() -> set[str]:
    """Every underscore name of the Driver: its methods and class attributes, and the fields its methods set
    or read on self, in Driver and in each of its flowvm base classes."""
    names = set()
    for cls in driver_classes():
        names |= {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")}
        module = ast.parse(source_of(cls).read_text())
        tree = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                names.add(node.attr)
        for node in ast.walk(tree):  # fields kept in __dict__ by name ("_live")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_") \
                    and node.value.isidentifier() and not node.value.startswith("__"):
                names.add(node.value)
    return names


def outside_machine() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] != "machine"]


def driver_field_uses(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, code) of every access of one of names on anything but self: ``x._stack``, and
    ``x.__dict__.get("_live")`` / ``x.__dict__["_live"]``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names \
                and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.append((node.lineno, ast.unparse(node)))
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__":
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "__dict__":
            key = node.args[0]
        if isinstance(key, ast.Constant) and key.value in names:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_rule_sees_the_driver_fields():
    names = driver_private_names()
    assert {"_stack", "_carry", "_ready", "_fresh", "_watch", "_resume", "_live", "_prepare"} <= names
    assert {"_apply_resume", "_resume_for_copy"} <= names  # in its base class
    assert {"_after_leaf", "_running_error", "_forget_plan"} <= names
    assert len(driver_classes()) > 1
    bad = ast.parse("drv._stack[:] = x\nn = drv.__dict__.get('_live')\nself._stack = []\nother.steps\n")
    assert sorted(line for line, _ in driver_field_uses(bad, names)) == [1, 2]


def test_no_module_outside_the_machine_touches_a_driver_private_field():
    names = driver_private_names()
    offences = []
    for path in outside_machine():
        for line, code in driver_field_uses(ast.parse(path.read_text()), names):
            offences.append(f"{path.relative_to(ROOT)}:{line}: {code}")
    assert not offences, "use the Driver's API (snapshot, restore, replace_frames, frames, ...):\n" + "\n".join(offences)


def private_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every ``from <flowvm module> import _name`` (relative imports; other packages' private
    names, torch's say, are theirs to keep)."""
    return [(node.lineno, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level
            for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]


def test_no_private_name_is_imported_from_another_module():
    offences = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, name in private_imports(ast.parse(path.read_text())):
            if (rel, name) not in KNOWN_PRIVATE_IMPORTS:
                offences.append(f"{rel}:{line}: {name}")
    assert not offences, "make the name public (no underscore) or keep it in its module:\n" + "\n".join(offences)


def test_every_known_private_import_is_still_there():
    """The list only shrinks: an entry whose import is gone is taken off it."""
    present = {(path.relative_to(ROOT).as_posix(), name) for path in sorted(ROOT.rglob("*.py"))
               for _, name in private_imports(ast.parse(path.read_text()))}
    stale = sorted(KNOWN_PRIVATE_IMPORTS - present)
    assert not stale, f"take these off KNOWN_PRIVATE_IMPORTS: {stale}"
