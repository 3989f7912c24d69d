"""Why fuse-torch fused what it did, and why not the rest: ``explain_fusion(program)``, the text that
``flowvm.optimize(program, explain=True)`` and ``flowvm optimize TARGET --explain`` print.

For every SEQ (where fuse-torch looks for runs of torch CALLs) it says, child by child, what became of it: part
of a fused step, a torch call with nothing to fuse with, or not fusable and why (a function of yours: mark it
``@flowvm.fusable``; a call that leaves torch's graph, such as ``Tensor.item``; an optimizer's method; another
kind of element).  A SEQ under a WEAVE is never fused, and says so; a SEQ whose one CALL holds a whole training
step is pointed at ``@flowvm.fusable``.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

from ..program.elements import CALL, SEQ, Element
from ..program.paths import format_path, walk
from ..program.printer import call_text
from .rewrite import is_call, is_seq

__all__ = ["explain_fusion", "fused_steps"]


def fused_steps(program: Element) -> list[tuple[str, Element]]:
    """(path, FUSED element) for every fused step of an optimized program (``drv.program`` for a run's own):
    ``step.header_text()`` says which form it runs and why, ``step.runtime().refused`` why a compile was
    refused, ``step.runtime().force("eager")`` overrides the choice in this process."""
    from ..fused.element import FUSED

    return [(format_path(path), el) for path, el in walk(program) if isinstance(el, FUSED)]


def explain_fusion(program: Element) -> str:
    """Lines saying, for each SEQ of program, which CALLs fuse-torch fuses into one step and why the others
    are not (see the module docstring)."""
    from .rewrite import under_weave

    if "torch" not in sys.modules:
        return "fuse-torch: torch is not imported, so no CALL is a torch call: nothing is fused"
    weaves = under_weave(program)
    out: list[str] = []
    in_seq = {path + (i,) for path, el in walk(program) if is_seq(el) for i in range(len(el.elements))}
    for path, el in walk(program):
        if is_call(el) and path not in in_seq and _users_code(el.fn):
            out.append(f"CALL at {format_path(path) or 'the root'} {_text(el)}: {ONE_STEP}")
        if not is_seq(el):
            continue
        where = f"SEQ at {format_path(path) or 'the root'}"
        if path in weaves:
            out.append(f"{where}: not fused: it runs under a WEAVE, whose schedule counts steps")
            continue
        out.extend(_seq(el, path, where))
    return "\n".join(out) if out else "fuse-torch: the program has no SEQ, where runs of torch CALLs are fused"


def _seq(el: SEQ, path: tuple, where: str) -> list[str]:
    memo: dict = {}
    kinds = [_kind(child, memo) for child in el.elements]
    runs = _runs(kinds)
    fused = sum(1 for a, b in runs if b - a >= 2)
    lines = [f"{where}: {fused} fused step{'s' if fused != 1 else ''} from {len(el.elements)} children"]
    in_run = {i: (a, b) for a, b in runs for i in range(a, b)}
    for i, child in enumerate(el.elements):
        text = _text(child) if is_call(child) else child.kind
        if i in in_run:
            what = _in_run(path, *in_run[i], kinds[i], child)
        else:
            what = _why_not(child, kinds[i], len(el.elements), memo)
        lines.append(f"  {format_path(path + (i,))} {text}: {what}")
    return lines


def _kind(child: Element, memo: dict) -> str:
    """"torch" (a fusable CALL), "backward" (a backward pass, which joins a run) or "other"."""
    from .statements import fusion_kind

    return fusion_kind(child, memo)


def _in_run(path: tuple, a: int, b: int, kind: str, child: Element) -> str:
    from ..program.pyfunc import Statement

    if b - a < 2:
        if isinstance(child.fn, Statement):
            return "a tensor statement with none beside it to fuse with: it stays a step of its own"
        return "a torch call with no torch call beside it to fuse with: it stays a step of its own"
    joins = " (the backward pass joins the step, eagerly)" if kind == "backward" else ""
    return f"fused: calls {format_path(path + (a,))} to {format_path(path + (b - 1,))} run as one step{joins}"


ONE_STEP = ("a function of yours holding a whole step in one CALL: fuse-torch fuses runs of two or more torch "
            "CALLs in a SEQ, so nothing fuses here. Write the step as CALLs of torch modules and functions "
            "(model, loss, Tensor.backward, the optimizer's step), or mark the helpers it calls @flowvm.fusable "
            "and call them as CALLs beside the torch calls")


def _text(call: CALL) -> str:
    """The CALL as the listing writes it, on one line of at most 80 characters."""
    text = " ".join(call_text(call).split())
    return text if len(text) <= 80 else text[:77] + "..."


def _runs(kinds: list[str]) -> list[tuple[int, int]]:
    """[start, end) of each run of torch calls, a backward right after one joining it (as fuse-torch does)."""
    runs, start = [], None
    for i, kind in enumerate(kinds + ["other"]):
        if kind == "torch":
            start = i if start is None else start
            continue
        if start is not None:
            end = i + 1 if kind == "backward" else i
            runs.append((start, end))
            start = None
    return runs


def _why_not(child: Element, kind: str, siblings: int, memo: dict) -> str:
    from ..program.pyfunc import Statement
    from .statements import statement_kind

    if kind == "backward":
        return "a backward pass with no torch calls before it: it runs eagerly, as a step of its own"
    if not is_call(child):
        return f"a {child.kind}: it ends the run of torch calls before it (its own SEQs are looked at)"
    fn = child.fn
    if isinstance(fn, Statement):
        return f"not a tensor statement: {statement_kind(child, memo)[1]}"
    if isinstance(child.store_to, tuple):
        return "it stores into several registers (unpacking): it runs eagerly, as a step of its own"
    if getattr(fn, "__flowvm_fusable__", None) is False:  # (flowvm.fused.element's mark)
        return "excluded with flowvm.fusable(fn, False)"
    name = getattr(fn, "__name__", None) or type(fn).__name__
    torch = sys.modules["torch"]
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.Tensor) or getattr(torch.Tensor, name, None) is fn:
        return f"never fused: Tensor.{name} leaves torch's graph (it runs eagerly, as a step of its own)"
    if getattr(torch, name, None) is fn:
        return f"never fused: torch.{name} changes the process or leaves torch's graph"
    if isinstance(owner, torch.optim.Optimizer):
        return (f"an optimizer's method ({type(owner).__name__}.{name}): not fused unless marked "
                "(flowvm.fusable(opt.step))")
    if _users_code(fn):
        if siblings == 1:
            return ONE_STEP
        return (f"a function of yours ({getattr(fn, '__qualname__', name)}): mark it @flowvm.fusable if it "
                f"only computes with torch (no side effects), so that it fuses with the torch calls around it")
    return f"not a torch call ({type(fn).__name__} {name})"


def _users_code(fn: Any) -> bool:
    if isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    return isinstance(fn, types.FunctionType) and not (fn.__module__ or "").startswith(("torch", "flowvm"))
