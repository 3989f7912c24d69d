"""Dispatch on element kind (flowvm.program.kinds): a table's entry by class, along the MRO, with a default;
and a container kind written outside flowvm served by every tool through the tables' defaults."""

from __future__ import annotations

import pytest

import flowvm
from flowvm import CALL, REPEAT, SEQ, WEAVE, Element, Registers
from flowvm.editing.namespaces import isolate
from flowvm.machine.frames import NEXT, START, push, register_container
from flowvm.program.analysis import can_step, static_steps
from flowvm.program.kinds import TABLES, KindTable
from flowvm.program.printer import HEADER, describe
from flowvm.views.dot import to_dot


class Base(Element):
    kind = "BASE"


class Sub(Base):
    kind = "SUB"


class SubSub(Sub):
    kind = "SUBSUB"


def test_an_entry_serves_the_subclasses_that_have_none():
    table = KindTable("test mro", None, {Base: lambda el: "base"})
    assert table[SubSub](None) == "base" and table[Sub](None) == "base"
    table.register(Sub, lambda el: "sub")  # registered later: what subclasses took from Base is looked up again
    assert table[SubSub](None) == "sub" and table[Sub](None) == "sub" and table[Base](None) == "base"


def test_a_class_with_no_entry_takes_the_default_or_is_an_error_naming_it():
    with_default = KindTable("test default", lambda el: "default", {Sub: lambda el: "sub"})
    assert with_default[Base](None) == "default" and with_default.of(SubSub())(None) == "sub"
    without = KindTable("test missing", None, {Sub: lambda el: "sub"})
    with pytest.raises(TypeError, match="BASE has no 'test missing' entry"):
        without[Base]
    assert TABLES["test default"] is with_default


def test_register_checks_its_arguments_and_works_as_a_decorator():
    table = KindTable("test register", None)
    with pytest.raises(TypeError, match="expects an element class"):
        table.register("SEQ", lambda el: 1)
    with pytest.raises(TypeError, match="must be a function"):
        table.register(Base, 3)

    @table.register(Base)
    def entry(el):
        return "decorated"

    assert table[Sub](None) == "decorated" and entry(None) == "decorated"


def test_the_moves_are_kind_tables_and_a_subclass_of_a_kind_moves_as_it():
    class MySEQ(SEQ):
        pass

    assert START[MySEQ] is START[SEQ] and NEXT[MySEQ] is NEXT[SEQ]
    reg = Registers(n=0)
    prog = MySEQ([CALL(lambda n: n + 1, reg("n"), store_to=reg("n"))] * 3)
    assert prog.run() == 3


class THRICE(Element):
    """A container kind written outside flowvm: runs its body three times."""

    kind = "THRICE"

    def __init__(self, body):
        self._init(body=body)

    @property
    def children(self):
        return (self.body,)

    def with_children(self, children):
        (body,) = children
        return THRICE(body)


def _start(driver, frame):
    frame.append(0)
    return push(driver, frame[0].body)


def _next(driver, frame, value):
    frame[1] += 1
    return push(driver, frame[0].body) if frame[1] < 3 else value


register_container(THRICE, _start, _next)


def test_a_container_written_elsewhere_is_printed_verified_analysed_edited_renamed_and_drawn():
    reg = Registers(n=0)
    inc = CALL(lambda n: n + 1, reg("n"), store_to=reg("n"))
    prog = SEQ([THRICE(inc), CALL(print, reg("n"))])
    assert [line.strip() for line in str(prog).splitlines()[:3]] == ["SEQ:", "THRICE:", "n = <lambda>(n)"]
    assert describe(prog.children[0]) == "THRICE"
    flowvm.verify(prog)
    with pytest.raises(flowvm.VerifyError, match="'m' is read"):
        flowvm.verify(THRICE(CALL(print, reg("m"))))
    assert can_step(prog.children[0]) and static_steps(prog) is None
    assert prog.find(THRICE(inc)).paths == ["0"]
    assert prog.find(THRICE(CALL(abs, reg("n"))), missing_ok=True).paths == []
    prog.at("0.0").remove()  # the body of a THRICE becomes an empty SEQ, as a REPEAT's would
    assert str(prog).splitlines()[2].strip() == "SEQ: pass"
    renamed = isolate(THRICE(inc), "a")
    assert renamed.body.store_to.name == "a.n"
    assert "THRICE" in to_dot(THRICE(inc))


def test_a_kind_written_elsewhere_can_register_its_own_entries():
    class ONCE(THRICE):
        kind = "ONCE"

    reg = Registers(n=0)
    prog = ONCE(CALL(lambda n: n + 1, reg("n"), store_to=reg("n")))
    assert str(prog).splitlines()[0] == "ONCE:"  # THRICE's (the default) before
    HEADER.register(ONCE, lambda el: "ONCE, the body three times:")
    assert str(prog).splitlines()[0] == "ONCE, the body three times:"
    assert prog.run() == 3  # it moves as THRICE


def test_the_builtin_kinds_keep_their_entries():
    reg = Registers(x=0)
    assert str(WEAVE(-1, [REPEAT(2, CALL(abs, reg("x")))], weights=[2])).splitlines()[0] == "WEAVE all of 1 (weights 2):"
    assert HEADER[REPEAT](REPEAT(3, CALL(abs, reg("x")), counter=reg("i"))) == "REPEAT 3 (counter i):"


def test_the_passes_leave_alone_what_is_inside_a_container_whose_schedule_counts_steps():
    from flowvm.passes.rewrite import SCHEDULES_BY_STEPS, under_weave

    class TURNS(THRICE):
        kind = "TURNS"

    reg = Registers(x=0)
    prog = SEQ([TURNS(SEQ([CALL(abs, reg("x"))])), WEAVE(-1, [CALL(abs, reg("x"))])])
    assert under_weave(prog) == {(1,), (1, 0)}
    SCHEDULES_BY_STEPS.register(TURNS, lambda el: True)
    assert under_weave(prog) == {(0,), (0, 0), (0, 0, 0), (1,), (1, 0)}
