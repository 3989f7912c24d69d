"""Random functions built from the statements ``@flowvm.program`` supports, as source text (for
tests/program/test_pyfunc_property.py): assignments, augmented assignments, tuple unpacking, calls, ``if``/
``elif``/``else``, ``for`` over a range, a list or a dict's items, bounded ``while``, ``break``, ``continue``,
``return``, ``raise``, ``del``, ``with torch.no_grad()`` left out (no torch here).  Every loop ends: a
``while`` counts a fresh variable up to a small bound first thing."""

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


@st.composite
def block(draw, depth: int, in_loop: bool, counter: list) -> list[str]:
    n = draw(st.integers(1, 4 if depth < 2 else 2))
    return [line for _ in range(n) for line in draw(statement(depth, in_loop, counter))]


def _indent(lines: list[str]) -> list[str]:
    return ["    " + line for line in lines]


@st.composite
def statement(draw, depth: int, in_loop: bool, counter: list) -> list[str]:
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
        lines = [f"if {draw(cond())}:"] + _indent(draw(block(depth + 1, in_loop, counter)))
        if draw(st.booleans()):
            lines += [f"elif {draw(cond())}:"] + _indent(draw(block(depth + 1, in_loop, counter)))
        if draw(st.booleans()):
            lines += ["else:"] + _indent(draw(block(depth + 1, in_loop, counter)))
        return lines
    if kind == "for":
        counter.append(0)
        i = f"i{len(counter)}"
        return [f"for {i} in range({draw(st.integers(0, 4))}):", f"    {x} += {i}"] + \
            _indent(draw(block(depth + 1, True, counter)))
    if kind == "forlist":
        counter.append(0)
        k = f"k{len(counter)}"
        source = draw(st.sampled_from(["acc[:3]", "[a, b]", "sorted({'p': a, 'q': b}.items())"]))
        return [f"for {k} in {source}:", f"    log.append({k})"] + _indent(draw(block(depth + 1, True, counter)))
    if kind == "while":
        counter.append(0)
        w = f"w{len(counter)}"
        return [f"{w} = 0", f"while {w} < {draw(st.integers(0, 4))}:", f"    {w} += 1"] + \
            _indent(draw(block(depth + 1, True, counter)))
    if kind in ("break", "continue"):
        return [f"if {draw(cond())}:", f"    {kind}"]
    if kind == "return":
        return [f"if {draw(cond())}:", "    return a, b, c, acc"]
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
