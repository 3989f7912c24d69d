"""A program's error shows the program's own frames: of flowvm's machine only the driver's entry point and the
frame that raises remain, whichever path (fast or general) ran the leaf."""

from __future__ import annotations

import traceback

import pytest

from flowvm import CALL, REPEAT, SEQ, WEAVE, Registers


def inner(x):
    return 1 / x


def step(x):
    return inner(x - 3)


def bump(x):
    return x + 1


def _programs():
    reg = Registers(x=0)
    yield "a REPEAT of a SEQ (fast path)", REPEAT(5, SEQ([CALL(step, reg("x")), CALL(bump, reg("x"), store_to=reg("x"))]))
    reg = Registers(x=0)
    yield "a WEAVE (general path)", WEAVE(1, [REPEAT(5, SEQ([CALL(step, reg("x")), CALL(bump, reg("x"), store_to=reg("x"))]))])


@pytest.mark.parametrize("how", ["run", "step"])
@pytest.mark.parametrize("name, program", list(_programs()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_traceback_holds_the_programs_frames_and_two_of_the_machines(name, program, how):
    drv = program.start()
    with pytest.raises(ZeroDivisionError) as caught:
        if how == "run":
            drv.run()
        else:
            while True:
                drv.step()
    frames = traceback.extract_tb(caught.value.__traceback__)
    mine = [f.name for f in frames if f.filename == __file__]
    machine = [f for f in frames if "flowvm" in f.filename.replace("\\", "/").split("/tests/")[0] and f.filename != __file__]
    assert mine[-2:] == ["step", "inner"]
    assert len(machine) <= 2, [f"{f.filename}:{f.name}" for f in machine]
    assert any("while running CALL step(x)" in note for note in caught.value.__notes__)
