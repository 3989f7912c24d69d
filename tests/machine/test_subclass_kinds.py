"""A subclass of an element kind is that kind everywhere: the machine (WEAVE turns, fast paths or the general
path), the state files' frame layouts, hot patches, the analyses.  Every kind is subclassed and the program run
straight, step by step, and cut at every step and copied (pickle, checkpoint, state file): the same registers,
result and step count as the kinds themselves."""

from __future__ import annotations

import pickle

import pytest

import flowvm
from flowvm import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Registers
from flowvm.testing import diff, outcome
import toy


class MyCALL(CALL): pass          # noqa: E701  (module level: they pickle by reference)
class MyPRINT(PRINT): pass        # noqa: E701
class MySEQ(SEQ): pass            # noqa: E701
class MyREPEAT(REPEAT): pass      # noqa: E701
class MyLOOP(LOOP): pass          # noqa: E701
class MyWHILE(WHILE): pass        # noqa: E701
class MySWITCH(SWITCH): pass      # noqa: E701
class MyWEAVE(WEAVE): pass        # noqa: E701
class MyBUFFER(BUFFER): pass      # noqa: E701


PLAIN = dict(CALL=CALL, PRINT=PRINT, SEQ=SEQ, REPEAT=REPEAT, LOOP=LOOP, WHILE=WHILE, SWITCH=SWITCH, WEAVE=WEAVE,
             BUFFER=BUFFER)
MINE = dict(CALL=MyCALL, PRINT=MyPRINT, SEQ=MySEQ, REPEAT=MyREPEAT, LOOP=MyLOOP, WHILE=MyWHILE, SWITCH=MySWITCH,
            WEAVE=MyWEAVE, BUFFER=MyBUFFER)


def program(k):
    reg = Registers(a=0, b=0, w=0, log=[])
    inc_a = k["CALL"](toy.inc, reg("a"), store_to=reg("a"))
    return k["SEQ"]([
        k["WEAVE"](1, [k["LOOP"](inc_a), k["REPEAT"](5, k["CALL"](toy.inc, reg("b"), store_to=reg("b")))]),
        k["REPEAT"](3, k["SEQ"]([k["CALL"](toy.inc, reg("a"), store_to=reg("a")),
                                 k["CALL"](toy.record, reg("log"), reg("a"))]), counter=reg("i")),
        k["WHILE"](k["CALL"](toy.below, reg("w"), 3, store_to=reg("w")),
                   k["CALL"](toy.mix, reg("a"), reg("w"), store_to=reg("a"))),
        k["SWITCH"](k["CALL"](toy.mod3, reg("a")), {0: k["CALL"](toy.inc, reg("a"), store_to=reg("a")),
                                                    1: k["PRINT"]("one", reg("a")),
                                                    2: k["CALL"](toy.record, reg("log"), 2)}),
        k["WEAVE"](1, [k["REPEAT"](4, k["CALL"](toy.inc, reg("b"), store_to=reg("b"))),
                       k["LOOP"](k["CALL"](toy.record, reg("log"), -1))], weights=[2, 1]),
        k["BUFFER"](3, k["CALL"](toy.inc, reg("b")), store_to=reg("buf")),
        k["CALL"](toy.total, reg("log")),
    ])


def _straight(kinds):
    drv = program(kinds).start()
    drv.run(max_steps=1000)  # a WEAVE subclass taken for another kind never let its LOOP go
    assert drv.done, f"{drv.steps} steps and not finished: {dict(drv.registers)}"
    return outcome(drv)


def test_every_kind_subclassed_runs_as_the_kind():
    want = _straight(PLAIN)
    assert want["steps"] < 200
    assert not diff(want, _straight(MINE))
    drv = program(MINE).start()
    while drv.step() is not flowvm.INCOMPLETE or not drv.done:
        if drv.done:
            break
    assert not diff(want, outcome(drv))


@pytest.mark.parametrize("how", ["pickle", "checkpoint", "state"])
def test_a_run_of_subclasses_cut_at_every_step_resumes_exactly(tmp_path, how):
    want = _straight(PLAIN)
    for k in range(want["steps"] + 1):
        drv = program(MINE).start()
        drv.run(max_steps=k)
        if how == "pickle":
            copy = pickle.loads(pickle.dumps(drv))
        elif how == "checkpoint":
            flowvm.save(drv, tmp_path / "c.ckpt")
            copy = flowvm.load(tmp_path / "c.ckpt")
        else:
            flowvm.save_state(drv, tmp_path / "s.safetensors")
            copy = flowvm.load_state(tmp_path / "s.safetensors", program(MINE))
        copy.run()
        assert not diff(want, outcome(copy)), (how, k)


def test_the_analyses_and_the_listing_see_the_kind():
    from flowvm.program.analysis import has_weave

    prog = program(MINE)
    assert has_weave(prog) and str(prog) == str(program(PLAIN))
    flowvm.verify(prog)
