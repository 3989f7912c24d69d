"""The leaf protocol used by leaf kinds beyond CALL and PRINT (fused steps, POPEN, SPAWN)."""

import pickle

from flowvm import CALL, REPEAT, WEAVE, Registers
from flowvm import INCOMPLETE
from toy import Countdown


def test_a_pending_leaf_counts_each_poll_as_a_step_and_stays_in_place():
    log = []
    drv = Countdown(2, log).start()
    assert [drv.step(), drv.step()] == [INCOMPLETE, INCOMPLETE]
    assert drv.steps == 2 and drv.position == ""
    assert drv.step() == 1 and drv.done and drv.steps == 3


def test_polls_take_weave_turns_and_an_abandoned_pending_leaf_is_told():
    log, reg = [], Registers(n=0)
    prog = WEAVE(1, [Countdown(5, log), REPEAT(2, CALL(lambda n: n + 1, reg("n"), store_to=reg("n")))])
    drv = prog.start()
    order = []
    while drv.step() is INCOMPLETE:
        order.append(reg["n"])
    assert order == [0, 1, 1]  # poll, call, poll, then the call that finishes the WEAVE
    assert drv.result == [None, 2]
    assert log == ["start", "abandoned"]


def test_a_copy_made_while_a_leaf_is_pending_starts_it_again():
    log = []
    drv = Countdown(3, log).start()
    drv.run(max_steps=2)
    copy = pickle.loads(pickle.dumps(drv))
    assert copy.live == {}
    copy_log = copy.program.log
    assert copy.run() == 2 and copy_log == ["start", "start"]
    assert copy.steps == 2 + 4
