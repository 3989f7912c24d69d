"""Event-loop driving: run(timeout=...), await arun(), and waiting on pending leaves instead of spinning."""

import asyncio
import concurrent.futures as cf
import pickle
import sys
import threading
import time

import pytest

import flowvm
from flowvm import CALL, INCOMPLETE, LOOP, POPEN, REPEAT, SEQ, SPAWN, WEAVE, Registers
from flowvm import PENDING
from flowvm.program.elements import Element
from flowvm.testing import outcome, same

pytestmark = pytest.mark.timeout(60)

SLEEP = [sys.executable, "-c", "import time; time.sleep(0.5)"]


def counting_program(n=2000):
    reg = Registers(x=0, y=0)
    return SEQ([REPEAT(n, CALL(lambda x: x + 1, reg("x"), store_to=reg("x")), counter=reg("i")),
                REPEAT(n // 2, SEQ([CALL(lambda x, y: x + y, reg("x"), reg("y"), store_to=reg("y")),
                                    CALL(lambda y: y % 1000, reg("y"), store_to=reg("x"))]))])


class Waiting(Element):
    """A leaf pending until its event is set, with (hook=True) or without a ready_future hook."""

    kind = "WAITING"
    is_leaf = True

    def __init__(self, event, hook):
        self._init(event=event, hook=hook)

    def bind(self, drv, frame):
        live, key, el = drv.live, id(frame), self

        def leaf():
            handle = live.get(key)
            if handle is None:
                live[key] = Handle(el.event, el.hook)
                return PENDING
            if not el.event.is_set():
                return PENDING
            del live[key]
            return "ready"

        return leaf


class Handle:
    def __init__(self, event, hook):
        self.future = cf.Future()
        threading.Thread(target=lambda: (event.wait(), self.future.set_result(None)), daemon=True).start()
        if not hook:
            self.ready_future = None

    def ready_future(self):
        return self.future


def set_later(event, seconds):
    threading.Timer(seconds, event.set).start()


# ----------------------------------------------------------------- run(timeout=...)
def test_run_with_a_timeout_returns_in_time_and_the_run_resumes_exactly():
    straight = counting_program(40000).start()
    straight.run()
    reg = Registers(n=0)
    endless = LOOP(CALL(lambda n: n + 1, reg("n"), store_to=reg("n"))).start()
    t0 = time.monotonic()
    assert endless.run(timeout=0.2) is INCOMPLETE
    assert 0.2 <= time.monotonic() - t0 < 0.5 and reg["n"] == endless.steps > 100
    drv = counting_program(40000).start()
    pieces = 0
    while drv.run(timeout=0.0005) is INCOMPLETE:
        pieces += 1
        if pieces % 7 == 0:
            drv = pickle.loads(pickle.dumps(drv))
    assert pieces > 3
    assert same(outcome(drv), outcome(straight))


@pytest.mark.parametrize("shape", ["leaf", "seq"])
def test_run_with_a_timeout_stays_in_time_when_quick_steps_turn_slow(shape):
    calls = [0]

    def work():
        calls[0] += 1
        if calls[0] > 20000:  # after many quick steps, slow ones: the deadline is still met within one step
            time.sleep(0.01)

    body = CALL(work) if shape == "leaf" else SEQ([CALL(work), CALL(work)])
    drv = REPEAT(10 ** 7, body).start()
    for _ in range(2):
        t0 = time.monotonic()
        assert drv.run(timeout=0.3) is INCOMPLETE
        assert 0.3 <= time.monotonic() - t0 < 1.0
    assert drv.steps == calls[0]


def test_run_timeout_and_max_steps_together():
    reg = Registers(n=0)
    drv = LOOP(CALL(lambda n: n + 1, reg("n"), store_to=reg("n"))).start()
    assert drv.run(max_steps=10, timeout=5) is INCOMPLETE and drv.steps == 10
    assert drv.run(timeout=0) is INCOMPLETE and drv.steps == 10


@pytest.mark.parametrize("bad", [-1, "1", True, float("nan")])
def test_bad_timeouts(bad):
    with pytest.raises(ValueError, match="timeout"):
        counting_program().start().run(timeout=bad)


def test_run_sleeps_while_every_runnable_leaf_is_pending():
    drv = WEAVE(-1, [POPEN(SLEEP), POPEN(SLEEP)]).start()
    t0 = time.monotonic()
    cpu0 = time.process_time()
    assert drv.run() == [0, 0]
    assert time.monotonic() - t0 >= 0.45
    assert drv.steps < 60  # a busy loop would poll many thousands of times
    assert time.process_time() - cpu0 < 0.25


def test_run_with_a_timeout_while_waiting_returns_in_time():
    drv = POPEN([sys.executable, "-c", "import time; time.sleep(5)"]).start()
    t0 = time.monotonic()
    assert drv.run(timeout=0.3) is INCOMPLETE
    assert 0.3 <= time.monotonic() - t0 < 0.6
    del drv


def test_pending_leaves_without_a_hook_are_polled_with_a_backoff():
    event = threading.Event()
    set_later(event, 0.3)
    drv = Waiting(event, hook=False).start()
    assert drv.run() == "ready"
    assert 10 < drv.steps < 1000


def test_a_woven_call_is_not_slowed_by_a_pending_leaf():
    event = threading.Event()
    reg = Registers(n=0)
    prog = WEAVE(1, [Waiting(event, hook=True), REPEAT(20000, CALL(lambda n: n + 1, reg("n"), store_to=reg("n")))])
    t0 = time.monotonic()
    assert prog.run() == [None, 20000]
    assert time.monotonic() - t0 < 2  # every other step is a poll: no waiting while the CALLs can run


# ----------------------------------------------------------------- arun
def test_arun_gives_the_same_run_as_run():
    straight = counting_program().start()
    straight.run()
    drv = counting_program().start()
    assert asyncio.run(drv.arun()) == straight.result
    assert same(outcome(drv), outcome(straight))
    drv = counting_program().start()
    assert asyncio.run(drv.arun(steps_per_yield=100)) == straight.result and drv.steps == straight.steps


def test_arun_yields_to_the_event_loop_between_steps():
    drv = counting_program(200).start()
    seen = []

    async def watcher():
        while not drv.done:
            seen.append(drv.steps)
            await asyncio.sleep(0)

    async def main():
        await asyncio.gather(drv.arun(steps_per_yield=1), watcher())

    asyncio.run(main())
    assert seen[0] <= 1 and seen[:5] == list(range(seen[0], seen[0] + 5)) and len(seen) >= drv.steps - 1


def test_arun_gives_the_loop_control_every_time_slice_not_every_step():
    straight = counting_program(200_000).start()
    straight.run()
    drv = counting_program(200_000).start()
    beats = []

    async def heartbeat():
        while not drv.done:
            beats.append(drv.steps)
            await asyncio.sleep(0.001)

    async def main():
        await asyncio.gather(drv.arun(), heartbeat())

    asyncio.run(main())
    assert same(outcome(drv), outcome(straight))
    # the other task ran while the program did, between steps, and the driver did not yield at each step
    assert len(beats) >= 2 and beats[1] < drv.steps and beats[1] - beats[0] > 1
    with pytest.raises(ValueError, match="yield_every"):
        asyncio.run(counting_program().start().arun(yield_every=0))


def test_arun_awaits_a_running_command_instead_of_polling_it():
    reg = Registers()
    drv = SEQ([POPEN(SLEEP, store_to=reg("rc")), CALL(lambda rc: rc + 1, reg("rc"))]).start()
    ticks = []

    async def ticker():
        while not drv.done:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.05)

    async def main():
        cpu0 = time.process_time()
        result, _ = await asyncio.gather(drv.arun(), ticker())
        return result, time.process_time() - cpu0

    result, cpu = asyncio.run(main())
    assert result == 1 and drv.steps < 30
    assert len(ticks) >= 8  # the loop kept serving the other task
    assert cpu < 0.25


def test_arun_awaits_a_spawn():
    reg = Registers(s=0.3)
    with cf.ThreadPoolExecutor(1) as ex:
        prog = SEQ([SPAWN(CALL(time.sleep, reg("s")), executor=ex), CALL(abs, -4)])
        drv = prog.start()
        assert asyncio.run(drv.arun()) == 4 and drv.steps < 20


def test_arun_timeout_and_max_steps():
    reg = Registers(n=0)
    drv = LOOP(CALL(lambda n: n + 1, reg("n"), store_to=reg("n"))).start()
    t0 = time.monotonic()
    assert asyncio.run(drv.arun(timeout=0.1)) is INCOMPLETE
    assert time.monotonic() - t0 < 0.4 and drv.steps > 10
    steps = drv.steps
    assert asyncio.run(drv.arun(max_steps=5)) is INCOMPLETE and drv.steps == steps + 5
    with pytest.raises(ValueError, match="steps_per_yield"):
        asyncio.run(drv.arun(steps_per_yield=0))


def test_a_cancelled_arun_leaves_a_driver_that_finishes_exactly():
    straight = counting_program(500_000).start()
    straight.run()
    drv = counting_program(500_000).start()

    async def main():
        task = asyncio.create_task(drv.arun())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert 0 < drv.steps < straight.steps
    drv.run()
    assert same(outcome(drv), outcome(straight))


def test_another_task_can_checkpoint_between_steps(tmp_path):
    straight = counting_program(500_000).start()
    straight.run()
    drv = counting_program(500_000).start()
    path = tmp_path / "run.ckpt"

    async def saver():
        await asyncio.sleep(0.005)
        flowvm.save(drv, path)

    async def main():
        await asyncio.gather(drv.arun(), saver())

    asyncio.run(main())
    resumed = flowvm.load(path)
    assert 0 < resumed.steps < straight.steps
    resumed.run()
    assert same(outcome(resumed), outcome(straight))


def test_the_event_loop_example_checkpoints_stops_and_resumes_exactly(tmp_path):
    from flowvm.programs import event_loop_example as example

    straight = example.build(steps=5000).start()
    straight.run()
    (tmp_path / "CHECKPOINT").touch()
    (tmp_path / "STOP").touch()
    logs = []
    drv = asyncio.run(example.main(tmp_path, steps=5000, report_every=0.05, log=logs.append))
    assert not drv.done and (tmp_path / "train.ckpt").exists()
    assert any("(requested)" in line for line in logs) and any("(stop file)" in line for line in logs)
    resumed = asyncio.run(example.main(tmp_path, steps=5000, report_every=0.05, log=logs.append))
    assert resumed.done and any(line.startswith("resuming at step") for line in logs)
    assert same(outcome(resumed), outcome(straight))
    assert not (tmp_path / "train.ckpt").exists()


@pytest.mark.parametrize("shape", ["leaf", "seq"])
def test_a_timeout_is_kept_when_each_step_is_slow(shape):
    """The fast paths look at the clock after every step until steps prove quick."""
    body = CALL(time.sleep, 0.05) if shape == "leaf" else SEQ([CALL(time.sleep, 0.05), CALL(time.sleep, 0.0)])
    drv = REPEAT(200, body).start()
    t0 = time.monotonic()
    assert drv.run(timeout=0.2) is INCOMPLETE
    assert time.monotonic() - t0 < 0.4 and drv.steps <= 10
    t0 = time.monotonic()
    assert asyncio.run(drv.arun(steps_per_yield=1000, timeout=0.2)) is INCOMPLETE
    assert time.monotonic() - t0 < 0.4
