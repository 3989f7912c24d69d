"""SPAWN on a real dask.distributed LocalCluster: two worker processes on 127.0.0.1, no dashboard."""

import os
import pickle
import signal
import time

import pytest

from flowvm import CALL, INCOMPLETE, SEQ, SPAWN, WEAVE, Registers, SpawnError
from flowvm import register_executor

distributed = pytest.importorskip("distributed", reason="the Dask engine needs pip install flowvm[dask]")
dask = pytest.importorskip("dask")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def client():
    # One try per task: a worker that dies fails the task at once instead of being retried.
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                           dashboard_address=None)
    client = distributed.Client(cluster)
    client.run(pid_and_times, 0)  # every worker imports this module now, not during a timed test
    yield client
    client.close()
    cluster.close()


def add(a, b):
    return a + b


def pid_and_times(seconds):
    t0 = time.time()
    time.sleep(seconds)
    return os.getpid(), t0, time.time()


def fail(x):
    raise KeyError(f"no trial {x}")


def kill_myself():
    os.kill(os.getpid(), signal.SIGKILL)


def drive(drv, limit=60.0):
    end = time.monotonic() + limit
    while drv.step() is INCOMPLETE:
        assert time.monotonic() < end, "the program did not finish in time"
        time.sleep(0.002)
    return drv.result


def test_a_fragment_runs_on_a_dask_worker(client):
    reg = Registers(a=1, b=2)
    ex = client.get_executor()
    prog = SEQ([SPAWN(SEQ([CALL(add, reg("a"), reg("b"), store_to=reg("c")), CALL(os.getpid, store_to=reg("pid"))]),
                      executor=ex),
                CALL(add, reg("c"), 1)])
    assert prog.run() == 4
    worker_pids = set(client.run(os.getpid).values())
    assert reg["c"] == 3 and reg["pid"] in worker_pids


def test_two_woven_spawns_use_both_workers_at_once(client):
    reg = Registers(s=0.5)
    prog = WEAVE(-1, [SPAWN(CALL(pid_and_times, reg("s")), executor=client, store_to=reg(n)) for n in "ab"])
    (pa, sa, ea), (pb, sb, eb) = prog.run()
    assert pa != pb and max(sa, sb) < min(ea, eb)


def test_identical_submissions_are_not_merged(client):
    ex = client.get_executor()
    prog = WEAVE(-1, [SPAWN(CALL(time.time_ns), executor=ex), SPAWN(CALL(time.time_ns), executor=ex)])
    a, b = prog.run()
    assert a != b


def test_a_failing_fragment_raises_its_error_with_the_worker_traceback(client):
    reg = Registers(x=3, y=0)
    drv = SPAWN(SEQ([CALL(add, reg("x"), 1, store_to=reg("y")), CALL(fail, reg("x"))]),
                executor=client.get_executor()).start()
    with pytest.raises(KeyError, match="no trial 3") as info:
        drive(drv)
    assert "in fail" in info.value.child_traceback
    assert reg["y"] == 0 and not drv.done


def test_a_killed_worker_is_a_clear_error_not_a_hang(client):
    t0 = time.monotonic()
    with pytest.raises(SpawnError, match="KilledWorker"):
        drive(SPAWN(CALL(kill_myself), executor=client.get_executor()).start())
    assert time.monotonic() - t0 < 60
    client.wait_for_workers(1, timeout=60)  # the nanny restarts it
    reg = Registers(a=1)
    assert SPAWN(CALL(add, reg("a"), 1), executor=client.get_executor()).run() == 2


def test_a_copy_made_in_flight_resubmits_to_the_named_cluster(client):
    register_executor("test-dask", client.get_executor())
    reg = Registers(s=0.2)
    prog = SEQ([SPAWN(CALL(pid_and_times, reg("s")), executor="test-dask", store_to=reg("r")),
                CALL(lambda r: r[0], reg("r"))])
    drv = prog.start()
    drv.step()
    copy = pickle.loads(pickle.dumps(drv))
    assert copy.live == {} and copy.program.elements[0].executor == "test-dask"
    assert copy.run() == copy.registers["r"][0] and drv.run() == reg["r"][0]
