"""The default pool: a worker started last and killed is an error at once, the pool starts without blocking
the caller, thousands of tasks never clog its start reports, and a script its workers cannot import again
is named."""

import concurrent.futures as cf
import gc
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from flowvm import CALL, SEQ, SPAWN, WEAVE, Registers, SpawnError
from flowvm.processes.executors import default_executor, default_workers, shutdown_default_executor
import toy

pytestmark = pytest.mark.timeout(60)

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, str(toy.TESTS), os.environ.get("PYTHONPATH", "")]))


def sleep_then_return(seconds):
    time.sleep(seconds)
    return seconds


def write_pid_then_sleep(path, seconds):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    return seconds


def wait_for_pid(path, limit=30.0) -> int:
    end = time.monotonic() + limit
    while not (os.path.exists(path) and Path(path).read_text()):
        assert time.monotonic() < end, "the fragment never wrote its pid"
        time.sleep(0.01)
    return int(Path(path).read_text())


# ----------------------------------------------------------------- a worker started last, killed
@pytest.mark.skipif(default_workers() < 2, reason="needs two pool workers")
@pytest.mark.parametrize("pool", ["default", "user"])
def test_killing_the_worker_started_last_is_an_error_at_once_whatever_the_sibling_does(tmp_path, pool):
    """concurrent.futures' pool starts a worker inside submit() after waking its manager thread, which then
    watches only the workers it knew: the death of the new one went unnoticed until a sibling finished."""
    path = str(tmp_path / "pid")
    if pool == "default":
        shutdown_default_executor()  # a fresh pool: before the fix its workers started one per SPAWN
        ex = None
    else:
        ex = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver"))  # not warmed
    # The pause lets the pool's manager thread settle into its wait before the second SPAWN starts a worker
    # (without it, it often happened to look again late enough to see the new worker).
    prog = WEAVE(-1, [SPAWN(CALL(sleep_then_return, 60), executor=ex),
                      SEQ([CALL(time.sleep, 0.5), SPAWN(CALL(write_pid_then_sleep, path, 60), executor=ex)])])
    drv = prog.start()
    raised = []

    def drive():
        try:
            drv.run()
        except BaseException as err:  # noqa: B036 - handed to the test's thread
            raised.append(err)

    runner = threading.Thread(target=drive, daemon=True)
    runner.start()
    try:
        os.kill(wait_for_pid(path), signal.SIGKILL)
        t0 = time.monotonic()
        runner.join(15)
        took = time.monotonic() - t0
        assert not runner.is_alive(), "no error 15 s after the worker died: the run waits on its sibling"
        assert len(raised) == 1 and isinstance(raised[0], SpawnError), raised
        assert "worker process running the fragment died" in str(raised[0])
        assert took < 15
    finally:  # on failure, end the sibling so that the runner thread ends too
        if ex is None:
            shutdown_default_executor(kill=True)
        else:
            for proc in list((ex._processes or {}).values()):
                proc.kill()
            ex.shutdown(wait=False, cancel_futures=True)
        runner.join(15)


# ----------------------------------------------------------------- starting the pool without blocking
HEARTBEAT = textwrap.dedent("""
    import asyncio, json, multiprocessing, operator, sys, time
    from flowvm import CALL, SPAWN, Registers

    async def main():
        reg = Registers(a=20)
        drv = SPAWN(CALL(operator.add, reg("a"), 22, store_to=reg("b"))).start()
        gaps, running = [], True

        async def heartbeat():
            last = time.monotonic()
            while running:
                await asyncio.sleep(0.002)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.05)  # the heartbeat beats before the first step
        t0 = time.monotonic()
        result = await drv.arun()
        took = time.monotonic() - t0
        running = False
        await beat
        return {"result": result, "b": reg["b"], "max_gap": max(gaps), "beats": len(gaps), "took": took}

    if __name__ == "__main__":
        # Workers fork from a forkserver that imports these modules first (a way to import torch once):
        # the forkserver serves only once it has, here after half a second.
        multiprocessing.set_forkserver_preload(["slow_import"])
        print(json.dumps(asyncio.run(main())))
""")


def test_the_first_spawn_starts_the_default_pool_without_stalling_an_event_loop(tmp_path):
    """A fresh interpreter (no forkserver yet): the first step used to wait while the forkserver started
    (0.05-0.4 s, longer with modules it preloads) and forked the first worker."""
    script = tmp_path / "heartbeat.py"
    script.write_text(HEARTBEAT)
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(0.5)\n")
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(tmp_path), ENV["PYTHONPATH"]]))  # the forkserver's path
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["result"] == 42 and out["b"] == 42
    assert out["max_gap"] < 0.2, out  # generous: the heartbeat sleeps 2 ms at a time


def test_a_copy_made_while_the_pool_starts_submits_the_fragment_itself():
    shutdown_default_executor()
    reg = Registers(a=1)
    prog = SEQ([SPAWN(CALL(toy.add, reg("a"), 1, store_to=reg("b"))), CALL(toy.add, reg("b"), 10, store_to=reg("c"))])
    drv = prog.start()
    drv.step()  # the pool starts in the background; the fragment waits for it
    copy = pickle.loads(pickle.dumps(drv))
    assert copy.live == {}
    assert copy.run(timeout=30) == 12 and copy.registers["b"] == 2
    assert drv.run(timeout=30) == 12 and reg["b"] == 2


def test_registers_are_read_when_the_spawn_starts_even_while_the_pool_starts():
    """The fragment's inputs are taken at its first step, not when the pool is ready to take it."""
    shutdown_default_executor()
    reg = Registers(x=1)
    prog = WEAVE(-1, [SPAWN(CALL(toy.const, reg("x"), store_to=reg("seen"))),
                      CALL(toy.const, 2, store_to=reg("x"))])
    prog.run()
    assert reg["seen"] == 1 and reg["x"] == 2


def test_default_executor_waits_for_a_start_in_progress_and_shutdown_discards_it():
    shutdown_default_executor()
    drv = SPAWN(CALL(os.getpid)).start()
    drv.step()  # a start in the background
    pool = default_executor()  # waits for it
    assert default_executor() is pool and drv.run(timeout=30) > 0
    drv = SPAWN(CALL(os.getpid)).start()
    shutdown_default_executor()
    drv.step()
    shutdown_default_executor()  # while it starts: the pool it was starting is thrown away
    assert drv.run(timeout=30) > 0 and default_executor() is not pool


def touch(path):
    open(path, "w").close()


def test_a_spawn_dropped_or_abandoned_while_the_pool_starts_is_never_submitted(tmp_path):
    shutdown_default_executor()
    dropped, abandoned = tmp_path / "dropped", tmp_path / "abandoned"
    drv = SPAWN(CALL(touch, str(dropped))).start()
    drv.step()  # waits for the pool
    del drv
    gc.collect()
    prog = WEAVE(1, [SPAWN(CALL(touch, str(abandoned))), CALL(abs, -1)])  # the CALL finishes first
    assert prog.run() == [None, 1]
    default_executor().submit(time.sleep, 0.3).result()  # the pool is up; a task given to it would have run
    time.sleep(0.3)
    assert not dropped.exists() and not abandoned.exists()


def test_thousands_of_spawns_on_the_default_pool_never_block_its_workers():
    """Each task's worker reports its start on a pipe (for timeouts and retired pools); unread when no SPAWN
    had a timeout, the pipe filled after some 1,700 tasks and every worker then blocked for ever."""
    reg = Registers(x=-1)
    prog = SPAWN(CALL(abs, reg("x")))
    try:
        for i in range(2500):
            result = prog.start().run(timeout=10)
            assert result == 1, f"SPAWN number {i + 1} did not finish within 10 s"
    finally:
        shutdown_default_executor(kill=True)  # a stuck pool goes


# ----------------------------------------------------------------- a main module the workers cannot import
def test_a_script_piped_on_stdin_gets_an_error_saying_the_workers_cannot_import_it():
    script = "import os\nfrom flowvm import CALL, SPAWN\nif __name__ == '__main__':\n    print(SPAWN(CALL(os.getpid)).run())\n"
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode != 0
    assert "SpawnError" in done.stderr and "read from stdin" in done.stderr, done.stderr[-3000:]
    assert "killed by a signal" not in done.stderr
    # a user's forkserver pool: its worker dies, and the error says why
    script = ("import concurrent.futures as cf, multiprocessing, os\nfrom flowvm import CALL, SPAWN\n"
              "if __name__ == '__main__':\n"
              "    ex = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('forkserver'))\n"
              "    print(SPAWN(CALL(os.getpid), executor=ex).run())\n")
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode != 0
    assert "worker process running the fragment died" in done.stderr, done.stderr[-3000:]
    assert "the main script was read from stdin" in done.stderr, done.stderr[-3000:]


def test_a_worker_whose_start_fails_in_the_main_script_says_so_with_the_traceback(tmp_path):
    # the page-as-a-script mistake: only the first part of the script is guarded, so each worker runs the
    # rest again when it imports the script, and that fails there before the worker takes any work
    script = tmp_path / "two_parts.py"
    script.write_text("from flowvm import CALL, SPAWN, Registers\n"
                      "reg = Registers(x=-2)\n"
                      "if __name__ == '__main__':\n"
                      "    print(SPAWN(CALL(abs, reg('x'))).run())\n"
                      "other = Registers()\n"
                      "CALL(abs, other('never_written')).start()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=ENV,
                          cwd=tmp_path)
    assert done.returncode != 0
    last = done.stderr[done.stderr.rindex("SpawnError"):]
    assert "failed while starting, before it ran the fragment" in last and str(script) in last, last
    assert "VerifyError: register 'never_written' is read by CALL" in last  # the worker's own error
    assert f'File "{script}", line 6, in <module>' in last  # with its traceback
    assert "if __name__ == '__main__':" in last and "killed by a signal" not in last
