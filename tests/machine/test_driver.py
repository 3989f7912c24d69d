"""The driver: stepping, running, errors and retries, copying."""

from __future__ import annotations

import copy
import pickle

import cloudpickle
import pytest

from flowvm import CALL, INCOMPLETE, REPEAT, SEQ, SWITCH, WEAVE, Registers

import toy


class Flaky:
    """Raises on the calls listed in fail_on (1-based), else returns its argument."""

    def __init__(self, fail_on):
        self.calls = 0
        self.fail_on = set(fail_on)

    def __call__(self, value):
        self.calls += 1
        if self.calls in self.fail_on:
            raise ValueError(f"flaky failure on call {self.calls}")
        return value


def test_step_returns_incomplete_then_value_and_is_idempotent_when_done():
    reg = Registers(x=0)
    prog = REPEAT(3, CALL(toy.inc, reg("x"), store_to=reg("x")))
    drv = prog.start()
    assert drv.steps == 0 and not drv.done and reg["x"] == 0
    assert [drv.step() for _ in range(3)] == [INCOMPLETE, INCOMPLETE, 3]
    assert drv.done and drv.result == 3 and drv.steps == 3
    assert drv.step() == 3 and drv.run() == 3 and drv.steps == 3 and reg["x"] == 3


def test_run_max_steps_takes_at_most_k_steps():
    reg = Registers(x=0)
    drv = SEQ([REPEAT(5, CALL(toy.inc, reg("x"), store_to=reg("x"))), CALL(toy.const, "end")]).start()
    assert drv.run(max_steps=0) is INCOMPLETE and drv.steps == 0
    assert drv.run(max_steps=2) is INCOMPLETE and drv.steps == 2 and reg["x"] == 2
    assert drv.run(max_steps=3) is INCOMPLETE and drv.steps == 5
    assert drv.run(max_steps=10) == "end" and drv.steps == 6
    with pytest.raises(ValueError):
        drv.run(max_steps=-1)


def test_program_without_leaves_finishes_on_first_step():
    drv = REPEAT(0, CALL(toy.inc, 1)).start()
    assert drv.step() is None and drv.done and drv.steps == 0


@pytest.mark.parametrize("via", ["step", "run"])
def test_call_error_keeps_type_adds_note_and_retries(via):
    flaky = Flaky(fail_on=[2])
    reg = Registers()
    prog = SEQ([CALL(toy.const, 1), REPEAT(3, CALL(flaky, reg("i")), counter=reg("i"))])
    drv = prog.start()
    with pytest.raises(ValueError, match="flaky failure") as info:
        while drv.step() is INCOMPLETE if via == "step" else drv.run() is INCOMPLETE:
            pass
    notes = "\n".join(info.value.__notes__)
    assert "path '1.0'" in notes and "Flaky(i)" in notes and "step 3" in notes
    assert drv.steps == 2 and reg["i"] == 1
    blob = pickle.dumps(drv)  # still picklable after an error
    assert pickle.loads(blob).steps == 2
    assert drv.run() == 2 and drv.steps == 4 and flaky.calls == 4


@pytest.mark.parametrize("via", ["step", "run", "run-timeout", "run-max-steps"])
def test_a_repeated_seq_of_calls_fails_retries_and_pauses_like_the_general_path(via):
    """run() takes a REPEAT of a SEQ of plain CALLs in a tight loop: errors, pauses and the
    frames it leaves must be those of stepping one leaf at a time."""
    flaky = Flaky(fail_on=[2, 3, 6])  # iteration 1 fails twice, iteration 3 once

    def build():
        reg = Registers(x=0)
        return reg, SEQ([REPEAT(4, SEQ([CALL(toy.inc, reg("x"), store_to=reg("x")),
                                        CALL(flaky, reg("x"), store_to=reg("y")),
                                        CALL(toy.inc, reg("y"), store_to=reg("x"))]), counter=reg("i")),
                         CALL(toy.const, "end")])

    reg, prog = build()
    drv = prog.start()
    seen: list = []
    while True:
        try:
            if via == "step":
                value = drv.step()
            elif via == "run":
                value = drv.run()
            elif via == "run-timeout":
                value = drv.run(timeout=5)
            else:
                value = drv.run(max_steps=2)
        except ValueError as err:
            seen.append((drv.steps, drv.position, reg["i"], reg["x"], str(err), err.__notes__[-1]))
            drv = pickle.loads(pickle.dumps(drv))  # and the failed state copies
            reg = drv.registers
            continue
        if value is not INCOMPLETE:
            break
        if via == "run-max-steps":
            seen.append((drv.steps, drv.position, reg["i"], dict(reg)))
    assert value == "end" and drv.steps == 13 and (reg["i"], reg["x"], reg["y"]) == (4, 8, 7)
    errors = [s for s in seen if len(s) == 6]
    assert [s[:4] for s in errors] == [(4, "0.0.1", 1, 3), (4, "0.0.1", 1, 3), (10, "0.0.1", 3, 7)]
    assert all("path '0.0.1'" in s[5] for s in errors)
    if via == "run-max-steps":
        pauses = [s for s in seen if len(s) == 4]
        assert [p[:2] for p in pauses] == [(2, "0.0.2"), (4, "0.0.1"), (6, "0.0.0"), (8, "0.0.2"),
                                           (10, "0.0.1"), (12, "1")]
        assert [p[2] for p in pauses] == [0, 1, 2, 2, 3, 4]  # the counter after each finished iteration


def test_error_inside_weave_does_not_move_the_turn():
    reg = Registers(log=[])
    flaky = Flaky(fail_on=[2])
    prog = WEAVE(-1, [REPEAT(3, CALL(toy.record, reg("log"), "a")),
                      REPEAT(3, CALL(lambda log: log.append(flaky("b")), reg("log")))])
    drv = prog.start()
    drv.run(max_steps=3)  # a b a
    with pytest.raises(ValueError):
        drv.step()  # b fails
    assert drv.steps == 3
    drv.run()
    assert "".join(reg["log"]) == "ababab"


def test_transition_error_is_retried_with_steps_unchanged():
    reg = Registers(n="three")
    prog = SEQ([CALL(toy.const, 0), REPEAT(reg("n"), CALL(toy.const, 1))])
    drv = prog.start()
    assert drv.step() is INCOMPLETE and drv.steps == 1
    with pytest.raises(TypeError, match="register 'n' holds str") as info:
        drv.step()
    assert "entering REPEAT n at path '1'" in "\n".join(info.value.__notes__)
    assert drv.steps == 1
    copy.deepcopy(drv)
    reg["n"] = 2
    assert drv.run() == 1 and drv.steps == 3


def test_missing_register_names_register_and_path():
    reg = Registers(x=1)
    prog = SEQ([CALL(toy.inc, reg("x"), store_to=reg("y")), CALL(toy.inc, reg("y"))])
    drv = prog.start()
    drv.step()
    del reg["y"]
    with pytest.raises(KeyError) as info:
        drv.step()
    assert "'y'" in str(info.value) and "path '1'" in "\n".join(info.value.__notes__)


@pytest.mark.parametrize("how", ["pickle", "cloudpickle", "deepcopy"])
def test_copies_resume_where_the_original_stopped(how):
    reg = Registers(x=0, log=[])
    prog = SEQ([
        REPEAT(4, CALL(lambda x: x + 1, reg("x"), store_to=reg("x"))),       # a lambda: cloudpickle/deepcopy only
        WEAVE(-1, [REPEAT(3, CALL(toy.record, reg("log"), "a")), REPEAT(2, CALL(toy.record, reg("log"), "b"))]),
        SWITCH(reg("x"), {4: CALL(toy.const, "four")}),
    ]) if how != "pickle" else SEQ([
        REPEAT(4, CALL(toy.inc, reg("x"), store_to=reg("x"))),
        WEAVE(-1, [REPEAT(3, CALL(toy.record, reg("log"), "a")), REPEAT(2, CALL(toy.record, reg("log"), "b"))]),
        SWITCH(reg("x"), {4: CALL(toy.const, "four")}),
    ])
    drv = prog.start()
    drv.run(max_steps=6)
    dup = {"pickle": lambda d: pickle.loads(pickle.dumps(d)),
           "cloudpickle": lambda d: cloudpickle.loads(cloudpickle.dumps(d)),
           "deepcopy": copy.deepcopy}[how](drv)
    assert dup.registers is not drv.registers and dup.steps == 6
    assert dup.run() == drv.run() == "four"
    assert dup.registers["log"] == drv.registers["log"] == list("ababa")
    assert dup.steps == drv.steps == 10


def test_pickled_driver_state_is_small_and_has_no_caches():
    reg = Registers(x=0)
    prog = REPEAT(10, CALL(toy.inc, reg("x"), store_to=reg("x")))
    drv = prog.start()
    drv.run(max_steps=4)
    assert "_c_leaf" in prog.body.__dict__  # a compiled call cache exists...
    clone = pickle.loads(pickle.dumps(drv))
    assert "_c_leaf" not in clone.program.body.__dict__  # ...and does not travel
    assert clone.run() == 10


def test_driver_listing_marks_position_and_step():
    reg = Registers(x=0)
    prog = SEQ([REPEAT(3, CALL(toy.inc, reg("x"), store_to=reg("x"))), CALL(toy.const, "end")])
    drv = prog.start()
    drv.run(max_steps=2)
    text = str(drv)
    assert text.splitlines()[0] == "# flowvm driver: step 2, next: path '0.0'"
    assert ">>         x = inc(x)" in text and "# 2 of 3 done" in text
    assert drv.position == "0.0"
    drv.run()
    assert "finished after 4 steps" in str(drv)


def test_a_register_emptied_at_run_time_is_a_register_error_naming_it_and_the_path():
    from flowvm import PRINT, RegisterError

    for reader in (lambda reg: CALL(toy.inc, reg("x")), lambda reg: PRINT(reg("x")),
                   lambda reg: CALL(toy.const, [reg("x")])):
        reg = Registers(x=1)
        drv = SEQ([CALL(reg.pop, "x"), reader(reg)]).start()
        with pytest.raises(RegisterError, match="register 'x' holds no value when") as err:
            drv.run()
        assert err.value.register == "x" and err.value.path == "1" and drv.steps == 1
        reg["x"] = 5
        drv.run()  # retried once the register holds a value
        assert drv.done and drv.steps == 2


def test_keyword_arguments_named_like_python_keywords():
    assert CALL(dict, **{"from": 1, "class": 2}).run() == {"from": 1, "class": 2}


class Interrupting:
    """Raises exc (KeyboardInterrupt, SystemExit) on the calls listed in fail_on, as Ctrl-C in a notebook or a
    sys.exit() in the user's code would; else adds one."""

    def __init__(self, exc, fail_on):
        self.exc, self.fail_on, self.calls = exc, set(fail_on), 0

    def __call__(self, x):
        self.calls += 1
        if self.calls in self.fail_on:
            raise self.exc()
        return x + 1


def interrupted_program(shape, fn):
    reg = Registers(x=0, y=0)
    call = CALL(fn, reg("x"), store_to=reg("x"))
    if shape == "repeat-leaf":
        return REPEAT(40, call)
    if shape == "repeat-seq":
        return REPEAT(20, SEQ([call, CALL(toy.inc, reg("y"), store_to=reg("y"))]))
    if shape == "woven":
        return WEAVE(1, [REPEAT(20, SEQ([call, CALL(toy.inc, reg("y"), store_to=reg("y"))])),
                         REPEAT(100, CALL(toy.inc, reg("y"), store_to=reg("y")))], weights=[1, 0.1])
    return SEQ([SEQ([call, SEQ([CALL(toy.inc, reg("y"), store_to=reg("y")), call])]) for _ in range(15)])


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("shape", ["repeat-leaf", "repeat-seq", "woven", "general"])
@pytest.mark.parametrize("via", ["step", "run", "run-timeout", "run-max-steps"])
def test_keyboardinterrupt_or_systemexit_from_a_call_leaves_the_driver_consistent(exc, shape, via):
    """The leaf that raised has not run: the step count, the frames and the registers are those before it,
    a copy made then resumes, and the next step retries the leaf."""
    straight = interrupted_program(shape, Interrupting(exc, [])).start()
    straight.run()
    fn = Interrupting(exc, [5, 6, 17])
    drv = interrupted_program(shape, fn).start()
    raised = []
    while not drv.done:
        before = (drv.steps, drv.position, dict(drv.registers))
        try:
            if via == "step":
                drv.step()
            elif via == "run":
                drv.run()
            elif via == "run-timeout":
                drv.run(timeout=5)
            else:
                drv.run(max_steps=3)
        except exc:
            raised.append(drv.steps)
            assert drv.position is not None and drv.registers["x"] == fn.calls - len(raised)
            if via == "step":
                assert (drv.steps, drv.position, dict(drv.registers)) == before
            drv = pickle.loads(pickle.dumps(drv))  # and the interrupted state copies and resumes
            fn = drv.program.find(where=lambda el: isinstance(getattr(el, "fn", None), Interrupting))[0].element.fn
    assert len(raised) == 3
    assert drv.steps == straight.steps and dict(drv.registers) == dict(straight.registers)


def test_remaining_runs_counts_what_the_repeats_around_a_leaf_have_left():
    from flowvm.machine.live import remaining_runs

    seen = []
    reg = Registers()
    prog = REPEAT(4, SEQ([REPEAT(3, CALL(lambda: seen.append(remaining_runs()))), CALL(toy.const, 0)]))
    drv = prog.start()
    while drv.step() is INCOMPLETE:
        pass
    assert seen == list(range(12, 0, -1))
    seen.clear()
    looped = SEQ([CALL(lambda: seen.append(remaining_runs()))])
    looped.run()
    assert seen == [1] and remaining_runs() is None  # no driver running here
    assert reg is not None
