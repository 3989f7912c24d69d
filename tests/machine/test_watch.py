"""Driver.watch (flowvm/machine/metrics.py): a run's history of metrics is part of the run, so every way of
driving it and every copy of it gives exactly the uninterrupted run's points."""

from __future__ import annotations

import asyncio
import copy
import pickle

import numpy as np
import pytest

import flowvm
from flowvm import CALL, INCOMPLETE, REPEAT, SEQ, Registers


def noisy(state):
    rng, total = state
    return rng, total + rng.standard_normal()


def loss_of(state):
    return state[1]


def build(n=700):
    reg = Registers(state=(np.random.default_rng(3), 0.0))
    return REPEAT(n, SEQ([CALL(noisy, reg("state"), store_to=reg("state")),
                          CALL(loss_of, reg("state"), store_to=reg("loss")),
                          CALL(lambda s: np.array([s[1], -s[1]]), reg("state"), store_to=reg("pair"))]))


def straight(every=50):
    drv = build().start().watch("loss", "pair", every=every)
    drv.run()
    return drv.history


def test_every_way_of_driving_a_run_records_the_same_points():
    want = straight()
    assert [s for s, _ in want["loss"]][:3] == [50, 100, 150] and want["loss"][-1][0] == 2100
    assert isinstance(want["pair"][0][1], list) and len(want["pair"]) == len(want["loss"])
    by_steps = build().start().watch("loss", "pair", every=50)
    while by_steps.step() is INCOMPLETE:
        pass
    assert by_steps.history == want
    in_asyncio = build().start().watch("loss", "pair", every=50)
    asyncio.run(in_asyncio.arun())
    assert in_asyncio.history == want
    in_slices = build().start().watch("loss", "pair", every=50)
    while in_slices.run(max_steps=37) is INCOMPLETE:
        pass
    assert in_slices.history == want


@pytest.mark.parametrize("cut", [1, 49, 50, 51, 999, 2099])
def test_a_copy_taken_anywhere_and_resumed_records_the_uninterrupted_runs_points(cut, tmp_path):
    want = straight()
    drv = build().start().watch("loss", "pair", every=50)
    drv.run(max_steps=cut)
    for copied in (pickle.loads(pickle.dumps(drv)), copy.deepcopy(drv)):
        assert copied.run() is not INCOMPLETE and copied.history == want
    flowvm.save(drv, tmp_path / "run.ckpt")
    again = flowvm.load(tmp_path / "run.ckpt")
    while again.step() is INCOMPLETE:  # a loaded copy's step() records too
        pass
    assert again.history == want
    flowvm.save_state(drv, tmp_path / "run.safetensors")
    from_state = flowvm.load_state(tmp_path / "run.safetensors", build())
    from_state.run()
    assert from_state.history == want


def test_the_default_interval_aims_at_200_points_and_names_can_be_added():
    drv = build().start().watch("loss")
    assert drv._watch["every"] == 2100 // 200
    drv.run(max_steps=500)
    drv.watch("pair")  # from here on
    drv.run()
    assert len(drv.history["loss"]) == 2100 // 10 and drv.history["pair"][0][0] == 510
    with pytest.raises(ValueError, match="already takes a point every 10 steps"):
        drv.watch("loss", every=3)


def test_watching_is_checked_and_costs_unwatched_drivers_nothing():
    drv = build().start()
    assert drv.history == {} and "step" not in drv.__dict__  # step() is the class's own
    with pytest.raises(TypeError, match="register names must be non-empty str"):
        drv.watch(3)
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        drv.watch("loss", every=0)
    drv.watch("loss", "not_a_register_yet")
    drv.run()
    assert drv.history["not_a_register_yet"] == []
    assert "step" not in pickle.loads(pickle.dumps(drv)).__getstate__()
