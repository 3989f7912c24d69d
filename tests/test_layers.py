"""flowvm's modules form layers, each importing only from the layers below it (or its own), and no import
cycle: checked on the source of the installed package, every import counted (at module level and inside
functions; those under ``if TYPE_CHECKING:`` are for type checkers only).  See docs/architecture.md."""

from __future__ import annotations

import ast
from pathlib import Path

import flowvm

# the package's folders are its layers, bottom to top; a module's layer is that of its folder (or, for the
# few modules at the top, its own name).  A new folder or top-level module must be placed here.
LAYERS = {
    "base": 0, "pickled": 0,
    "program": 1,
    "machine": 2,
    "persist": 3,
    "editing": 4,
    "views": 5,
    "processes": 6,
    "fused": 7, "passes": 7, "distributed": 7,
    "__init__": 8, "testing": 8, "programs": 8, "legacy": 8,
    "command": 9, "__main__": 9,
}
ROOT = Path(flowvm.__file__).resolve().parent


def modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)
        out[name] = p
    return out


def layer(name: str) -> int:
    return LAYERS[name.split(".")[0]]


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(name: str, path: Path, mods: dict) -> list[tuple[str, int]]:
    """(flowvm module, line) for every import of a flowvm module in the file."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    package = name.split(".") if path.name == "__init__.py" and name != "__init__" else name.split(".")[:-1]
    if name == "__init__":
        package = []
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "flowvm" or node.module.startswith("flowvm.")):
                module = node.module.removeprefix("flowvm").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}" if module else alias.name
                found.append((sub if sub in mods else (module or "__init__"), node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "flowvm" or alias.name.startswith("flowvm."):
                    found.append((alias.name.removeprefix("flowvm").lstrip(".") or "__init__", node.lineno))
    return [(m, line) for m, line in found if m in mods and m != name]


def graph() -> dict[str, list[tuple[str, int]]]:
    mods = modules()
    return {name: imports(name, path, mods) for name, path in mods.items()}


def test_every_module_has_a_layer():
    missing = [m for m in modules() if m.split(".")[0] not in LAYERS]
    assert not missing, f"place these modules in a layer (tests/test_layers.py, docs/architecture.md): {missing}"


def test_no_module_imports_from_a_layer_above_its_own():
    up = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)}) at line {line}"
          for m, targets in graph().items() for t, line in targets if layer(t) > layer(m)]
    assert not up, "imports reaching up a layer:\n  " + "\n  ".join(up)


def test_no_import_cycle():
    edges = {m: {t for t, _ in targets} for m, targets in graph().items()}
    # the package's __init__ imports everything; its submodules importing it back is the one
    # import the layers allow (none does today)
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)


def test_the_layering_check_sees_an_import_inside_a_function(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from ..machine.driver import Driver\n    return Driver\n")
    found = imports("base.errors", source, modules())
    assert ("machine.driver", 2) in found and layer("machine.driver") > layer("base.errors")
