"""The public analysis API: reads, writes, path and children of each element."""

from hypothesis import given, settings

from flowvm import BUFFER, CALL, PRINT, REPEAT, SEQ, SWITCH, WHILE, Registers
from flowvm.program.analysis import analyze, info, readers, writers
from flowvm.program.paths import get, walk
from flowvm.program.registers import iter_registers

import progen
import toy


def test_info_of_each_element_kind():
    reg = Registers(n=2, x=1, s=0, w=0)
    prog = SEQ([
        REPEAT(reg("n"), CALL(toy.inc, reg("x"), store_to=reg("x")), counter=reg("i")),
        BUFFER(2, PRINT(reg("x")), store_to=reg("b")),
        WHILE(CALL(toy.below, reg("w"), 2, store_to=reg("w")), CALL(toy.pair, reg("x"), [reg("s")])),
        SWITCH(reg("s"), {0: CALL(toy.const, 1, store_to=reg("y"))}),
    ])
    root = info(prog)
    assert root.path == () and root.parent is None and root.kind == "SEQ"
    assert root.children == ((0,), (1,), (2,), (3,))
    assert root.reads == {"n", "x", "w", "s"} and root.writes == {"i", "x", "b", "w", "y"}
    rep = info(prog, "0")
    assert rep.own_reads == {"n"} and rep.own_writes == {"i"} and rep.reads == {"n", "x"}
    assert info(prog, (1,)).own_writes == {"b"} and info(prog, "1.0").reads == {"x"}
    wh = info(prog, "2")
    assert wh.children == ((2, 0), (2, 1)) and wh.own_reads == frozenset() and wh.reads == {"w", "x", "s"}
    assert info(prog, "2.1").path_text == "2.1" and info(prog, "2.1").parent == (2,)
    assert readers(prog, "x") == [(0, 0), (1, 0), (2, 1)]
    assert writers(prog, "x") == [(0, 0)] and writers(prog, "w") == [(2, 0)]


@settings(max_examples=60, deadline=None)
@given(progen.programs(depth=4))
def test_analyze_agrees_with_the_tree(program):
    infos = analyze(program)
    assert [i.path for i in infos] == [p for p, _ in walk(program)]
    for i in infos:
        assert get(program, i.path) is i.element
        assert [get(program, c) for c in i.children] == list(i.element.children)
        own_r = {r.name for r in i.element.own_reads()}
        assert i.own_reads == own_r
        # a subtree reads what its elements read themselves, nothing else
        inside = [j for j in infos if j.path[: len(i.path)] == i.path]
        assert i.reads == frozenset().union(*(j.own_reads for j in inside))
        assert i.writes == frozenset().union(*(j.own_writes for j in inside))
        if isinstance(i.element, CALL):
            names = {r.name for r in iter_registers((i.element.args, i.element.kwargs))}
            assert i.own_reads == names
