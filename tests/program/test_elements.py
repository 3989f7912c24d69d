"""Semantics of each element kind, as the README states them."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import flowvm
from flowvm import (BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Registers,
                    SwitchError)


def logger():
    reg = Registers(log=[])
    return reg, (lambda tag: CALL(list.append, reg("log"), tag))


def test_call_resolves_registers_everywhere_and_stores():
    reg = Registers(a=1, b=2, c=3)
    seen = []

    def f(*args, **kwargs):
        seen.append((args, kwargs))
        return "out"

    prog = CALL(f, reg("a"), [reg("b"), (reg("c"), 4)], {"k": reg("a")}, x=reg("b"), y={"z": [reg("c")]},
                store_to=reg("r"))
    assert prog.run() == "out"
    assert reg["r"] == "out"
    assert seen == [((1, [2, (3, 4)], {"k": 1}), {"x": 2, "y": {"z": [3]}})]


def test_call_reads_registers_when_it_runs_not_when_built():
    reg = Registers(x=1)
    prog = SEQ([CALL(lambda: 10, store_to=reg("x")), CALL(lambda v: v * 2, reg("x"), store_to=reg("y"))])
    reg["x"] = 5
    prog.run()
    assert reg["y"] == 20


def test_seq_value_is_last_and_empty_seq_is_none():
    assert SEQ([CALL(lambda: 1), CALL(lambda: 2)]).run() == 2
    assert SEQ([]).run() is None


def test_repeat_counter_semantics():
    reg = Registers(n=3)
    seen = []
    prog = REPEAT(reg("n"), CALL(lambda i: seen.append(i) or i * 10, reg("i")), counter=reg("i"))
    drv = prog.start()
    assert "i" not in reg  # start() runs nothing
    assert drv.run() == 20
    assert seen == [0, 1, 2]
    assert reg["i"] == 3
    assert REPEAT(0, CALL(lambda: 1), counter=reg("j")).run() is None
    assert reg["j"] == 0


def test_repeat_count_is_read_on_entry_each_time():
    reg = Registers(n=2, total=0)
    body = CALL(lambda t: t + 1, reg("total"), store_to=reg("total"))
    prog = REPEAT(3, SEQ([REPEAT(reg("n"), body), CALL(lambda n: n + 1, reg("n"), store_to=reg("n"))]))
    prog.run()
    assert reg["total"] == 2 + 3 + 4


def test_while_checks_condition_as_a_step():
    reg = Registers(k=0)
    prog = WHILE(CALL(lambda k: k < 3, reg("k")), CALL(lambda k: k + 1, reg("k"), store_to=reg("k")))
    drv = prog.start()
    assert drv.run() == 3
    assert drv.steps == 7  # 4 condition checks + 3 bodies
    assert WHILE(CALL(lambda: False), CALL(lambda: 1)).run() is None


def test_switch_on_register_and_on_call():
    reg, log = logger()
    reg["mode"] = "b"
    prog = SWITCH(reg("mode"), {"a": log("A"), "b": log("B")}, default=log("D"))
    prog.run()
    reg["mode"] = "zzz"
    prog.run()
    drv = SWITCH(CALL(lambda: 2), {1: log(1), 2: log(2)}).start()
    drv.run()
    assert reg["log"] == ["B", "D", 2]
    assert drv.steps == 2  # the selector CALL is a step


def test_switch_without_match_names_the_value():
    reg = Registers(mode="nope")
    drv = SWITCH(reg("mode"), {"a": CALL(lambda: 1)}).start()
    with pytest.raises(SwitchError, match="'nope'") as info:
        drv.step()
    assert info.value.value == "nope"
    assert drv.steps == 0
    reg["mode"] = "a"  # fixed: the next step retries
    assert drv.run() == 1


def test_weave_round_robin_and_weights():
    reg, log = logger()
    WEAVE(-1, [REPEAT(3, log("a")), REPEAT(2, log("b"))]).run()
    assert "".join(reg["log"]) == "ababa"
    reg["log"].clear()
    WEAVE(-1, [REPEAT(4, log("a")), REPEAT(3, log("b"))], weights=[2, 1]).run()
    assert "".join(reg["log"]) == "aabaabb"
    reg["log"].clear()
    WEAVE(-1, [REPEAT(2, log("a")), REPEAT(4, log("b"))], weights=[0.5, 1]).run()
    assert "".join(reg["log"]) == "babbab"


def test_weave_abandons_and_reports_values():
    reg, log = logger()
    prog = WEAVE(1, [LOOP(log("loop")), SEQ([log("x"), CALL(lambda: "done")])])
    assert prog.run() == [None, "done"]
    assert reg["log"] == ["loop", "x", "loop"]
    assert WEAVE(-1, [CALL(lambda: 1), CALL(lambda: 2)]).run() == [1, 2]
    assert WEAVE(0, [CALL(lambda: 1)]).run() == [None]
    assert WEAVE(-1, []).run() == []


def test_nested_weaves_share_turns():
    reg, log = logger()
    WEAVE(-1, [WEAVE(-1, [REPEAT(2, log("a")), REPEAT(2, log("b"))]), REPEAT(4, log("c"))]).run()
    assert "".join(reg["log"]) == "acbcacbc"


def test_buffer_stacks_arrays_and_tensors():
    counter = iter(range(100))
    arr = BUFFER(4, CALL(lambda: np.full(3, next(counter), dtype=np.float32))).run()
    assert isinstance(arr, np.ndarray) and arr.shape == (4, 3) and arr.dtype == np.float32
    scalars = BUFFER(3, CALL(lambda: np.float64(1.5))).run()
    assert isinstance(scalars, np.ndarray) and scalars.shape == (3,)
    ten = BUFFER(2, CALL(torch.zeros, 2, 5)).run()
    assert isinstance(ten, torch.Tensor) and ten.shape == (2, 2, 5)
    mixed = BUFFER(2, CALL(lambda: 1)).run()
    assert mixed == [1, 1]
    ragged = iter([np.zeros(2), np.zeros(3)])
    assert isinstance(BUFFER(2, CALL(lambda: next(ragged))).run(), list)
    reg = Registers()
    assert BUFFER(0, CALL(lambda: 1), store_to=reg("b")).run() == [] and reg["b"] == []


def test_print_prints_register_values(capsys):
    reg = Registers(loss=0.25)
    PRINT("loss", reg("loss")).run()
    assert capsys.readouterr().out == "loss 0.25\n"


def test_loop_spinning_without_steps_is_an_error():
    reg = Registers(n=0)
    prog = WEAVE(1, [LOOP(SEQ([REPEAT(reg("n"), CALL(lambda: 1))])), REPEAT(5, CALL(lambda: 2))])
    with pytest.raises(flowvm.FlowError, match="spin"):
        prog.run()


@pytest.mark.parametrize("build, exc, text", [
    (lambda: SEQ([CALL(print), "oops"]), TypeError, "element 1"),
    (lambda: SEQ(CALL(print)), TypeError, "list of elements"),
    (lambda: REPEAT(-1, CALL(print)), ValueError, ">= 0"),
    (lambda: REPEAT(2.5, CALL(print)), TypeError, "int or a Register"),
    (lambda: REPEAT(True, CALL(print)), TypeError, "int or a Register"),
    (lambda: REPEAT(2, print), TypeError, "body"),
    (lambda: BUFFER(-3, CALL(print)), ValueError, ">= 0"),
    (lambda: WEAVE(3, [CALL(print), CALL(print)]), ValueError, "only 2 children"),
    (lambda: WEAVE(-2, [CALL(print)]), ValueError, "n_required"),
    (lambda: WEAVE(1, [CALL(print)], weights=[0]), ValueError, "positive"),
    (lambda: WEAVE(1, [CALL(print)], weights=[1, 2]), ValueError, "2 weights for 1"),
    (lambda: WEAVE(1, [CALL(print)], weights=2), TypeError, "WEAVE: weights must be a sequence"),
    (lambda: WHILE(lambda: True, CALL(print)), TypeError, "cond must be a CALL"),
    (lambda: SWITCH("mode", {}), TypeError, "selector"),
    (lambda: SWITCH(Registers()("m"), {1: "x"}), TypeError, "case 1"),
    (lambda: CALL(42), TypeError, "callable"),
    (lambda: CALL(print, store_to="x"), TypeError, "store_to"),
    (lambda: LOOP(None), TypeError, "LOOP"),
])
def test_construction_errors(build, exc, text):
    with pytest.raises(exc, match=text):
        build()


def test_elements_are_immutable():
    el = CALL(print)
    with pytest.raises(AttributeError, match="immutable"):
        el.fn = len


def test_program_runs_on_its_register_file_or_a_new_one():
    reg = Registers(x=2)
    drv = CALL(lambda v: v, reg("x")).start()
    assert drv.registers is reg
    drv2 = CALL(lambda: 1).start()
    assert isinstance(drv2.registers, Registers) and not drv2.registers


def test_two_register_files_are_rejected_at_start():
    a, b = Registers(x=1), Registers(y=2)
    prog = SEQ([CALL(print, a("x")), CALL(print, b("y"))])
    with pytest.raises(flowvm.VerifyError, match="2 different register files") as err:
        prog.start()
    assert "register 'x' of file 1 at path '0'" in str(err.value)
    assert "register 'y' of file 2 at path '1'" in str(err.value) and err.value.path == "1"


def test_start_reads_no_register():
    reg = Registers(n="not yet")
    drv = REPEAT(reg("n"), CALL(lambda: 1)).start()  # would fail if start() read n
    reg["n"] = 2
    assert drv.run() == 1 and drv.steps == 2


def test_registers_inside_dict_subclasses_keep_the_subclass():
    import collections

    reg = Registers(x=1)
    got = CALL(lambda d: (type(d), d["a"], d["missing"]), collections.defaultdict(list, {"a": reg("x")})).run()
    assert got == (collections.defaultdict, 1, [])
    ordered = CALL(lambda d: d, collections.OrderedDict(b=reg("x"), a=2)).run()
    assert type(ordered) is collections.OrderedDict and list(ordered.items()) == [("b", 1), ("a", 2)]


def test_a_switch_whose_selector_call_found_no_case_runs_the_selector_again_once_the_cause_is_fixed():
    reg = Registers(s=9, log=[])
    prog = SWITCH(CALL(lambda s: s, reg("s")), {1: CALL(list.append, reg("log"), "one")})
    drv = prog.start()
    assert drv.step() is flowvm.INCOMPLETE and drv.steps == 1  # the selector ran
    with pytest.raises(SwitchError, match="selector value 9"):
        drv.step()  # the case is chosen at the start of the next step: no case
    assert drv.steps == 1
    copy_ = pickle.loads(pickle.dumps(drv))
    reg["s"] = 1
    copy_.registers["s"] = 1
    for d in (drv, copy_):
        assert d.run() is None and d.registers["log"] == ["one"] and d.steps == 3  # selector again, then case


def test_a_loop_that_spun_enters_its_body_again_once_the_cause_is_fixed():
    reg = Registers(n=0, log=[])
    prog = WEAVE(1, [REPEAT(3, CALL(list.append, reg("log"), "a")),
                     LOOP(REPEAT(reg("n"), CALL(list.append, reg("log"), "b")))])
    drv = prog.start()
    with pytest.raises(flowvm.FlowError, match="spin"):
        drv.run()
    steps = drv.steps
    reg["n"] = 1
    drv.run()
    assert drv.done and drv.steps > steps and "b" in reg["log"] and reg["log"].count("a") == 3
