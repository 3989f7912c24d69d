"""The size figures of docs/architecture.md: modules over 400 lines, functions over 60 lines or of cyclomatic
complexity over 15 (radon's), in flowvm/, programs/ and flowvm_cli.py.  python scripts/sizes.py [--json]"""

import json
import sys
from pathlib import Path

from radon.complexity import cc_visit
from radon.visitors import Class

REPO = Path(__file__).resolve().parents[1]
MODULE_LINES, FUNCTION_LINES, COMPLEXITY = 400, 60, 15


def sources():
    yield REPO / "flowvm_cli.py"
    for folder in ("flowvm", "programs"):
        yield from sorted((REPO / folder).rglob("*.py"))


def functions(blocks):
    for block in blocks:
        if isinstance(block, Class):
            yield from functions(block.methods)
        else:
            yield block
            yield from functions(block.closures)


def figures():
    """{'modules': {path: lines}, 'functions': {path:name: (lines, complexity)}} over the limits, and totals."""
    modules, funcs, n_funcs = {}, {}, 0
    for path in sources():
        text = path.read_text(encoding="utf-8")
        rel = str(path.relative_to(REPO))
        lines = text.count("\n")
        if lines > MODULE_LINES:
            modules[rel] = lines
        for f in functions(cc_visit(text)):
            n_funcs += 1
            length = f.endline - f.lineno + 1
            if length > FUNCTION_LINES or f.complexity > COMPLEXITY:
                name = f"{f.classname}.{f.name}" if getattr(f, "classname", None) else f.name
                funcs[f"{rel}:{name}"] = (length, f.complexity)
    return {"modules": modules, "functions": funcs, "n_modules": len(list(sources())), "n_functions": n_funcs}


if __name__ == "__main__":
    fig = figures()
    if "--json" in sys.argv:
        print(json.dumps(fig, indent=1))
    else:
        print(f"{fig['n_modules']} modules, {fig['n_functions']} functions")
        print(f"modules over {MODULE_LINES} lines: {len(fig['modules'])}")
        for k, v in sorted(fig["modules"].items(), key=lambda kv: -kv[1]):
            print(f"  {v:5d}  {k}")
        print(f"functions over {FUNCTION_LINES} lines or complexity {COMPLEXITY}: {len(fig['functions'])}")
        for k, (n, c) in sorted(fig["functions"].items(), key=lambda kv: -kv[1][1]):
            print(f"  {n:4d} lines  cc {c:3d}  {k}")
