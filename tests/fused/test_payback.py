"""A compile starts only when the run has enough known executions left to repay it (fuse-torch's payback)."""

from __future__ import annotations

import torch

from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.fused import compiler, runtime
from flowvm.passes.fuse_torch import fuse_torch


def chain(n):
    reg = Registers(x=torch.ones(8))
    return REPEAT(n, SEQ([CALL(torch.sin, reg("x"), store_to=reg("x")), CALL(torch.cos, reg("x"), store_to=reg("x"))]))


def test_a_run_too_short_to_repay_a_compile_never_starts_one(monkeypatch):
    started = []
    monkeypatch.setattr(runtime.Runtime, "_start_compile", lambda self, args: started.append(args))
    monkeypatch.setattr(compiler, "compile_seconds", [])  # no compile of an earlier test shortens the estimate
    fast = fuse_torch(chain(300), compile_after=0)  # the defaults otherwise: auto, inductor, payback 20
    fast.run()
    rt = fast.body.runtime()
    assert started == [] and rt.compiles == 0 and rt.state == "eager"
    assert "would not repay a compile" in fast.body.header_text() and "299 executions left" in rt.decision


def test_a_run_long_enough_starts_its_compile_and_payback_zero_skips_the_check(monkeypatch):
    started = []
    monkeypatch.setattr(runtime.Runtime, "_start_compile", lambda self, args: started.append(len(args)))
    monkeypatch.setattr(compiler, "FIRST_COMPILE_SECONDS", {"inductor": 1e-9})  # as if compiling were free
    monkeypatch.setattr(compiler, "compile_seconds", [])
    fuse_torch(chain(300), compile_after=0).run()
    assert started  # repaid: the compile starts
    monkeypatch.setattr(compiler, "FIRST_COMPILE_SECONDS", {"inductor": 1e9})
    started.clear()
    fuse_torch(chain(300), compile_after=0, payback=0).run()
    assert started  # no check
    started.clear()
    fuse_torch(chain(300), compile_after=0).run()
    assert not started
