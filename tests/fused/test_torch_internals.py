"""Every call of flowvm into torch's internals is in one module, flowvm/fused/torch_internals.py: the one place
that changes when torch changes them."""

from __future__ import annotations

import ast
from pathlib import Path

import flowvm

INTERNAL_MODULES = ("torch._", "torch.fx.experimental", "torch.export", "torch.nn.utils.stateless")
INTERNAL_NAMES = {"make_fx", "aot_function", "aot_module", "compile_fx", "compile_fx_inner"}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return None


def internal_uses(source: str) -> list[str]:
    """The uses of torch's internals in this source: imports of them, attributes of them, their names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [_dotted(node) or ""]
        elif isinstance(node, ast.Name):
            names = [node.id]
        for name in names:
            if name.split(".")[1:2] and name.split(".")[1].startswith("__"):  # torch.__version__, torch.__file__
                continue
            if name.startswith(INTERNAL_MODULES) or name.split(".")[-1] in INTERNAL_NAMES:
                found.append(f"line {node.lineno}: {name}")
    return found


def test_the_check_finds_each_kind_of_use():
    source = ("import torch\nfrom torch._dynamo import reset\nimport torch._inductor\nx = torch._C._aoti\n"
              "from torch.fx.experimental.proxy_tensor import make_fx\ny = torch.export.export\nz = torch.sin\n"
              "v = torch.__version__\n")
    found = {u.split(": ")[1] for u in internal_uses(source)}
    assert found >= {"torch._dynamo", "torch._dynamo.reset", "torch._inductor", "torch._C._aoti",
                     "torch.fx.experimental.proxy_tensor.make_fx", "torch.export.export"}
    assert not any(name.startswith(("torch.sin", "torch.__")) for name in found)


def test_no_module_of_flowvm_but_fused_torch_internals_calls_torch_internals():
    root = Path(flowvm.__file__).resolve().parent
    offenders = {}
    for path in sorted(root.rglob("*.py")):
        if path == root / "fused" / "torch_internals.py":
            continue
        uses = internal_uses(path.read_text())
        if uses:
            offenders[str(path.relative_to(root))] = uses
    assert offenders == {}
