"""Static verification: unwritten register reads and loops that cannot step."""

from __future__ import annotations

import pytest

from flowvm import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Registers, VerifyError, verify

import toy


def test_read_before_any_write_is_reported_with_register_and_path():
    reg = Registers()
    prog = SEQ([CALL(toy.const, 1, store_to=reg("x")), CALL(toy.add, reg("x"), reg("y"))])
    with pytest.raises(VerifyError) as info:
        verify(prog)
    err = info.value
    assert err.register == "y" and err.path == "1"
    assert "register 'y' is read by CALL add(x, y)" in str(err)
    assert ">>     add(x, y)  # here" in str(err)  # the program is reprinted with the fault marked
    with pytest.raises(VerifyError):
        prog.start()  # start() verifies too


def test_registers_holding_values_count_as_written():
    reg = Registers(y=2)
    verify(SEQ([CALL(toy.add, reg("y"), reg("y"))]))


def test_a_write_on_some_path_is_enough():
    reg = Registers(m=0)
    prog = SEQ([SWITCH(reg("m"), {0: CALL(toy.const, 1, store_to=reg("x"))}, default=CALL(toy.const, 2)),
                CALL(toy.inc, reg("x"))])
    verify(prog)
    weave = WEAVE(-1, [CALL(toy.inc, reg("z")), CALL(toy.const, 3, store_to=reg("z"))])
    verify(weave)  # a sibling may write z first


def test_loop_body_reading_its_own_later_write_fails_on_first_iteration():
    reg = Registers()
    prog = REPEAT(3, SEQ([CALL(toy.inc, reg("x")), CALL(toy.const, 1, store_to=reg("x"))]))
    with pytest.raises(VerifyError, match="'x'"):
        verify(prog)
    ok = SEQ([CALL(toy.const, 0, store_to=reg("x")), prog])
    verify(ok)


def test_counters_and_buffers_write_their_registers():
    reg = Registers()
    verify(SEQ([REPEAT(2, CALL(toy.inc, reg("i")), counter=reg("i")),
                BUFFER(2, CALL(toy.const, 1), store_to=reg("b")), PRINT(reg("b"))]))
    with pytest.raises(VerifyError, match="'n'"):
        verify(REPEAT(reg("n"), CALL(toy.const, 1)))
    with pytest.raises(VerifyError, match="'sel'"):
        verify(SWITCH(reg("sel"), {}, default=CALL(toy.const, 1)))


def test_a_body_repeated_zero_times_writes_nothing():
    reg = Registers()
    with pytest.raises(VerifyError, match="'q'"):
        verify(SEQ([REPEAT(0, CALL(toy.const, 1, store_to=reg("q"))), CALL(toy.inc, reg("q"))]))
    with pytest.raises(VerifyError, match="'q'"):
        verify(SEQ([BUFFER(0, CALL(toy.const, 1, store_to=reg("q")), store_to=reg("b")), CALL(toy.inc, reg("q"))]))
    verify(SEQ([BUFFER(0, CALL(toy.const, 1), store_to=reg("b")), PRINT(reg("b"))]))  # an empty buffer is stored
    verify(SEQ([REPEAT(0, CALL(toy.inc, reg("i")), counter=reg("i")), PRINT(reg("i"))]))  # the counter holds 0
    never = REPEAT(0, CALL(toy.const, 1, store_to=reg("q")))
    for inside in (WEAVE(-1, [never, CALL(toy.const, 2)]), REPEAT(3, never), LOOP(SEQ([never, CALL(toy.const, 2)])),
                   SEQ([WEAVE(0, [CALL(toy.const, 1, store_to=reg("q"))])])):  # nested: still never written
        prog = SEQ([inside, CALL(toy.inc, reg("q"))]) if type(inside) is not LOOP \
            else WEAVE(1, [CALL(toy.const, 3), SEQ([inside, CALL(toy.inc, reg("q"))])])
        with pytest.raises(VerifyError, match="'q'"):
            verify(prog)
    from flowvm import SPAWN

    with pytest.raises(VerifyError, match="'q'"):  # inside a fragment run elsewhere, too
        verify(SEQ([SPAWN(never, store_to=reg("s")), CALL(toy.inc, reg("q"))]))
    verify(SEQ([SPAWN(never, store_to=reg("s")), PRINT(reg("s"))]))  # the SPAWN's own value is stored
    verify(SEQ([SPAWN(never, store_to=reg("q")), PRINT(reg("q"))]))  # also where the fragment writes it too


def test_while_condition_sees_only_earlier_writes():
    reg = Registers()
    with pytest.raises(VerifyError, match="'k'"):
        verify(WHILE(CALL(toy.inc, reg("k")), CALL(toy.const, 1, store_to=reg("k"))))
    reg["k"] = 0
    verify(WHILE(CALL(toy.below, reg("k"), 3, store_to=reg("k")), CALL(toy.inc, reg("k"))))


@pytest.mark.parametrize("prog", [
    LOOP(SEQ([])),
    LOOP(REPEAT(0, CALL(toy.const, 1))),
    WEAVE(1, [LOOP(WEAVE(0, [CALL(toy.const, 1)])), CALL(toy.const, 1)]),
    WHILE(CALL(toy.const, False), SEQ([])),
])
def test_loops_that_can_never_step(prog):
    with pytest.raises(VerifyError, match="can never take a step"):
        verify(prog)


def test_a_weave_that_needs_no_child_to_finish_writes_nothing():
    reg = Registers()
    with pytest.raises(VerifyError, match="'x'"):
        verify(SEQ([WEAVE(0, [CALL(toy.const, 1, store_to=reg("x"))]), CALL(toy.inc, reg("x"))]))


def test_a_read_inside_a_spawned_fragment_is_reported_at_the_reader():
    from flowvm import SPAWN

    reg = Registers()
    with pytest.raises(VerifyError, match=r"read by CALL inc\(missing\)") as err:
        verify(SEQ([CALL(toy.const, 1), SPAWN(SEQ([CALL(toy.const, 2), CALL(toy.inc, reg("missing"))]))]))
    assert err.value.path == "1.0.1" and err.value.register == "missing"
