"""What a compiled form read besides its inputs (flowvm/fused/reads.py): immutable values need no check,
mutable constants and the torch settings are checked before each call, anything else is refused by name;
and the fused step's own eager form reads a list of registers changed in place as a CALL does."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np
import pytest
import torch

import flowvm
from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.fused import torch_internals
from flowvm.fused.reads import Reads, Unchecked, immutable, same, snapshot
from flowvm.passes.fuse_torch import fuse_torch


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: int
    b: tuple


@dataclasses.dataclass
class Loose:
    a: int


class Color(enum.Enum):
    RED = 1


@pytest.mark.parametrize("value", [1, 2.5, 1j, True, "s", b"b", None, ..., range(3), torch.float64,
                                   torch.device("cpu"), torch.Size([2, 3]), (1, (2, "x")), frozenset({1, 2}),
                                   slice(1, None, 2), Color.RED, Frozen(1, (2,)), torch.sin,
                                   torch.nn.functional.relu])
def test_immutable_values_need_no_check(value):
    assert immutable(value)


@pytest.mark.parametrize("value", [[1], {"a": 1}, {1}, np.zeros(2), (1, [2]), Loose(1), Frozen(1, ([2],)),
                                   object(), lambda x: x, slice([1], None)])
def test_mutable_values_are_not_immutable(value):
    assert not immutable(value)


def calls_with(*args, **kwargs):
    reg = Registers(x=torch.ones(4))
    return [CALL(torch.roll, reg("x"), *args, **kwargs)], reg


@pytest.mark.parametrize("make, change", [
    (lambda: [1], lambda v: v.__setitem__(0, 3)),
    (lambda: [1], lambda v: v.append(2)),
    (lambda: [1], lambda v: v.__setitem__(0, 1.0)),             # equal, but another type
    (lambda: {"dims": 0}, lambda v: v.__setitem__("dims", 1)),
    (lambda: [[1, 2]], lambda v: v[0].append(3)),               # nested
    (lambda: np.array([1.0, np.nan]), lambda v: v.__setitem__(0, 2.0)),
    (lambda: {1, 2}, lambda v: v.add(3)),
])
def test_a_mutable_constant_is_copied_and_a_change_is_seen(make, change):
    value = make()
    calls, _ = calls_with(value)
    reads = Reads.capture(calls)
    assert reads.holds() and reads.changed() is None  # a NaN equals the NaN kept
    change(value)
    assert not reads.holds()
    assert "argument 2 changed" in reads.changed()


def test_a_list_holding_registers_is_checked_by_the_registers_it_holds():
    reg = Registers(a=torch.ones(2), b=torch.zeros(2))
    parts = [reg("a"), reg("b")]
    reads = Reads.capture([CALL(torch.cat, parts, store_to=reg("c"))])
    assert reads.holds()
    parts.reverse()
    assert not reads.holds()
    assert snapshot(parts)[0] is parts[0]  # registers are kept as they are, never copied with their file


@pytest.mark.parametrize("value, name", [(Loose(1), "Loose"), (object(), "object"), ([object()], "list"),
                                         (lambda x: x, "function")])
def test_a_value_that_can_be_neither_proven_nor_checked_is_refused_by_name(value, name):
    calls, _ = calls_with(value)
    with pytest.raises(Unchecked, match=rf"CALL torch.roll\(x, .*\): argument 2 is a {name}"):
        Reads.capture(calls)


@pytest.mark.parametrize("change, undo, said", [
    (lambda: torch.set_default_dtype(torch.float64), lambda: torch.set_default_dtype(torch.float32),
     "the default dtype"),
    (lambda: torch.set_grad_enabled(False), lambda: torch.set_grad_enabled(True), "grad mode"),
    (lambda: torch.use_deterministic_algorithms(True), lambda: torch.use_deterministic_algorithms(False),
     "deterministic algorithms"),
    (lambda: torch.set_float32_matmul_precision("medium"), lambda: torch.set_float32_matmul_precision("highest"),
     "matmul precision"),
    (lambda: torch.set_num_threads(torch.get_num_threads() + 1),
     lambda: torch.set_num_threads(torch.get_num_threads() - 1), "thread count"),
    (lambda: setattr(torch.backends.mkldnn, "enabled", False), lambda: setattr(torch.backends.mkldnn, "enabled", True),
     "oneDNN"),
    (lambda: torch.set_default_device("cpu"), lambda: torch.set_default_device(None), "torch function mode"),
])
@pytest.mark.parametrize("dynamos_guard", [True, False], ids=["dynamo's guard", "a torch without it"])
def test_the_torch_settings_a_trace_read_are_checked(change, undo, said, dynamos_guard, monkeypatch):
    if not dynamos_guard:  # the settings read one by one
        monkeypatch.setattr(torch_internals, "global_state_guard", lambda: None)
    calls, _ = calls_with(1, 0)
    reads = Reads.capture(calls)
    assert reads.holds()
    change()
    try:
        assert not reads.holds()
        assert said in reads.changed()
    finally:
        undo()
    assert reads.holds()


def test_same_is_strict_about_types_and_registers():
    reg = Registers()
    assert same([1, 2.0], [1, 2.0]) and not same([1], [True]) and not same([1], (1,))
    assert same(float("nan"), float("nan")) and not same({"a": 1, "b": 2}, {"b": 2, "a": 1})
    assert same([reg("a")], [reg("a")]) is False  # two references, not the same one
    r = reg("a")
    assert same([r], [r])


def test_the_fused_steps_eager_form_reads_a_list_of_registers_changed_in_place_as_a_call_does():
    def build():
        reg = Registers(a=torch.ones(2), b=torch.full((2,), 2.0))
        parts = [reg("a"), reg("b")]
        prog = REPEAT(4, SEQ([CALL(torch.cat, parts, store_to=reg("c")), CALL(torch.sin, reg("c"), store_to=reg("c"))]))
        return prog, reg, parts

    results = []
    for optimize in (False, True):
        prog, reg, parts = build()
        if optimize:
            prog = fuse_torch(prog, form="eager")
            assert prog.body.kind == "FUSED"
        drv = prog.start()
        drv.run(max_steps=2 if optimize else 4)  # one execution of the body
        parts.reverse()
        drv.run()
        results.append(reg["c"])
    assert torch.equal(results[0], torch.sin(torch.tensor([2.0, 2.0, 1.0, 1.0])))
    assert torch.equal(results[0], results[1])


def test_a_fused_step_is_the_same_function_in_every_process():
    reg = Registers(x=torch.ones(2))
    one = fuse_torch(SEQ([CALL(torch.sin, reg("x"), store_to=reg("y")), CALL(torch.cos, reg("y"), store_to=reg("y"))]),
                     form="eager")
    two = fuse_torch(SEQ([CALL(torch.sin, reg("x"), store_to=reg("y")), CALL(torch.cos, reg("y"), store_to=reg("y"))]),
                     form="eager")
    assert one.runtime().generated.filename == two.runtime().generated.filename


def test_a_fusable_function_of_the_users_gets_no_direct_form():
    from flowvm.fused import compiler

    @flowvm.fusable
    def scale(x):
        return x * 2.0

    reg = Registers(x=torch.ones(3))
    fast = fuse_torch(SEQ([CALL(torch.sin, reg("x"), store_to=reg("h")), CALL(scale, reg("h"), store_to=reg("h"))]),
                      form="eager")
    rt = fast.runtime()
    rt.settings = dataclasses.replace(rt.settings, form="auto")
    assert compiler.direct_compile(rt, (reg["x"],), inference=False) is None


def test_a_compiled_step_whose_reads_changed_says_it_runs_eagerly_and_why():
    from flowvm.fused.runtime import Runtime

    shifts = [1]
    reg = Registers(x=torch.arange(4.0))
    fast = fuse_torch(SEQ([CALL(torch.roll, reg("x"), shifts, 0, store_to=reg("h")),
                           CALL(torch.sin, reg("h"), store_to=reg("h"))]), form="compiled", background=False)
    rt = Runtime(fast)
    x = reg["x"]
    ran = []

    def kernel(args):  # stands for the compiled graph: what it computed when compiled, shifts=[1]
        ran.append("compiled")
        return (torch.sin(torch.roll(args[0], 1, 0)),) * 2

    reads = Reads.capture(rt.el.calls)
    rt._direct = (((torch.Tensor, x.dtype, x.device, x.shape, x.stride()),), kernel, None, reads)
    rt._runonly = None
    rt.compiles = rt.settings.max_compiles  # no other compile
    rt.state, rt.decision = "compiled", "forced"
    call = rt._install_direct()
    assert torch.equal(call(x)[0], torch.sin(torch.roll(x, 1, 0))) and ran == ["compiled"]
    assert rt.status() == "compiled (forced)"
    shifts[0] = 3
    assert torch.equal(rt._compiled_call(x)[0], torch.sin(torch.roll(x, 3, 0))) and ran == ["compiled"]  # eager
    assert rt.status() == "compiled (forced); eager while CALL h = torch.roll(x, [1], 0): argument 2 changed"
    shifts[0] = 1
    rt._compiled_call(x)
    assert ran == ["compiled", "compiled"] and rt.status() == "compiled (forced)"
