"""Random functions built from the statements ``@flowvm.program`` supports, as source text (for
tests/program/test_pyfunc_property.py): assignments, augmented assignments, tuple unpacking, calls, ``if``/
``elif``/``else``, ``for`` over a range, a list or a dict's items, bounded ``while``, ``break``, ``continue``,
``return``, ``raise``, ``del``.  ``tensor_function`` adds tensor statements over the tensors t, u and w (runs
of them are what the optimizer fuses), statements that read a tensor into Python (which end such a run), a
training step (a loss, its backward, an update under ``torch.no_grad()``) and a shape error.  Every loop ends:
a ``while`` counts a fresh variable up to a small bound first thing."""

from __future__ import annotations

from hypothesis import strategies as st

VARS = ("a", "b", "c")
EXPRS = ("{x}", "{y} + 1", "({x} * 3 - {y}) % 97", "{x} // ({y} % 5 + 1)", "len(acc)", "-{x}",
         "({x} if {y} % 2 else {y})", "max({x}, {y})", "({x} and {y})", "sum(acc[-3:])")
CONDS = ("{x} > {y}", "{x} % 3 == 0", "not acc", "{x} == {y} or {y} > 50", "len(acc) > 4")


@st.composite
def expr(draw) -> str:
    x, y = draw(st.sampled_from(VARS)), draw(st.sampled_from(VARS))
    return draw(st.sampled_from(EXPRS)).format(x=x, y=y)


@st.composite
def cond(draw) -> str:
    x, y = draw(st.sampled_from(VARS)), draw(st.sampled_from(VARS))
    return draw(st.sampled_from(CONDS)).format(x=x, y=y)


TENSOR = ("t = torch.tanh(t * 0.5 + u)", "u = u - t.mean(0) * 0.25", "t = torch.tanh(t @ m)",
          "t = torch.relu(t - {x} % 3)", "u += torch.sigmoid(u).sum() * 0.1", "t = torch.where(t > 0, t, t * 0.1)",
          "v = F.softplus(t).sum(1)", "u = torch.cat([u[1:], u[:1]])", "t = t / (t.norm() + 1.0)", "u = -u",
          "t = t * {x} % 5")
TO_PYTHON = ("{x} = int(t.sum() > 0) + {x} % 7", "acc.append(round(float(u.sum()), 3))")
TRAIN = ["loss = (t @ w).square().mean()", "loss.backward()", "with torch.no_grad():", "    w -= 0.1 * w.grad",
         "w.grad = None"]


@st.composite
def block(draw, depth: int, in_loop: bool, counter: list, tensors: bool = False) -> list[str]:
    n = draw(st.integers(1, 4 if depth < 2 else 2))
    if tensors:
        n += draw(st.integers(0, 3))
    return [line for _ in range(n) for line in draw(statement(depth, in_loop, counter, tensors))]


@st.composite
def tensor_statement(draw) -> list[str]:
    x = draw(st.sampled_from(VARS))
    kind = draw(st.sampled_from(["tensor"] * 6 + ["python", "train", "error"]))
    if kind == "tensor":
        return [draw(st.sampled_from(TENSOR)).format(x=x)]
    if kind == "python":
        return [draw(st.sampled_from(TO_PYTHON)).format(x=x)]
    if kind == "train":
        return list(TRAIN)
    return [f"if {x} > 800:", "    t = t @ u[:2]"]


def _indent(lines: list[str]) -> list[str]:
    return ["    " + line for line in lines]


@st.composite
def statement(draw, depth: int, in_loop: bool, counter: list, tensors: bool = False) -> list[str]:
    if tensors and draw(st.booleans()):
        return draw(tensor_statement())
    kinds = ["assign", "aug", "append", "unpack", "print"]
    if depth < 3:
        kinds += ["if", "for", "while", "forlist"]
    if in_loop:
        kinds += ["break", "continue"]
    kinds += ["return", "raise", "del"]
    kind = draw(st.sampled_from(kinds))
    x = draw(st.sampled_from(VARS))
    if kind == "assign":
        return [f"{x} = {draw(expr())}"]
    if kind == "aug":
        return [f"{x} {draw(st.sampled_from(['+=', '-=', '*=']))} {draw(expr())}", f"{x} %= 1000"]
    if kind == "append":
        return [f"acc.append({draw(expr())})"]
    if kind == "unpack":
        y = draw(st.sampled_from(VARS))
        return [f"{x}, {y} = {y}, {draw(expr())}"]
    if kind == "print":
        return ["log.append((a, b))"]
    if kind == "if":
        lines = [f"if {draw(cond())}:"] + _indent(draw(block(depth + 1, in_loop, counter, tensors)))
        if draw(st.booleans()):
            lines += [f"elif {draw(cond())}:"] + _indent(draw(block(depth + 1, in_loop, counter, tensors)))
        if draw(st.booleans()):
            lines += ["else:"] + _indent(draw(block(depth + 1, in_loop, counter, tensors)))
        return lines
    if kind == "for":
        counter.append(0)
        i = f"i{len(counter)}"
        return [f"for {i} in range({draw(st.integers(0, 4))}):", f"    {x} += {i}"] + \
            _indent(draw(block(depth + 1, True, counter, tensors)))
    if kind == "forlist":
        counter.append(0)
        k = f"k{len(counter)}"
        source = draw(st.sampled_from(["acc[:3]", "[a, b]", "sorted({'p': a, 'q': b}.items())"]))
        return [f"for {k} in {source}:", f"    log.append({k})"] + _indent(draw(block(depth + 1, True, counter, tensors)))
    if kind == "while":
        counter.append(0)
        w = f"w{len(counter)}"
        return [f"{w} = 0", f"while {w} < {draw(st.integers(0, 4))}:", f"    {w} += 1"] + \
            _indent(draw(block(depth + 1, True, counter, tensors)))
    if kind in ("break", "continue"):
        return [f"if {draw(cond())}:", f"    {kind}"]
    if kind == "return":
        tail = ", t.tolist(), u.tolist(), w.tolist()" if tensors else ""
        return [f"if {draw(cond())}:", f"    return a, b, c, acc{tail}"]
    if kind == "raise":
        return [f"if {x} > 900:", f"    raise ValueError({x})"]
    return [f"tmp = {x}", "del tmp"]


@st.composite
def function(draw) -> str:
    """The source of a module defining ``f``, decorated, over a, b, c and the lists acc and log."""
    counter: list = []
    body = draw(block(0, False, counter))
    lines = ["import flowvm", "", "", "@flowvm.program", "def f(a, b, c, log):", "    acc = []"] + \
        _indent(body) + ["    return a, b, c, acc"]
    return "\n".join(lines) + "\n"


@st.composite
def tensor_function(draw) -> str:
    """The source of a module defining ``f``, decorated, over a, b, c, the lists acc and log, and the tensors
    t (4x3), u (3), m (3x3) and w (3, requiring grad); it returns them, tensors as lists."""
    counter: list = []
    body = draw(block(0, False, counter, True))
    out = "    return a, b, c, acc, t.tolist(), u.tolist(), w.tolist()"
    lines = ["import torch", "import torch.nn.functional as F", "import flowvm", "", "", "@flowvm.program",
             "def f(a, b, c, log, t, u, m, w):", "    acc = []", "    v = None"] + _indent(body) + [out]
    return "\n".join(lines) + "\n"
