"""SPAWN on local executors: shipping and merging registers, failures, dead workers, copies in flight."""

import concurrent.futures as cf
import gc
import multiprocessing
import os
import pickle
import random
import signal
import threading
import time

import pytest

import flowvm
from flowvm import (CALL, INCOMPLETE, LOOP, REPEAT, SEQ, SPAWN, SWITCH, WEAVE, Registers, SpawnError, VerifyError)
from flowvm.program.analysis import reads, writes
from flowvm.processes.leaves import default_executor, register_executor, shutdown_default_executor
from flowvm.processes.leaves import SpawnTimeout
import toy

pytestmark = pytest.mark.timeout(120)


def add(a, b):
    return a + b


def pid_and_times(seconds):
    t0 = time.time()
    time.sleep(seconds)
    return os.getpid(), t0, time.time()


def fail(x):
    raise ValueError(f"bad trial {x}")


def kill_myself():
    os.kill(os.getpid(), signal.SIGKILL)


def append_line(path):
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.3)
    return 1


class Unpicklable(Exception):
    def __init__(self):
        super().__init__("cannot travel")
        self.lock = threading.Lock()


def raise_unpicklable():
    raise Unpicklable()


@pytest.fixture(scope="module")
def pool2():
    ex = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver"))
    for f in [ex.submit(pid_and_times, 0.3) for _ in range(2)]:  # start both workers, import this module
        f.result()
    yield ex
    ex.shutdown(cancel_futures=True)


def drive(drv, limit=30.0):
    end = time.monotonic() + limit
    while drv.step() is INCOMPLETE:
        assert time.monotonic() < end, "the program did not finish in time"
        time.sleep(0.002)
    return drv.result


# ----------------------------------------------------------------- basics
def test_a_fragment_runs_elsewhere_and_its_writes_come_back():
    reg = Registers(a=2, b=3)
    prog = SEQ([SPAWN(SEQ([CALL(add, reg("a"), reg("b"), store_to=reg("c")),
                           CALL(os.getpid, store_to=reg("pid"))]), store_to=reg("v")),
                CALL(add, reg("c"), 10, store_to=reg("d"))])
    drv = prog.start()
    assert drv.step() is INCOMPLETE and drv.position == "0" and drv.steps == 1
    assert drive(drv) == 15
    assert reg["c"] == 5 and reg["d"] == 15 and reg["v"] == reg["pid"] != os.getpid()


def test_only_read_registers_travel_and_only_written_ones_come_back():
    big = object()  # identity shows whether a value was copied back
    reg = Registers(lock=threading.Lock(), x=4, model=big, keep=big)
    frag = SEQ([CALL(add, reg("x"), 1, store_to=reg("y")),
                SWITCH(CALL(lambda x: x > 100, reg("x")),
                       {True: CALL(lambda m: m, reg("model"), store_to=reg("model"))}, CALL(abs, 0))])
    assert reads(frag) == {"x", "model"} and writes(frag) == {"y", "model"}
    SPAWN(frag).run()  # the lock is never pickled: it is not read
    assert reg["y"] == 5
    assert reg["model"] is big and reg["keep"] is big  # model was not written this time: not merged


def test_the_registers_a_fragment_needs_from_outside():
    reg = Registers()
    frag = SEQ([CALL(abs, reg("given"), store_to=reg("t")), CALL(abs, reg("t"), store_to=reg("out")),
                REPEAT(reg("n"), CALL(abs, reg("out")), counter=reg("i"))])
    el = SPAWN(frag)
    assert sorted(r.name for r in el.own_reads()) == ["given", "n"]
    assert {r.name for r in el.own_writes()} == {"t", "out", "i"}
    with pytest.raises(VerifyError) as info:
        el.start()
    assert info.value.register == "given"
    reg.update(given=-3, n=2)
    assert el.run() == 3 and reg["i"] == 2


def test_a_fragment_that_cannot_verify_is_rejected_when_built():
    reg = Registers(x=1)
    with pytest.raises(VerifyError, match="SPAWN fragment"):
        SPAWN(LOOP(REPEAT(0, CALL(abs, reg("x")))))


def test_lambdas_closures_and_global_generator_references_work():
    reg = Registers(k=3)
    offset = 100
    frag = SEQ([CALL(random.seed, 5), CALL(lambda k: random.random() + k + offset, reg("k"), store_to=reg("r"))])
    SPAWN(frag).run()
    assert reg["r"] == random.Random(5).random() + 103


def test_listing_and_bad_arguments():
    reg = Registers(x=1)
    el = SPAWN(CALL(abs, reg("x"), store_to=reg("y")), executor="cluster", store_to=reg("v"), timeout=30)
    assert str(el) == "v = SPAWN (executor 'cluster', timeout 30s):\n    y = abs(x)"
    assert str(SEQ([el])).splitlines()[1].strip().startswith("v = SPAWN")
    with pytest.raises(TypeError, match="SPAWN: fragment"):
        SPAWN(abs)
    with pytest.raises(TypeError, match="executor"):
        SPAWN(CALL(abs, 1), executor=42)
    with pytest.raises(ValueError, match="timeout"):
        SPAWN(CALL(abs, 1), timeout=-1)


# ----------------------------------------------------------------- concurrency
def test_two_woven_spawns_run_at_the_same_time(pool2):
    reg = Registers(s=0.6)
    prog = WEAVE(-1, [SPAWN(CALL(pid_and_times, reg("s")), executor=pool2, store_to=reg("a")),
                      SPAWN(CALL(pid_and_times, reg("s")), executor=pool2, store_to=reg("b"))])
    (pa, sa, ea), (pb, sb, eb) = prog.run()
    assert pa != pb
    assert max(sa, sb) < min(ea, eb)  # the two runs overlap


def test_a_thread_pool_works_too():
    reg = Registers(a=1)
    with cf.ThreadPoolExecutor(2) as ex:
        assert SPAWN(CALL(add, reg("a"), 1, store_to=reg("b")), executor=ex).run() == 2
    assert reg["b"] == 2


# ----------------------------------------------------------------- failures
def test_a_failing_fragment_raises_its_error_with_the_child_traceback_and_leaves_registers_alone():
    reg = Registers(x=7, y="before")
    prog = SEQ([SPAWN(SEQ([CALL(add, reg("x"), 1, store_to=reg("y")), CALL(fail, reg("x"))]))])
    drv = prog.start()
    before = dict(reg)
    with pytest.raises(ValueError, match="bad trial 7") as info:
        drive(drv)
    err = info.value
    notes = "\n".join(err.__notes__)
    assert "Traceback" in err.child_traceback and "in fail" in err.child_traceback
    assert "in fail" in notes and "SPAWN" in notes and "at path '0'" in notes
    assert dict(reg) == before and drv.position == "0" and not drv.done
    with pytest.raises(ValueError):  # the next step submits the fragment again
        drive(drv)


def read_missing(name):
    raise flowvm.RegisterError(f"register {name!r} holds no value", name)


def test_flowvm_errors_raised_in_the_fragment_arrive_as_themselves_with_their_attributes():
    reg = Registers(y="before", k="c")
    prog = SEQ([CALL(abs, 1), SPAWN(SEQ([CALL(abs, -1, store_to=reg("y")), CALL(read_missing, "w")]))])
    drv = prog.start()
    with pytest.raises(flowvm.RegisterError, match="register 'w' holds no value") as info:
        drive(drv)
    err = info.value
    assert type(err) is flowvm.RegisterError and not isinstance(err, SpawnError)
    assert err.register == "w" and err.path == "1"  # set by the child's driver: the CALL's path in the fragment
    assert "Traceback" in err.child_traceback and "in read_missing" in err.child_traceback
    assert "SPAWN fragment failed in process" in "\n".join(err.__notes__)
    assert reg["y"] == "before" and drv.position == "1"
    # a SWITCH with no case for the selector's value, raised by the child's own driver
    with pytest.raises(flowvm.SwitchError, match="'c'") as info:
        SPAWN(SWITCH(reg("k"), {"a": CALL(abs, 1)})).run()
    assert type(info.value) is flowvm.SwitchError and info.value.value == "c"


def test_an_exception_that_cannot_travel_becomes_a_spawn_error_with_the_text():
    with pytest.raises(SpawnError, match="Unpicklable: cannot travel"):
        drive(SPAWN(CALL(raise_unpicklable)).start())


def test_a_result_that_cannot_travel_names_the_register():
    reg = Registers()
    with pytest.raises(SpawnError, match="register 'lock' cannot be pickled"):
        drive(SPAWN(CALL(threading.Lock, store_to=reg("lock"))).start())


def test_a_register_that_cannot_travel_to_the_fragment_names_the_register():
    reg = Registers(lock=threading.Lock(), n=1)
    drv = SPAWN(CALL(lambda lock, n: n, reg("lock"), reg("n"))).start()
    with pytest.raises(SpawnError, match="register 'lock', which the fragment reads, cannot be pickled"):
        drv.step()
    reg["lock"] = 2
    assert drive(drv) == 1  # the failed step left the driver ready to submit again


def test_a_killed_worker_is_a_clear_error_and_the_default_pool_recovers():
    reg = Registers(a=1)
    t0 = time.monotonic()
    with pytest.raises(SpawnError, match="worker process running the fragment died"):
        drive(SPAWN(CALL(kill_myself)).start())
    assert time.monotonic() - t0 < 20
    assert SPAWN(CALL(add, reg("a"), 1)).run() == 2  # a new default pool


def write_pid_and_sleep(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(30)


def wait_for_pid(path) -> int:
    """The pid a fragment wrote to path, once it has."""
    end = time.monotonic() + 20
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < end
        time.sleep(0.01)
    return int(path.read_text())


def test_a_worker_killed_from_outside_while_the_fragment_runs_is_a_clear_error(tmp_path):
    path = tmp_path / "pid"
    reg = Registers(path=str(path))
    drv = SEQ([SPAWN(CALL(write_pid_and_sleep, reg("path"))), CALL(abs, -1)]).start()
    drv.step()
    os.kill(wait_for_pid(path), signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(SpawnError, match="died"):
        drv.run()
    assert time.monotonic() - t0 < 10
    assert drv.position == "0"


def write_pid_and_return_after(path, seconds):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    return "finished"


def test_workers_of_the_default_pool_ignore_ctrl_c_which_the_parent_handles(tmp_path):
    """A terminal's Ctrl-C signals the workers too: their fragments must go on, not die half-way."""
    path = tmp_path / "pid"
    drv = SPAWN(CALL(write_pid_and_return_after, str(path), 1.0)).start()
    drv.step()
    os.kill(wait_for_pid(path), signal.SIGINT)
    assert drv.run(timeout=20) == "finished"


def test_a_parent_killed_outright_leaves_no_worker_behind(tmp_path):
    import subprocess
    import sys

    import psutil

    path = tmp_path / "pid"
    script = ("import sys, time\n"
              "from flowvm import CALL, SPAWN\n"
              "from test_spawn import write_pid_and_return_after\n"
              "drv = SPAWN(CALL(write_pid_and_return_after, sys.argv[1], 60)).start()\n"
              "while True:\n"
              "    drv.step(); time.sleep(0.01)\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, str(toy.TESTS), os.environ.get("PYTHONPATH", "")]))
    parent = subprocess.Popen([sys.executable, "-c", script, str(path)], env=env)
    try:
        end = time.monotonic() + 30
        while not (path.exists() and path.read_text()):
            assert time.monotonic() < end and parent.poll() is None
            time.sleep(0.01)
        worker = psutil.Process(int(path.read_text()))
    finally:
        parent.kill()
        parent.wait()
    gone, alive = psutil.wait_procs([worker], timeout=10)
    assert not alive, f"worker {worker.pid} outlived its parent"


def _noop():
    pass


def test_a_forked_child_exiting_leaves_the_default_pool_alone():
    """Data loaders and user pools fork: the child inherits the pool's exit hooks, which must not fire."""
    assert SPAWN(CALL(os.getpid)).run() > 0
    pool = default_executor()
    child = multiprocessing.get_context("fork").Process(target=_noop)
    child.start()
    child.join()
    with cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as ex:
        assert SPAWN(CALL(add, 1, 2), executor=ex).run() == 3
    assert default_executor() is pool and SPAWN(CALL(add, 2, 2)).run() == 4


def test_a_killed_worker_of_a_user_pool_is_a_clear_error():
    with cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as ex:
        with pytest.raises(SpawnError, match="died"):
            SPAWN(CALL(kill_myself), executor=ex).run()


def test_timeout_bounds_the_fragments_run_time_not_its_wait_for_a_worker():
    with cf.ThreadPoolExecutor(1) as ex:
        t0 = time.monotonic()
        with pytest.raises(SpawnTimeout, match=r"timeout of 0.2 s \(stopped after \d+ steps"):
            SPAWN(REPEAT(10 ** 6, CALL(time.sleep, 0.01)), executor=ex, timeout=0.2).run()  # stopped in the worker
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(SpawnTimeout, match=r"timeout of 0.2 s \(finished after \d+\.\d+ s"):
            SPAWN(CALL(time.sleep, 0.4), executor=ex, timeout=0.2).run()  # one step longer than the timeout
        # four 0.3 s fragments, one worker, timeout 0.5 s: the last waits 0.9 s for the worker, and is in time
        trials = WEAVE(-1, [SPAWN(REPEAT(3, CALL(time.sleep, 0.1)), executor=ex, timeout=0.5) for _ in range(4)])
        t0 = time.monotonic()
        assert trials.run() == [None] * 4 and time.monotonic() - t0 >= 1.2
        with pytest.raises(SpawnTimeout, match="inside one step"):  # a step that runs on: the parent stops it
            SPAWN(CALL(time.sleep, 3.0), executor=ex, timeout=0.3).run()


def test_on_the_default_pool_a_timeout_counts_from_the_fragments_start_in_a_worker():
    from flowvm.processes.executors import default_workers

    busy = [SPAWN(CALL(time.sleep, 2.5)) for _ in range(default_workers())]  # every worker taken
    queued = SPAWN(REPEAT(5, CALL(time.sleep, 0.05)), timeout=0.5)  # waits 2.5 s, then runs 0.25 s
    t0 = time.monotonic()
    assert WEAVE(-1, busy + [queued]).run()[-1] is None and time.monotonic() - t0 >= 2.5


def sleep_the_first_time(marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(600)  # a step that never ends (a deadlock, say), on the first run only
    return "again"


def test_fragments_queued_behind_abandoned_ones_move_to_the_fresh_pool(tmp_path):
    from flowvm.processes.executors import default_workers

    reg = Registers()
    stuck = [SPAWN(CALL(sleep_the_first_time, str(tmp_path / str(i))), timeout=0.3) for i in range(default_workers())]
    queued = SPAWN(REPEAT(3, CALL(time.sleep, 0.05)), timeout=1.0, store_to=reg("q"))
    drv = WEAVE(-1, stuck + [queued]).start()
    t0, timeouts = time.monotonic(), 0
    while not drv.done and time.monotonic() - t0 < 60:
        try:
            drv.run(timeout=60)
        except SpawnTimeout:  # each stuck one, cancelled by the parent; the next step submits it again
            timeouts += 1
    assert drv.done and drv.result == ["again"] * default_workers() + [None] and timeouts == default_workers()
    assert time.monotonic() - t0 < 20


def test_fragments_that_timed_out_on_the_default_pool_do_not_block_later_spawns():
    """A running task cannot be stopped inside a pool: the pool is retired instead of left clogged."""
    for _ in range(3):  # more runaway fragments than the pool has workers
        with pytest.raises(SpawnTimeout):
            SPAWN(CALL(time.sleep, 60), timeout=0.3).run()
    t0 = time.monotonic()
    drv = SPAWN(CALL(os.getpid)).start()
    assert drv.run(timeout=20) != INCOMPLETE and time.monotonic() - t0 < 20


def test_a_retired_pool_is_killed_as_soon_as_its_work_that_was_not_abandoned_is_done(monkeypatch):
    from flowvm.processes import executors

    pool = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver"))
    monkeypatch.setattr(executors, "_pool", pool)
    runaway, other = pool.submit(time.sleep, 60), pool.submit(time.sleep, 1.0)
    while not (runaway.running() and other.running()):
        time.sleep(0.01)
    workers = list(pool._processes.values())
    executors.retire_running(pool, runaway)  # say a WEAVE abandoned it: the other task keeps its worker
    assert executors._pool is None and pool in executors._retired
    time.sleep(0.3)
    assert all(w.is_alive() for w in workers) and not other.done()
    assert other.result(timeout=10) is None
    deadline = time.monotonic() + 10
    while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(w.is_alive() for w in workers) and pool not in executors._retired  # the runaway is gone


def test_a_retired_pool_looks_again_once_per_finished_task(monkeypatch):
    from flowvm.processes import executors

    pool = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver"))
    monkeypatch.setattr(executors, "_pool", pool)
    runaway = pool.submit(time.sleep, 60)
    queued = [pool.submit(time.sleep, 0.05) for _ in range(12)]  # waiting behind it, on the other worker
    while not runaway.running():
        time.sleep(0.01)
    looks = []
    original = executors._kill_when_idle
    monkeypatch.setattr(executors, "_kill_when_idle", lambda p: (looks.append(1), original(p)))
    executors.retire_running(pool, runaway)
    cf.wait(queued, timeout=30)
    deadline = time.monotonic() + 10
    while pool in executors._retired and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool not in executors._retired and len(looks) <= len(queued) + 1  # not one per task per look


# ----------------------------------------------------------------- copies and lifetime
def test_a_copy_made_in_flight_submits_the_fragment_again(tmp_path):
    log = tmp_path / "runs"
    reg = Registers(path=str(log))
    prog = SEQ([SPAWN(CALL(append_line, reg("path"), store_to=reg("n"))), CALL(add, reg("n"), 1, store_to=reg("m"))])
    drv = prog.start()
    drv.step()
    copies = [pickle.loads(pickle.dumps(drv)), flowvm.persist.checkpoint.loads(flowvm.persist.checkpoint.dumps(drv))]
    for copy in copies:
        assert copy.live == {}
        assert copy.run() == 2 and copy.registers["m"] == 2
    assert drv.run() == 2
    assert len(log.read_text().split()) == 3  # at least once: once per copy


class RecordingExecutor(cf.ThreadPoolExecutor):
    def __init__(self):
        super().__init__(1)
        self.futures = []

    def submit(self, fn, *args, **kwargs):
        fut = super().submit(fn, *args, **kwargs)
        self.futures.append(fut)
        return fut


def test_an_abandoned_spawn_and_a_dropped_driver_cancel_their_tasks():
    gate = threading.Event()
    with RecordingExecutor() as ex:
        blocker = ex.submit(gate.wait)  # the only worker is busy: the SPAWN's task waits in the queue
        reg = Registers()
        prog = WEAVE(1, [SPAWN(CALL(abs, -1), executor=ex), REPEAT(3, CALL(abs, -2, store_to=reg("b")))])
        drv = prog.start()
        assert drv.run() == [None, 2]
        assert ex.futures[-1].cancelled() and drv.live == {}

        drv = SPAWN(CALL(abs, -1), executor=ex).start()
        drv.step()
        fut = ex.futures[-1]
        del drv
        gc.collect()
        assert fut.cancelled()
        gate.set()
        blocker.result()


def test_a_copy_refers_to_the_same_executor_instance_in_this_process():
    reg = Registers(a=1)
    with RecordingExecutor() as ex:
        drv = SPAWN(CALL(add, reg("a"), 1), executor=ex).start()
        copy = pickle.loads(pickle.dumps(drv))
        assert copy.program.executor is ex
        assert copy.run() == 2 and len(ex.futures) == 1


def test_named_executors_and_missing_ones():
    reg = Registers(a=1)
    with RecordingExecutor() as ex:
        register_executor("test-recording", ex)
        drv = SPAWN(CALL(add, reg("a"), 1), executor="test-recording").start()
        assert pickle.loads(pickle.dumps(drv)).run() == 2 and len(ex.futures) == 1
    with pytest.raises(SpawnError, match="no executor is registered under the name 'nowhere'"):
        SPAWN(CALL(abs, 1), executor="nowhere").run()
    state = SPAWN(CALL(abs, 1), executor=cf.ThreadPoolExecutor(1)).__getstate__()
    state["executor"].token = "ThreadPoolExecutor@0"  # as if loaded in another process
    el = SPAWN.__new__(SPAWN)
    el.__setstate__(state)
    with pytest.raises(SpawnError, match="pickled by reference and does not exist in this process"):
        el.run()


def test_the_default_pool_is_shared_created_lazily_and_can_be_shut_down():
    shutdown_default_executor()
    from flowvm.processes import executors

    assert executors._pool is None
    reg = Registers(a=1)
    assert SPAWN(CALL(add, reg("a"), 1)).run() == 2
    pool = default_executor()
    assert SPAWN(CALL(add, reg("a"), 2)).run() == 3 and default_executor() is pool
    shutdown_default_executor()
    assert executors._pool is None


def test_a_spawn_inside_a_fragment_sends_its_writes_all_the_way_back():
    reg = Registers()
    prog = SPAWN(SEQ([SPAWN(CALL(os.getpid, store_to=reg("inner"))), CALL(os.getpid, store_to=reg("outer"))]))
    prog.run()
    assert len({reg["inner"], reg["outer"], os.getpid()}) == 3
    # the worker that ran the outer fragment owns a pool of its own: it must still exit when asked
    done = threading.Event()
    threading.Thread(target=lambda: (shutdown_default_executor(), done.set()), daemon=True).start()
    assert done.wait(30), "shutting the default pool down waited forever on a worker with its own pool"


def test_a_task_cancelled_by_its_executor_is_a_spawn_error():
    gate = threading.Event()
    ex = cf.ThreadPoolExecutor(1)
    blocker = ex.submit(gate.wait)
    drv = SPAWN(CALL(abs, -1), executor=ex).start()
    drv.step()
    ex.shutdown(wait=False, cancel_futures=True)
    gate.set()
    blocker.result()
    with pytest.raises(SpawnError, match="cancelled"):
        drv.run()
    with pytest.raises(SpawnError, match="refused the fragment"):  # a shut-down executor takes no more work
        drv.run()


def test_a_script_without_a_main_guard_gets_a_hint_naming_it(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "noguard.py"
    script.write_text("import os\nfrom flowvm import CALL, SPAWN\nprint(SPAWN(CALL(os.getpid)).run())\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"{script} has no `if __name__ == '__main__':` guard" in done.stderr, done.stderr[-2000:]
    script.write_text("import os\nfrom flowvm import CALL, SPAWN\nif __name__ == '__main__':\n"
                      "    print(SPAWN(CALL(os.getpid)).run())\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and int(done.stdout) > 0, done.stderr[-2000:]
