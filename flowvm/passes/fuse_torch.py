"""The ``fuse-torch`` pass: runs of torch CALLs become one ``torch.compile``'d step.

A CALL is *fusable* when its function is a ``torch.nn.Module``, a function of
``torch`` (also ``torch.nn.functional``, ``torch.linalg``, ``torch.special``,
``torch.fft``), a Tensor method (``torch.Tensor.add``, or a bound one), or a
function marked with ``@flowvm.fusable``.  A few torch functions that cannot
be traced or only make sense eagerly (``Tensor.backward``, ``Tensor.item``,
``torch.manual_seed``, ...) are never fusable; ``fusable(fn, False)`` excludes
more.  A maximal run of two or more consecutive fusable CALLs inside a SEQ
(at any depth, but not under a WEAVE, whose schedule counts steps) becomes
one FUSED element, whose one execution is one step.  A ``Tensor.backward``
(or ``torch.autograd.backward``) CALL right after a run ends it and joins
it: the calls before it are compiled, the backward pass runs eagerly (through
the compiled backward graph), and the loss never sits in a register between
two steps, so every step boundary of a training loop is a resume point.  In the program of a
``@flowvm.program`` function, whose statements are CALLs of functions generated from them, a statement's CALL
is fusable when the statement is a *tensor statement* (flowvm/passes/statements.py), and ``loss.backward()``
is a backward pass.

>>> import torch
>>> from flowvm import CALL, SEQ, Registers
>>> F = torch.nn.functional
>>> reg = Registers(x=torch.ones(3), t=torch.zeros(3))
>>> prog = SEQ([CALL(F.relu, reg('x'), store_to=reg('y')),
...             CALL(F.softplus, reg('y'), beta=2.0, store_to=reg('y')),
...             CALL(F.mse_loss, reg('y'), reg('t'), store_to=reg('loss'))])
>>> fast = fuse_torch(prog, form="eager")
>>> print(fast)
FUSED 3 calls, torch.compile(inductor): eager (forced):
    y = relu(x)  # was 0
    y = softplus(y, beta=2.0)  # was 1
    loss = mse_loss(y, t)  # was 2
>>> fast.run().item() == prog.run().item()
True
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Iterable, Mapping

from ..program.elements import CALL, SEQ, Element
from ..base.errors import FusionWarning
from ..fused.element import _MARK, FORMS, FUSED, FuseSettings, fusable, fused_step, is_fusable
from ..program.paths import format_path
from .registry import current_context, register_pass
from .rewrite import is_call, is_seq, rebuild, rewrite, under_weave
from .statements import BACKWARD, TORCH, fusion_kind

__all__ = ["FUSED", "FuseSettings", "FusionWarning", "fusable", "is_fusable", "fuse_torch", "fused_step", "set_form"]

def set_form(program: Element, form: str, paths: Iterable[str] | None = None) -> Element:
    """The program with the FUSED elements (all, or those at paths) set to form; the override of a decision.

    >>> import torch
    >>> from flowvm import CALL, SEQ, Registers
    >>> reg = Registers(x=torch.ones(2))
    >>> fast = fuse_torch(SEQ([CALL(torch.nn.functional.relu, reg('x'), store_to=reg('x'))] * 2))
    >>> set_form(fast, "eager").header_text()
    'FUSED 2 calls, torch.compile(inductor): eager (forced):'
    """
    if form not in FORMS:
        raise ValueError(f"set_form: form must be one of {', '.join(FORMS)}, got {form!r}")
    wanted = None if paths is None else {p if isinstance(p, str) else format_path(p) for p in paths}
    found: set[str] = set()

    def visit(el, path):
        where = format_path(path)
        if type(el) is FUSED and (wanted is None or where in wanted):
            found.add(where)
            return el.with_form(form)
        return el

    out = rewrite(program, visit)
    if wanted is None and not found:
        raise LookupError("set_form: the program has no FUSED element (optimize it first: "
                          "flowvm.optimize(program) fuses runs of torch calls)")
    if wanted is not None and wanted - found:
        raise LookupError(f"set_form: no FUSED element at path(s) {', '.join(sorted(wanted - found))}")
    return out


def _fuse_seq(el: SEQ, path: tuple[int, ...], settings: FuseSettings, ctx, memo: dict) -> Element:
    out: list[Element] = []
    run: list[tuple[int, CALL]] = []

    def flush():
        if len(run) >= 2:
            origins = [ctx.origin(c, path + (i,)) if ctx else format_path(path + (i,)) for i, c in run]
            # copies: the fused step is compiled from these calls, so a later in-place edit of the
            # original CALL objects (flowvm.editing.edit) must not change them under it
            out.append(FUSED([copy.copy(c) for _, c in run], origins, settings))
        else:
            out.extend(c for _, c in run)
        run.clear()

    for i, child in enumerate(el.elements):
        kind = fusion_kind(child, memo)  # (a CALL unpacking into several registers: eager)
        if kind == TORCH:
            run.append((i, child))
        elif kind == BACKWARD and run:
            run.append((i, child))  # a backward pass ends the run, inside it: one resumable step
            flush()
        else:
            flush()
            out.append(child)
    flush()
    if len(out) == len(el.elements):
        return el
    plain = el.scope is None and not el.__dict__.get("_overrides") and not el.__dict__.get("_settings")  # else keep the SEQ and what it means
    return out[0] if len(out) == 1 and plain else rebuild(el, out)


@register_pass("fuse-torch", default=True)
def fuse_torch(program: Element, *, backend: Any = "inductor", mode: str | None = None,
               options: Mapping | None = None, dynamic: bool | None = False, form: str = "auto",
               background: bool = True, compile_in: str = "process", trials: int = 10, margin: float = 0.02,
               max_compiles: int = 4, compile_after: float = 20.0, payback: float = 20.0) -> Element:
    """Fuse runs of two or more consecutive torch CALLs in a SEQ into one torch.compile'd step."""
    settings = FuseSettings.make(options, backend=backend, mode=mode, dynamic=dynamic, form=form,
                                 background=background, compile_in=compile_in, trials=trials, margin=margin,
                                 max_compiles=max_compiles, compile_after=compile_after, payback=payback)
    if "torch" not in sys.modules and not _any_marked(program):
        return program
    ctx = current_context()
    weaves = under_weave(program)
    memo: dict = {}

    def visit(el, path):
        if is_seq(el) and path not in weaves:
            return _fuse_seq(el, path, settings, ctx, memo)
        return el

    return rewrite(program, visit)


def _any_marked(program: Element) -> bool:
    from ..program.paths import walk

    return any(is_call(el) and getattr(el.fn, _MARK, False) for _, el in walk(program))
