"""Which statements of a @flowvm.program function fuse-torch takes for tensor statements
(flowvm/passes/statements.py), each with the reason explain_fusion gives for the others."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

import flowvm
from flowvm.passes.statements import BACKWARD, OTHER, TORCH, statement_kind

SOURCE = """
import torch
import torch.nn.functional as F
import flowvm


def helper(v):
    return v * 2


@flowvm.program
def f(x, w, net, k, flag):
    s = set()
    model = torch.nn.Linear(3, 3)
{body}
    return x
"""
CASES = [  # (statement, kind, words of the reason)
    ("y = torch.relu(x)", TORCH, ""),
    ("y = x @ w", TORCH, ""),
    ("y = net(x)", TORCH, ""),
    ("y = model(x)", TORCH, ""),  # model: every assignment makes a module
    ("y = F.softplus(x.view(-1)).sum()", TORCH, ""),
    ("x += w", TORCH, ""),
    ("x.add_(w)", TORCH, ""),
    ("y.backward()", BACKWARD, ""),
    ("with torch.no_grad():\n        y = x * 2", TORCH, ""),
    ("n = 3 * k", OTHER, "computes no tensor"),
    ("y = x.item()", OTHER, "x.item, which leaves torch's graph"),
    ("s.add(1)", OTHER, "add is a method of builtin values"),
    ("y = helper(x)", OTHER, "helper, a function of yours: mark it @flowvm.fusable"),
    ("y = k(x)", OTHER, "the local k, which does not hold a torch module"),
    ("y = torch.relu(x) if flag else x", OTHER, "a conditional expression"),
    ("a, b = x.chunk(2)", OTHER, "unpacking"),
    ("x[0] = 1.0", OTHER, "an item"),
    ("y = [torch.relu(v) for v in x]", OTHER, "a comprehension"),
    ("print(x)", OTHER, "print, which fuse-torch does not fuse"),
]


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kinds")
    body = "\n".join("    " + text for text, _, _ in CASES)
    (folder / "stmt_kinds.py").write_text(textwrap.dedent(SOURCE).format(body=body))
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    try:
        module = importlib.import_module("stmt_kinds")
    finally:
        sys.path.remove(str(folder))
    return module.f(torch.ones(3), torch.ones(3), torch.nn.Linear(3, 3), 2, True)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0].split("\n")[-1].strip() for c in CASES])
def test_a_statement_is_a_tensor_statement_or_says_why_not(program, case):
    text, kind, words = CASES[case]
    calls = {c.fn.text: c for c in program.elements if hasattr(c, "fn")}
    got, why = statement_kind(calls[text.split("\n")[0]], {})
    assert got == kind, (text, got, why)
    assert words in why, (text, why)


def test_a_local_assigned_anything_but_a_module_is_not_one(tmp_path):
    (tmp_path / "stmt_mixed.py").write_text(textwrap.dedent("""
        import torch
        import flowvm

        @flowvm.program
        def g(x, pick):
            m = torch.nn.Linear(3, 3)
            if pick:
                m = len
            y = m(x)
            return y
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("stmt_mixed")
    finally:
        sys.path.remove(str(tmp_path))
    why = flowvm.explain_fusion(module.g(torch.ones(3), False))
    assert "y = m(x): not a tensor statement: it calls the local m, which does not hold a torch module" in why, why
