"""Each container kind declares its frame once (flowvm/machine/layouts.py): every frame a run makes has its
kind's layout (as many slots as it names, passing its check), the slot it names for the running child leads
to the next frame, and a subclass of a kind has its kind's layout."""

from __future__ import annotations

import pytest

from flowvm import BUFFER, CALL, LOOP, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Registers
from flowvm.machine.frames import child_index, walk
from flowvm.machine.layouts import LAYOUTS, layout_of
from flowvm.persist.stateframes import check_frame


def add(a, b):
    return a + b


def below(a, b):
    return a < b


def program():
    """Every built-in container kind, nested, over a counter."""
    reg = Registers(n=0, k=0, pick=1)
    bump = CALL(add, reg("n"), 1, store_to=reg("n"))
    tick = CALL(add, reg("k"), 1, store_to=reg("k"))
    inner = SEQ([bump, SWITCH(reg("pick"), {0: tick, 1: SEQ([tick, bump])}),
                 BUFFER(2, CALL(add, reg("n"), 0))])
    woven = WEAVE(2, [REPEAT(3, inner), WHILE(CALL(below, reg("k"), 40), tick)])
    return REPEAT(2, SEQ([woven, bump]))


@pytest.mark.parametrize("cut", range(1, 108, 7))  # the run takes 108 steps
def test_every_frame_a_run_makes_has_its_kinds_layout(cut):
    prog = program()
    drv = prog.start()
    drv.run(max_steps=cut)
    seen = set()
    for path, chain, k, _ in walk(drv.snapshot().frames):
        fr = chain[k]
        el = fr[0]
        layout = layout_of(el)
        if el.is_leaf:
            assert layout is None and len(fr) == 1
            continue
        seen.add(type(el))
        assert len(fr) in (1, layout.size), (el.kind, fr)
        check_frame(fr, drv.steps)
        if len(fr) > 1 and k + 1 < len(chain):  # the running child is the next frame's element
            assert chain[k + 1][0] is el.children[child_index(fr)]
    assert seen  # the cut lands inside containers


def test_a_loop_and_its_layout():
    reg = Registers(n=0)
    prog = LOOP(CALL(add, reg("n"), 1, store_to=reg("n")))
    drv = prog.start()
    drv.run(max_steps=5)
    fr = drv.snapshot().frames[0]
    assert len(fr) == LAYOUTS[LOOP].size
    check_frame(fr, drv.steps)


def test_every_built_in_kind_has_a_layout_and_its_subclasses_share_it():
    for kind in (SEQ, REPEAT, BUFFER, LOOP, WHILE, SWITCH, WEAVE):
        assert kind in LAYOUTS
        sub = type(f"My{kind.__name__}", (kind,), {})
        assert sub.frame_kind is kind
    reg = Registers(x=0)
    leaf = CALL(add, reg("x"), 1, store_to=reg("x"))
    MySEQ = type("MySEQ", (SEQ,), {})
    assert layout_of(MySEQ([leaf])) is LAYOUTS[SEQ] and layout_of(leaf) is None


def test_a_frame_out_of_its_layout_is_refused_naming_the_slot():
    reg = Registers(x=0)
    rep = REPEAT(3, CALL(add, reg("x"), 1, store_to=reg("x")))
    with pytest.raises(ValueError, match="its counter is 5"):
        check_frame([rep, 5, 3, None], 0)
    with pytest.raises(ValueError, match="frame has 2 slots, its layout 3"):
        check_frame([rep, 1, 3], 0)


def _twice_kind(declared: bool):
    """A container kind written outside flowvm, running its body twice (docs/containers.md), with its layout
    declared or not."""
    from flowvm import Element
    from flowvm.machine.frames import push, register_container
    from flowvm.machine.layouts import Layout, count

    class TWICE(Element):
        kind = "TWICE"
        if declared:
            frame_layout = Layout(("runs",), lambda fr, n, steps: count(fr[1], "runs", 0, 1))

        def __init__(self, body):
            self._init(body=body)

        @property
        def children(self):
            return (self.body,)

        def with_children(self, children):
            return TWICE(children[0])

    def start(driver, frame):
        frame.append(0)
        return push(driver, frame[0].body)

    def next_(driver, frame, value):
        frame[1] += 1
        return push(driver, frame[0].body) if frame[1] < 2 else value

    register_container(TWICE, start, next_)
    return TWICE


@pytest.mark.parametrize("declared", [True, False])
def test_a_kind_written_outside_declares_its_layout_once_and_state_files_hold_its_frames(tmp_path, declared):
    import flowvm

    TWICE = _twice_kind(declared)
    reg = Registers(n=0)
    prog = SEQ([TWICE(CALL(add, reg("n"), 1, store_to=reg("n"))), CALL(add, reg("n"), 100)])
    drv = prog.start()
    drv.step()
    path = tmp_path / "run.safetensors"
    if not declared:  # no layout: a state file refuses to resume the run inside it, naming the kind
        flowvm.save_state(drv, path)
        with pytest.raises(flowvm.CheckpointError, match="TWICE frame: an element kind whose frames a state "
                                                         "file does not hold"):
            flowvm.load_state(path, prog)
        return
    assert layout_of(prog.elements[0]).slots == ("runs",)
    flowvm.save_state(drv, path)
    assert drv.run() == 102
    resumed = flowvm.load_state(path, prog)
    assert resumed.steps == 1 and resumed.run() == 102
    check_frame([prog.elements[0], 1], 1)
    with pytest.raises(ValueError, match="runs is 5"):  # a frame no run reaches: refused, naming the slot
        check_frame([prog.elements[0], 5], 1)
