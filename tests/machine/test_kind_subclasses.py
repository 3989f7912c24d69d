"""A trivial subclass of a built-in element kind is that kind (issue 35): every kind, subclassed alone or all
at once, gives the same registers, result, step count and listing as the kind itself, run straight, step by
step, and cut at every step, copied (pickle, flowvm.save, a state file) and resumed; a hot patch inside a
running subclass frame is allowed and exact; a subclass that registers moves of its own is a kind of its own."""

from __future__ import annotations

import pickle
import sys

import pytest

import flowvm
from flowvm import (BUFFER, CALL, INCOMPLETE, LOOP, POPEN, PRINT, REPEAT, SEQ, SPAWN, SWITCH, WEAVE, WHILE,
                    Registers)
from flowvm.machine.frames import push, register_container
from flowvm.program.analysis import has_weave
from flowvm.testing import diff, outcome

import toy


# module level: a program holding them pickles them by reference
class MyCALL(CALL): pass          # noqa: E701
class MyPRINT(PRINT): pass        # noqa: E701
class MySEQ(SEQ): pass            # noqa: E701
class MyREPEAT(REPEAT): pass      # noqa: E701
class MyLOOP(LOOP): pass          # noqa: E701
class MyWHILE(WHILE): pass        # noqa: E701
class MySWITCH(SWITCH): pass      # noqa: E701
class MyWEAVE(WEAVE): pass        # noqa: E701
class MyBUFFER(BUFFER): pass      # noqa: E701
class MyPOPEN(POPEN): pass        # noqa: E701
class MySPAWN(SPAWN): pass        # noqa: E701
class MyMyWEAVE(MyWEAVE): pass    # noqa: E701  (a subclass of a subclass)


KINDS = {"CALL": CALL, "PRINT": PRINT, "SEQ": SEQ, "REPEAT": REPEAT, "LOOP": LOOP, "WHILE": WHILE,
         "SWITCH": SWITCH, "WEAVE": WEAVE, "BUFFER": BUFFER}
MINE = {"CALL": MyCALL, "PRINT": MyPRINT, "SEQ": MySEQ, "REPEAT": MyREPEAT, "LOOP": MyLOOP, "WHILE": MyWHILE,
        "SWITCH": MySWITCH, "WEAVE": MyWEAVE, "BUFFER": MyBUFFER}
ALL = dict(MINE, WEAVE=MyMyWEAVE)


def only(name):
    """The built-in kinds, with the one named replaced by its subclass."""
    return dict(KINDS, **{name: MINE[name]})


# ---------------------------------------------------------------- small programs, each over a table of kinds
def weave_of_loop_and_repeat(k, reg):
    """The issue's program: the WEAVE ends when its REPEAT does (the LOOP never would)."""
    return k["WEAVE"](1, [k["LOOP"](k["CALL"](toy.inc, reg("a"), store_to=reg("a"))),
                          k["REPEAT"](5, k["CALL"](toy.inc, reg("b"), store_to=reg("b")))])


def nested(k, reg):
    return k["SEQ"]([
        k["REPEAT"](3, k["SEQ"]([k["CALL"](toy.inc, reg("a"), store_to=reg("a")),
                                 k["REPEAT"](2, k["CALL"](toy.record, reg("log"), reg("a")), counter=reg("j"))]),
                    counter=reg("i")),
        k["WEAVE"](-1, [k["REPEAT"](4, k["SEQ"]([k["CALL"](toy.inc, reg("b"), store_to=reg("b")),
                                                  k["PRINT"]("b", reg("b"))])),
                        k["WEAVE"](1, [k["LOOP"](k["CALL"](toy.record, reg("log"), -1)),
                                       k["REPEAT"](3, k["CALL"](toy.mix, reg("a"), reg("b"), store_to=reg("a")))])],
                   weights=[2, 1]),
        k["CALL"](toy.total, reg("log")),
    ])


def buffered(k, reg):
    return k["SEQ"]([
        k["REPEAT"](2, k["BUFFER"](3, k["CALL"](toy.inc, reg("b"), store_to=reg("b")), store_to=reg("buf"))),
        k["WEAVE"](-1, [k["BUFFER"](2, k["SEQ"]([k["CALL"](toy.inc, reg("a"), store_to=reg("a")),
                                                 k["CALL"](toy.mix, reg("a"), reg("b"))]), store_to=reg("pairs")),
                        k["REPEAT"](3, k["CALL"](toy.record, reg("log"), reg("a")))]),
        k["CALL"](toy.pair, reg("buf"), reg("pairs")),
    ])


def switched(k, reg):
    cases = {0: k["CALL"](toy.inc, reg("a"), store_to=reg("a")),
             1: k["SEQ"]([k["PRINT"]("one", reg("a")), k["CALL"](toy.mix, reg("a"), 1, store_to=reg("a"))]),
             2: k["REPEAT"](2, k["CALL"](toy.record, reg("log"), reg("a")))}
    return k["REPEAT"](6, k["SEQ"]([
        k["SWITCH"](k["CALL"](toy.mod3, reg("a")), cases),
        k["SWITCH"](reg("i"), {0: k["PRINT"]("zero"), 3: k["CALL"](toy.inc, reg("b"), store_to=reg("b"))},
                    default=k["SEQ"]([])),
    ]), counter=reg("i"))


def whiled(k, reg):
    return k["SEQ"]([
        k["WHILE"](k["CALL"](toy.below, reg("w"), 3, store_to=reg("w")),
                   k["SEQ"]([k["CALL"](toy.mix, reg("a"), reg("w"), store_to=reg("a")),
                             k["WHILE"](k["CALL"](toy.below, reg("v"), 2, store_to=reg("v")),
                                        k["CALL"](toy.record, reg("log"), reg("v")))])),
        k["WEAVE"](1, [k["WHILE"](k["CALL"](toy.below, reg("u"), 4, store_to=reg("u")),
                                  k["CALL"](toy.inc, reg("b"), store_to=reg("b"))),
                       k["LOOP"](k["CALL"](toy.record, reg("log"), reg("u")))]),
        k["CALL"](toy.total, reg("log")),
    ])


PROGRAMS = {f.__name__: f for f in (weave_of_loop_and_repeat, nested, buffered, switched, whiled)}


def build(name, kinds):
    reg = Registers(a=0, b=0, w=0, v=0, u=0, log=[])
    return PROGRAMS[name](kinds, reg)


def straight(prog):
    drv = prog.start()
    drv.run(max_steps=1000)
    assert drv.done, f"not finished after {drv.steps} steps: {dict(drv.registers)}"
    return outcome(drv)


def stepwise(prog):
    """Run one step at a time; what each step left: the step count, the registers, the listing."""
    drv = prog.start()
    seen = []
    while not drv.done and drv.steps < 1000:
        assert drv.step() is not INCOMPLETE or not drv.done
        seen.append((drv.steps, repr(dict(drv.registers)), str(drv)))
    assert drv.done
    return outcome(drv), seen


# ---------------------------------------------------------------- the tests
def test_every_builtin_kind_and_its_subclasses_say_their_kind():
    for name, kind in [*KINDS.items(), ("POPEN", POPEN), ("SPAWN", SPAWN)]:
        assert kind.frame_kind is kind, name
    for mine in [*MINE.values(), MyPOPEN, MySPAWN]:
        assert mine.frame_kind is mine.__mro__[1], mine
    assert MyMyWEAVE.frame_kind is WEAVE
    assert flowvm.Element.frame_kind is None and flowvm.Leaf.frame_kind is None


def test_the_issue_weave_of_a_subclass_finishes():
    reg = Registers(a=0, b=0)
    drv = MyWEAVE(1, [LOOP(CALL(toy.inc, reg("a"), store_to=reg("a"))),
                      REPEAT(5, CALL(toy.inc, reg("b"), store_to=reg("b")))]).start()
    drv.run(max_steps=1000)
    assert drv.done and drv.steps == 10 and reg["a"] == 5 and reg["b"] == 5


@pytest.mark.parametrize("kinds", [*KINDS, "all"])
@pytest.mark.parametrize("name", PROGRAMS)
def test_a_subclass_runs_as_its_kind_straight_and_step_by_step(name, kinds):
    table = ALL if kinds == "all" else only(kinds)
    want = straight(build(name, KINDS))
    assert want["steps"] < 200
    prog = build(name, table)
    assert str(prog) == str(build(name, KINDS)) and has_weave(prog) == has_weave(build(name, KINDS))
    flowvm.verify(prog)
    assert not diff(want, straight(prog))
    assert not diff(want, straight(flowvm.optimize(build(name, table))))  # the passes see the kinds too
    want_steps = stepwise(build(name, KINDS))
    got_steps = stepwise(build(name, table))
    assert not diff(want_steps[0], got_steps[0])
    assert got_steps[1] == want_steps[1]  # the same registers and listing (frames, counters) after every step


@pytest.mark.parametrize("how", ["pickle", "checkpoint", "state"])
@pytest.mark.parametrize("name", PROGRAMS)
def test_a_run_of_subclasses_cut_at_every_step_resumes_exactly(tmp_path, name, how):
    want = straight(build(name, KINDS))
    for k in range(want["steps"] + 1):
        drv = build(name, ALL).start()
        drv.run(max_steps=k)
        if how == "pickle":
            copy = pickle.loads(pickle.dumps(drv))
        elif how == "checkpoint":
            flowvm.save(drv, tmp_path / "run.ckpt")
            copy = flowvm.load(tmp_path / "run.ckpt")
        else:
            flowvm.save_state(drv, tmp_path / "run.safetensors")
            copy = flowvm.load_state(tmp_path / "run.safetensors", build(name, ALL))
        assert str(copy) == str(drv), (how, k)
        copy.run(max_steps=1000)
        assert not diff(want, outcome(copy)), (how, k)


def test_a_state_file_of_subclasses_loads_into_the_plain_kinds_and_back(tmp_path):
    """The state file names frames by kind and slot, so the program it is loaded into may use either."""
    want = straight(build("nested", KINDS))
    for k in range(0, want["steps"] + 1, 3):
        for saved, loaded in ((ALL, KINDS), (KINDS, ALL)):
            drv = build("nested", saved).start()
            drv.run(max_steps=k)
            flowvm.save_state(drv, tmp_path / "run.safetensors")
            copy = flowvm.load_state(tmp_path / "run.safetensors", build("nested", loaded))
            copy.run(max_steps=1000)
            assert not diff(want, outcome(copy)), k


def hook(log, tag, value):
    log.append((tag, value))


def hooked(kinds, k, patch):
    """nested() over kinds, run k steps, then patched (what an edit refused says, if it was), then finished."""
    reg = Registers(a=0, b=0, w=0, v=0, u=0, log=[], hooks=[])
    drv = nested(kinds, reg).start()
    drv.run(max_steps=k)
    try:
        patch(drv, reg)
    except flowvm.EditError as err:
        reg["hooks"].append(("refused", str(err)))
    drv.run(max_steps=1000)
    assert drv.done
    return outcome(drv)


PATCHES = {
    # inside the SEQ the first REPEAT repeats (a SEQ, or a MySEQ, whose frame is running)
    "seq": lambda drv, reg: drv.at("0.0.0").insert_after(CALL(hook, reg("hooks"), "a", reg("a"))),
    # inside the first child of the WEAVE (paused or running)
    "weave": lambda drv, reg: drv.at("1.0.0.0").insert_after(CALL(hook, reg("hooks"), "b", reg("b"))),
    # inside the inner WEAVE's REPEAT (a REPEAT inside two WEAVEs)
    "inner weave": lambda drv, reg: drv.at("1.1.1.0").insert_before(CALL(hook, reg("hooks"), "a", reg("a"))),
    # the leaf the driver waits at or has run, replaced
    "replace": lambda drv, reg: drv.at("1.0.0.1").replace_with(PRINT("B", reg("b"))),
}


@pytest.mark.parametrize("where", PATCHES)
def test_a_hot_patch_inside_running_subclass_frames_is_exact(where):
    patch = PATCHES[where]
    total = straight(build("nested", KINDS))["steps"]
    patched = 0
    for k in range(total + 1):
        want = hooked(KINDS, k, patch)
        got = hooked(ALL, k, patch)
        assert not diff(want, got), k
        patched += not any(h[0] == "refused" for h in got["registers"]["hooks"])
    assert patched > total // 2


# a subclass that registers moves of its own is a kind of its own: it runs its children in order, once each,
# with a frame [element, children done] that is not a WEAVE's
class InOrderWEAVE(WEAVE):
    pass


def _start_in_order(drv, fr):
    fr.append(0)
    return push(drv, fr[0].elements[0])


def _next_in_order(drv, fr, value):
    fr[1] += 1
    return push(drv, fr[0].elements[fr[1]]) if fr[1] < len(fr[0].elements) else value


register_container(InOrderWEAVE, _start_in_order, _next_in_order)


def test_a_subclass_with_moves_of_its_own_is_a_kind_of_its_own():
    assert InOrderWEAVE.frame_kind is None and WEAVE.frame_kind is WEAVE and MyWEAVE.frame_kind is WEAVE
    reg = Registers(log=[])

    def program():
        return InOrderWEAVE(-1, [REPEAT(3, CALL(toy.record, reg("log"), "x")),
                                 REPEAT(2, CALL(toy.record, reg("log"), "y"))])

    drv = program().start()
    assert drv.run() == "y" and drv.steps == 5 and reg["log"] == ["x"] * 3 + ["y"] * 2
    for k in range(6):
        reg["log"].clear()
        drv = program().start()
        drv.run(max_steps=k)
        copy = pickle.loads(pickle.dumps(drv))
        copy.run()
        assert copy.steps == 5 and copy.registers["log"] == ["x"] * 3 + ["y"] * 2


def test_a_popen_subclass_runs_as_popen():
    reg = Registers(rc=None)
    prog = SEQ([MyPOPEN([sys.executable, "-c", "raise SystemExit(3)"], store_to=reg("rc")),
                CALL(toy.inc, reg("rc"), store_to=reg("rc"))])
    drv = prog.start()
    drv.run()
    assert drv.done and reg["rc"] == 4


def _runs_left(log):
    from flowvm.machine.live import remaining_runs

    log.append(remaining_runs())


def test_the_runs_left_that_a_leaf_sees_count_subclassed_loops():
    def runs_left(k):
        reg = Registers(log=[], w=0)
        leaf = CALL(_runs_left, reg("log"))
        prog = k["SEQ"]([k["REPEAT"](2, k["BUFFER"](3, leaf)), k["WEAVE"](-1, [k["REPEAT"](2, leaf)]),
                         k["WHILE"](CALL(toy.below, reg("w"), 1, store_to=reg("w")), leaf)])
        drv = prog.start()
        drv.run(max_steps=100)
        assert drv.done
        return reg["log"]

    want = runs_left(KINDS)
    assert want == [6, 5, 4, 3, 2, 1, None, None, None] and runs_left(ALL) == want


@pytest.mark.parametrize("shape", ["leaf", "seq", "woven"])
def test_the_fast_paths_take_subclasses_of_repeat_and_seq_as_their_kinds(monkeypatch, shape):
    # Driver._prepare asks the frame's kind (frame_kind), so a subclass that keeps its kind's moves runs on the
    # same fast loops, as often, as the kind itself
    from flowvm.machine import driver as driver_module

    def program(k, reg):
        body = k["CALL"](toy.inc, reg("a"), store_to=reg("a"))
        if shape != "leaf":
            body = k["SEQ"]([body, k["CALL"](toy.inc, reg("b"), store_to=reg("b"))])
        loop = k["REPEAT"](40, body)
        return k["WEAVE"](1, [loop, k["REPEAT"](3, k["CALL"](toy.inc, reg("c"), store_to=reg("c")))], weights=[8, 1]) \
            if shape == "woven" else loop

    def counted(k):
        calls = []
        for name in ("repeat_leaf", "repeat_seq", "repeat_woven"):
            real = getattr(driver_module, name)
            monkeypatch.setattr(driver_module, name,
                                lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
        drv = program(k, Registers(a=0, b=0, c=0)).start()
        drv.run()
        monkeypatch.undo()
        return calls, outcome(drv)

    want_calls, want = counted(KINDS)
    got_calls, got = counted(ALL)
    assert want_calls and got_calls == want_calls
    assert not diff(want, got)


def test_the_passes_flatten_and_explain_subclasses_as_their_kinds():
    from flowvm.passes.explain import explain_fusion

    def program(k, reg):
        return k["SEQ"]([k["SEQ"]([k["CALL"](toy.inc, reg("a"), store_to=reg("a"))]),
                         k["SEQ"]([k["CALL"](toy.inc, reg("a"), store_to=reg("a")),
                                   k["PRINT"](reg("a"))])])

    plain, mine = program(KINDS, Registers(a=0)), program(ALL, Registers(a=0))
    flat = flowvm.optimize(plain, passes=["flatten"])
    assert str(flowvm.optimize(mine, passes=["flatten"])) == str(flat) != str(plain)
    assert explain_fusion(mine) == explain_fusion(plain)
