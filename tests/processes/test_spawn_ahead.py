"""The default pool starts when a run holding a SPAWN on it starts (its driver is made, or a copy takes its
first step), in the background, so that its workers are up by the time the SPAWN is reached; its workers
run the run's fragments, and never outlive a parent killed with SIGKILL, even one that took no step."""

import os
import pickle
import subprocess
import sys
import time

import psutil
import pytest

import flowvm
from flowvm import CALL, SEQ, SPAWN, WEAVE, Registers
from flowvm.processes import executors
from flowvm.processes.executors import shutdown_default_executor
import toy

pytestmark = pytest.mark.timeout(90)

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, str(toy.TESTS), os.environ.get("PYTHONPATH", "")]))


def pool_is_up_within(seconds: float) -> bool:
    """Wait (in this process, taking no step of any driver) until the default pool is up."""
    end = time.monotonic() + seconds
    while executors._pool is None:
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def pool_pids() -> set:
    return set(executors._pool._processes)


def test_making_the_driver_starts_the_default_pool_and_the_run_uses_its_workers():
    shutdown_default_executor()
    reg = Registers()
    prog = SEQ([CALL(pool_is_up_within, 30.0, store_to=reg("up_before_any_spawn")),
                WEAVE(-1, [SPAWN(CALL(os.getpid, store_to=reg("a"))), SPAWN(CALL(os.getpid, store_to=reg("b")))])])
    drv = prog.start()
    assert executors._starting is not None or executors._pool is not None  # under way, no step taken
    assert drv.run(timeout=60) is not flowvm.INCOMPLETE
    assert reg["up_before_any_spawn"] is True
    assert {reg["a"], reg["b"]} <= pool_pids()  # the workers started ahead ran the fragments


def test_a_copy_starts_the_pool_at_its_first_step_and_only_for_fragments_going_there():
    shutdown_default_executor()
    reg = Registers(x=-3)
    prog = SEQ([CALL(abs, reg("x"), store_to=reg("y")), SPAWN(CALL(abs, reg("x"), store_to=reg("z")))])
    saved = pickle.dumps(prog.start())
    shutdown_default_executor()
    copy = pickle.loads(saved)
    assert executors._pool is None and executors._starting is None  # loading alone starts nothing
    copy.step()  # the CALL: the SPAWN has taken no step yet
    assert pool_is_up_within(30)
    assert copy.run(timeout=30) == 3
    # fragments that go elsewhere, or only run inside another process's fragment, start nothing here
    shutdown_default_executor()
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(1) as own:
        flowvm.register_executor("elsewhere", own)
        SPAWN(SPAWN(CALL(abs, -1)), executor=own).start()
        SPAWN(CALL(abs, -1), executor="elsewhere").start()
        SPAWN(CALL(abs, -1), executor="not_registered_yet").start()
        assert executors._pool is None and executors._starting is None
    flowvm.register_executor("local", None)  # a name for the default pool
    SPAWN(CALL(abs, -1), executor="local").start()
    assert pool_is_up_within(30)


PARENT = """
import sys, time
from flowvm import CALL, SPAWN, WEAVE
from flowvm.processes import executors
{outside}
if __name__ == '__main__':
    drv = WEAVE(-1, [SPAWN(CALL(time.sleep, 60)), SPAWN(CALL(time.sleep, 60))]).start()   # no step taken
    while executors._pool is None:
        time.sleep(0.01)
    from multiprocessing import forkserver
    pids = list(executors._pool._processes) + [forkserver._forkserver._forkserver_pid]
    print(' '.join(map(str, pids)), flush=True)
    {then}
"""


def test_workers_started_ahead_never_outlive_a_parent_killed_with_sigkill(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(outside="", then="time.sleep(60)"))
    parent = subprocess.Popen([sys.executable, str(script)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        procs = [psutil.Process(p) for p in pids]
        assert len(procs) == executors.default_workers() + 1 and all(p.is_running() for p in procs)
    finally:
        parent.kill()  # SIGKILL: nothing runs in the parent to stop them
        parent.wait()
    gone, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"{[p.pid for p in alive]} outlived their parent"


def test_a_driver_made_outside_the_main_guard_starts_no_pool_in_the_workers(tmp_path):
    """Workers import the main script again: the driver it makes at import must not start a pool in each
    worker (whose workers would import the script again, and so on)."""
    script = tmp_path / "unguarded.py"
    script.write_text(PARENT.format(
        outside="early = SPAWN(CALL(abs, -1)).start()  # outside the guard: every worker makes it too",
        then="import psutil; print(early.run(timeout=30), [len(psutil.Process(p).children()) for p in pids[:-1]])"))
    done = subprocess.run([sys.executable, str(script)], env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    result, children = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert result == "1" and children == str([0] * executors.default_workers())


def test_the_forkserver_imports_flowvm_once_for_all_the_workers(tmp_path):
    """Each worker used to import flowvm (and numpy) itself after the fork, all at once, while the parent
    waited: the forkserver imports it before it forks them."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(outside="", then="print(open(f'/proc/{pids[-1]}/maps').read())"))
    done = subprocess.run([sys.executable, str(script)], env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "_multiarray_umath" in done.stdout  # numpy's core, which only importing flowvm brings there


def test_a_process_starting_as_a_worker_starts_no_pool_when_it_makes_a_driver():
    """What the test above sees from outside, here in this process: while a spawn or forkserver child imports
    the main script, multiprocessing marks it as inheriting."""
    from multiprocessing import process

    shutdown_default_executor()
    process.current_process()._inheriting = True
    try:
        SPAWN(CALL(abs, -1)).start()
    finally:
        del process.current_process()._inheriting
    assert executors._pool is None and executors._starting is None
    SPAWN(CALL(abs, -1)).start()
    assert executors._starting is not None or executors._pool is not None
