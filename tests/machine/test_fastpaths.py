"""The fast paths (flowvm/machine/fastpaths.py) leave exactly the frames, registers and positions the general
path leaves, inside WEAVEs too, whatever the step limits: checked against the driver with them turned off."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowvm
from flowvm import CALL, LOOP, REPEAT, SEQ, WEAVE, Registers
from flowvm.machine import fastpaths
from flowvm.program.paths import walk
from flowvm.testing import diff, outcome

import progen
import toy


def snapshot(drv) -> tuple:
    """Everything a step leaves that a later step or a copy reads: the frames (elements as paths, WEAVE
    segments and credits included), the position, the step count and the registers."""
    paths = {id(el): p for p, el in walk(drv.program)}

    def norm(x):
        if isinstance(x, flowvm.Element):
            return ("element", paths[id(x)])
        if isinstance(x, (list, tuple)):
            return type(x)(norm(v) for v in x)
        return x

    return drv.steps, drv.done, drv.position, norm([fr for _, fr in drv.frame_paths()]), outcome(drv)


def general(drv, **run):
    fastpaths.ENABLED = False
    try:
        return drv.run(**run)
    finally:
        fastpaths.ENABLED = True


def assert_same_frames_in_chunks(program, chunks) -> flowvm.Driver:
    fast = copy.deepcopy(program).start()
    slow = copy.deepcopy(program).start()
    for chunk in chunks:
        fast.run(max_steps=chunk)
        general(slow, max_steps=chunk)
        a, b = snapshot(fast), snapshot(slow)
        assert a[:4] == b[:4] and not diff(a[4], b[4]), f"after {fast.steps} steps"
        if fast.done:
            break
    return fast


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(progen.programs(depth=4), st.lists(st.integers(1, 12), min_size=1, max_size=80))
def test_fast_paths_leave_the_frames_of_the_general_path(program, chunks):
    assert_same_frames_in_chunks(program, chunks + [10**9])


def woven_training(weights, steps=60):
    reg = Registers(x=0, y=0, logged=[])
    train = REPEAT(steps, SEQ([CALL(toy.inc, reg("x"), store_to=reg("x")), CALL(toy.add, reg("x"), reg("y"), store_to=reg("y"))]),
                   counter=reg("i"))
    log = LOOP(CALL(toy.record, reg("logged"), reg("y")))
    return WEAVE(1, [train, log], weights=weights)


def test_a_training_loop_woven_with_a_rare_logging_loop_takes_the_tight_loop():
    drv = assert_same_frames_in_chunks(woven_training([1, 0.05]), [1] * 50 + [7, 2, 19, 3, 10**9])
    assert drv.done and drv.registers["i"] == 60 and len(drv.registers["logged"]) >= 5
    probe = woven_training([1, 0.05]).start()
    probe.run(max_steps=3)
    assert probe.fast_path == "repeat-seq"  # inside the WEAVE, not the general path


def test_unweighted_and_heavy_weaves_of_tight_loops_match_the_general_path():
    def nest(reg, r):
        return REPEAT(5, SEQ([REPEAT(4, CALL(toy.inc, reg(r), store_to=reg(r))), CALL(toy.inc, reg(r), store_to=reg(r))]))

    for weights in (None, [3, 1], [0.5, 2.5]):
        reg = Registers(a=0, b=0, c=0)
        inner = WEAVE(-1, [nest(reg, "a"), REPEAT(7, CALL(toy.inc, reg("c"), store_to=reg("c")))], weights=weights)
        prog = WEAVE(-1, [inner, nest(reg, "b")], weights=weights)
        for chunks in ([10**9], [1] * 200, [2, 3, 5, 7, 11, 13, 17, 10**9]):
            assert assert_same_frames_in_chunks(prog, chunks).done


class _Clock:
    """A monotonic clock that moves ``tick`` seconds at each reading: a deadline then falls after a number of
    readings that the test draws, wherever the loops read it."""

    def __init__(self, ticks):
        self.now, self.ticks, self.k = 0.0, ticks, 0

    def __call__(self) -> float:
        self.now += self.ticks[self.k % len(self.ticks)]
        self.k += 1
        return self.now


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(progen.programs(depth=4), st.lists(st.floats(0.05, 3.0), min_size=1, max_size=20),
       st.lists(st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.3, 1.0]), min_size=1, max_size=9), st.booleans())
def test_runs_that_end_at_a_deadline_leave_the_frames_of_the_general_path(monkeypatch, program, timeouts, ticks,
                                                                           slices):
    """run(timeout=...) and arun()'s time slices end inside the fast paths' loops (repeat_leaf, _loop,
    _one_weave_loop) when their deadline passes: the frames they leave are those the general path leaves
    after as many steps."""
    import asyncio

    from flowvm.machine import driver as driver_module
    from flowvm.machine import idle

    clock = _Clock(ticks)
    for module in (fastpaths, driver_module, idle):
        monkeypatch.setattr(module, "monotonic", clock)
    fast = copy.deepcopy(program).start()
    slow = copy.deepcopy(program).start()
    for timeout in timeouts + [10**9]:
        if slices:  # one time slice of arun, cancelled after it
            async def one_slice():
                task = asyncio.ensure_future(fast.arun(yield_every=timeout))
                await asyncio.sleep(0)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
            asyncio.run(one_slice())
        else:
            fast.run(timeout=timeout)
        if fast.steps == 0:  # a deadline before the first step: settled into the first leaf, nothing run
            continue
        if fast.steps > slow.steps:
            general(slow, max_steps=fast.steps - slow.steps)
        a, b = snapshot(fast), snapshot(slow)
        assert a[:4] == b[:4] and not diff(a[4], b[4]), f"after {fast.steps} steps"
        if fast.done:
            break


def _deadline_shapes():
    """Each loop of fastpaths.py with a deadline: repeat_leaf, _loop (a SEQ, and several WEAVEs around),
    _one_weave_loop (one WEAVE around)."""
    def inc(reg, r):
        return CALL(toy.inc, reg(r), store_to=reg(r))

    reg = Registers(x=0, y=0, z=0)
    yield "repeat_leaf", REPEAT(40, inc(reg, "x"), counter=reg("i"))
    reg = Registers(x=0, y=0, z=0)
    yield "_loop", REPEAT(40, SEQ([inc(reg, "x"), inc(reg, "y")]), counter=reg("i"))
    reg = Registers(x=0, y=0, z=0)
    yield "_one_weave_loop", WEAVE(1, [REPEAT(40, SEQ([inc(reg, "x"), inc(reg, "y")]), counter=reg("i")),
                                       LOOP(inc(reg, "z"))], weights=[5, 1])
    reg = Registers(x=0, y=0, z=0)
    yield "_loop in several WEAVEs", WEAVE(1, [WEAVE(1, [REPEAT(40, SEQ([inc(reg, "x"), inc(reg, "y")])),
                                                         LOOP(inc(reg, "z"))], weights=[4, 1]),
                                               LOOP(inc(reg, "z"))], weights=[6, 1])


def test_each_fast_loop_ended_by_its_deadline_leaves_the_frames_of_the_general_path(monkeypatch):
    from flowvm.machine import driver as driver_module
    from flowvm.machine import idle

    for name, program in _deadline_shapes():
        for tick in (0.05, 0.1, 0.3):
            for timeout in (t for t in (0.2, 0.5, 1.0, 2.0) if t >= 3 * tick):  # a step at least, each run
                clock = _Clock([tick])
                for module in (fastpaths, driver_module, idle):
                    monkeypatch.setattr(module, "monotonic", clock)
                fast, slow = copy.deepcopy(program).start(), copy.deepcopy(program).start()
                while not fast.done:
                    before = fast.steps
                    fast.run(timeout=timeout)
                    assert fast.steps > before or fast.done, name
                    general(slow, max_steps=fast.steps - slow.steps)
                    a, b = snapshot(fast), snapshot(slow)
                    assert a[:4] == b[:4] and not diff(a[4], b[4]), f"{name}, tick {tick}, timeout {timeout}: " \
                                                                    f"after {fast.steps} steps"
