"""store_to=(reg('a'), reg('b')): a CALL's value unpacked into several registers, as Python's ``a, b = value``."""

from __future__ import annotations

import operator
import pickle

import pytest

import flowvm
from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.testing import assert_same_run


def build():
    reg = Registers(x=7)
    return REPEAT(3, SEQ([CALL(divmod, reg("x"), 2, store_to=(reg("q"), reg("r"))),
                          CALL(operator.add, reg("q"), reg("r"), store_to=reg("x"))]))


def test_the_value_is_unpacked_and_the_run_resumes_exactly(tmp_path):
    drv = build().start()
    assert drv.run() == 1 and dict(drv.registers) == {"x": 1, "q": 1, "r": 0}  # 7 -> 3+1 -> 2+0 -> 1+0
    assert_same_run(build)
    half = build().start()
    half.run(max_steps=1)
    flowvm.save_state(half, tmp_path / "s.safetensors")
    assert flowvm.load_state(tmp_path / "s.safetensors", build()).run() == 1


def test_it_is_listed_written_back_as_source_verified_and_its_registers_known():
    prog = build()
    assert "q, r = divmod(x, 2)" in str(prog)
    assert "store_to=(reg('q'), reg('r'))" in flowvm.to_source(prog)
    assert str(flowvm.from_source(flowvm.to_source(prog))) == str(prog)
    assert {r.name for r in prog.get("0.0").own_writes()} == {"q", "r"}
    flowvm.verify(prog)
    assert "FUSED" not in str(flowvm.optimize(prog))


def test_a_value_that_does_not_unpack_raises_as_python_does_and_bad_targets_are_refused():
    reg = Registers()
    drv = CALL(lambda: (1, 2, 3), store_to=(reg("a"), reg("b"))).start()
    with pytest.raises(ValueError, match="too many values to unpack") as caught:
        drv.run()
    assert caught.value.__notes__ == ["flowvm: while running CALL a, b = <lambda>() at path '<root>' (step 1)"]
    assert drv.steps == 0 and "a" not in drv.registers
    pickle.dumps(drv)
    with pytest.raises(TypeError, match="store_to must be a Register or a tuple of Registers"):
        CALL(divmod, 1, 2, store_to=(reg("a"), "b"))
    with pytest.raises(ValueError, match="names a register twice: a, a"):
        CALL(divmod, 1, 2, store_to=(reg("a"), reg("a")))
