"""What compiles in child processes share with the other programs on the machine: a machine-wide limit on
compiles at once, retries when the machine is short of resources, the files of killed programs removed by
the next, and the child's CPU priority (flowvm/fused/resources.py, outofprocess.py)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from flowvm.fused import outofprocess, resources


def python_env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **extra)


@pytest.fixture
def tmpdir_here(tmp_path, monkeypatch):
    """The temporary directory (slots, work directories) is the test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_compile_slot_held_by_another_process_is_waited_for(tmpdir_here, monkeypatch):
    monkeypatch.setenv("FLOWVM_COMPILE_PROCESSES", "1")
    path = os.path.join(resources._slot_dir(), "slot-0")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({path!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(1.5)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    t0 = time.monotonic()
    with resources.slot(lambda: False, poll=0.05):
        waited = time.monotonic() - t0
    holder.wait(10)
    assert waited > 0.8  # it queued until the other program's compile was done


def test_a_program_ending_while_it_waits_for_a_slot_starts_nothing(tmpdir_here, monkeypatch):
    monkeypatch.setenv("FLOWVM_COMPILE_PROCESSES", "1")
    stop = threading.Event()
    with resources.slot(lambda: False):
        threading.Timer(0.2, stop.set).start()
        with pytest.raises(resources.Stopped):
            with resources.slot(stop.is_set, poll=0.05):
                pass


def test_the_number_of_slots_is_one_less_than_the_cores_or_as_set(monkeypatch):
    monkeypatch.delenv("FLOWVM_COMPILE_PROCESSES", raising=False)
    assert resources.slots() == max(1, (os.cpu_count() or 2) - 1)
    monkeypatch.setenv("FLOWVM_COMPILE_PROCESSES", "3")
    assert resources.slots() == 3
    monkeypatch.setenv("FLOWVM_COMPILE_PROCESSES", "many")
    with pytest.raises(ValueError, match="FLOWVM_COMPILE_PROCESSES"):
        resources.slots()


def _raised_from(cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as err:
            raise RuntimeError("backend compiler failed") from err
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize("error, short", [
    (BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"), True),
    (RuntimeError("can't start new thread"), True),
    (MemoryError(), True),
    (OSError(errno.ENOMEM, "Cannot allocate memory"), True),
    (_raised_from(BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")), True),
    (RuntimeError("C++ compile error: cc1plus: out of memory allocating 65536 bytes"), True),
    (ValueError("aten.relu_.default: in-place or view op"), False),
    (FileNotFoundError(errno.ENOENT, "No such file"), False),
])
def test_resource_errors_are_told_from_failures(error, short):
    assert resources.resource_error(error) is short


FAKE_CHILD = textwrap.dedent("""
    import json, os, sys
    workdir = sys.argv[1]
    marks = os.environ["FAKE_MARKS"]
    tries = len(os.listdir(marks))
    open(os.path.join(marks, str(tries)), "w").close()
    outcome = os.environ["FAKE_OUTCOMES"].split(",")[tries]
    if outcome == "retry":
        print(json.dumps({"retry": "BlockingIOError: [Errno 11] Resource temporarily unavailable"}))
        sys.exit(4)
    if outcome == "refused":
        print(json.dumps({"refused": "aten.relu_.default: in-place or view op"}))
        sys.exit(3)
    open(os.path.join(workdir, "step.pt2"), "w").write("package")
""")


def _fake_compile(tmp_path, monkeypatch, outcomes: str) -> tuple:
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("FAKE_MARKS", str(marks))
    monkeypatch.setenv("FAKE_OUTCOMES", outcomes)
    monkeypatch.setattr(outofprocess, "CHILD", FAKE_CHILD)
    monkeypatch.setattr(resources, "backoff", lambda tries: 0.01)
    done = threading.Event()
    got: list = []

    def on_done(run, error):
        got.append((run, error))
        done.set()

    def load(workdir):
        return open(os.path.join(workdir, "step.pt2")).read()

    c = outofprocess.Compile(b"job", load, on_done)
    assert done.wait(60)
    return c, got[0], len(os.listdir(marks))


def test_a_child_short_of_resources_is_tried_again_and_its_package_arrives(tmpdir_here, monkeypatch):
    c, (run, error), children = _fake_compile(tmpdir_here, monkeypatch, "retry,retry,ok")
    assert (run, error) == ("package", None) and c.tries == 3 and children == 3


def test_a_childs_refusal_is_not_tried_again(tmpdir_here, monkeypatch):
    c, (run, error), children = _fake_compile(tmpdir_here, monkeypatch, "refused,ok")
    assert run is None and error == "aten.relu_.default: in-place or view op" and children == 1


def test_a_child_that_cannot_start_for_lack_of_processes_is_tried_again(tmpdir_here, monkeypatch):
    real = subprocess.Popen
    failures = [BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")]

    def popen(*args, **kwargs):
        if failures:
            raise failures.pop()
        return real(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    c, (run, error), children = _fake_compile(tmpdir_here, monkeypatch, "ok")
    assert (run, error) == ("package", None) and c.tries == 2 and children == 1


def test_the_childs_own_code_reports_a_resource_error_for_a_later_try(tmp_path):
    # the child's compile fails with EAGAIN (injected where the child starts): it says so, for a retry
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""
        import errno
        from flowvm.fused import outofprocess
        def short(workdir):
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        outofprocess._compile = short
    """))
    env = python_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    out = subprocess.run([sys.executable, "-c", outofprocess.CHILD, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == outofprocess.RETRY, out.stderr[-2000:]
    assert "Errno 11" in json.loads(out.stdout.strip().splitlines()[-1])["retry"]


def test_the_child_runs_at_the_lowest_cpu_priority():
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os
        from flowvm.fused.resources import lowest_priority
        lowest_priority()
        print(os.nice(0), os.sched_getscheduler(0) == os.SCHED_IDLE if hasattr(os, "SCHED_IDLE") else "-")
    """)], capture_output=True, text=True, env=python_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    nice, idle = out.stdout.split()
    assert nice == "19" and idle in ("True", "-")


def test_work_directories_of_programs_that_no_longer_run_are_removed(tmpdir_here):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmpdir_here / f"flowvm-aot-{dead.pid}-abc"
    live = tmpdir_here / f"flowvm-aot-{os.getppid()}-def"  # a program that runs
    reused = tmpdir_here / f"flowvm-aot-{os.getppid()}-ghi"  # older than any compile: the number was reused
    other = tmpdir_here / "flowvm-slots-of-something-else"
    for d in (gone, live, reused, other):
        d.mkdir()
        (d / "job.pkl").write_bytes(b"x")
    old = time.time() - 2 * resources.STALE_SECONDS
    os.utime(reused, (old, old))
    removed = resources.sweep(force=True)
    assert sorted(removed) == sorted([str(gone), str(reused)])
    assert live.exists() and other.exists() and not gone.exists() and not reused.exists()


def test_the_files_of_a_killed_program_are_removed_by_the_next_programs_first_compile(tmp_path):
    script = textwrap.dedent("""
        import time, torch
        from flowvm import CALL, LOOP, SEQ, Registers
        from flowvm.passes.fuse_torch import fuse_torch
        reg = Registers(x=torch.ones(8))
        drv = fuse_torch(LOOP(SEQ([CALL(torch.sin, reg("x"), store_to=reg("x")),
                                   CALL(torch.cos, reg("x"), store_to=reg("x"))])),
                         compile_after=0, payback=0).start()
        while True:
            drv.run(max_steps=10)
            time.sleep(0.01)
    """)
    env = python_env(TMPDIR=str(tmp_path))
    program = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    deadline = time.time() + 120
    mine = f"flowvm-aot-{program.pid}-"
    while time.time() < deadline and not any(n.startswith(mine) and os.path.exists(tmp_path / n / "job.pkl")
                                             for n in os.listdir(tmp_path)):
        assert program.poll() is None, program.stderr.read()[-2000:]
        time.sleep(0.05)
    program.send_signal(signal.SIGKILL)
    program.wait()
    left = [n for n in os.listdir(tmp_path) if n.startswith(mine)]
    assert left  # a killed program removes nothing
    time.sleep(1.0)  # its child notices and exits
    nxt = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import threading
        from flowvm.fused import outofprocess, resources
        resources.slot = None  # the sweep comes first; this compile goes no further
        done = threading.Event()
        outofprocess.Compile(b"job", None, lambda run, error: done.set())
        done.wait(30)
    """)], env=env, capture_output=True, text=True, timeout=60)
    assert nxt.returncode == 0, nxt.stderr[-2000:]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(mine)]


@pytest.mark.heavy
def test_two_programs_optimizing_at_once_queue_for_one_slot_and_both_end_compiled(tmp_path):
    # one slot for the whole machine; the first child of program "a" finds no resources (injected) and is
    # tried again: both programs end with their step compiled, neither reports a failure
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""
        import errno, os
        from flowvm.fused import outofprocess
        real = outofprocess._compile
        def short_once(workdir):
            mark = os.environ.get("SHORT_ONCE")
            if mark and not os.path.exists(mark):
                open(mark, "w").close()
                raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
            return real(workdir)
        outofprocess._compile = short_once
    """))
    script = textwrap.dedent("""
        import json, time, torch
        from flowvm import CALL, LOOP, SEQ, Registers
        from flowvm.fused import resources
        from flowvm.passes.fuse_torch import fuse_torch
        resources.backoff = lambda tries: 0.5
        reg = Registers(x=torch.linspace(-2, 2, 64))
        ops = [torch.sin, torch.exp, torch.tanh, torch.sigmoid]
        body = SEQ([CALL(op, reg("x" if i == 0 else "h"), store_to=reg("h")) for i, op in enumerate(ops)])
        drv = fuse_torch(LOOP(body), compile_after=0, payback=0).start()
        rt = drv.program.body.runtime()
        deadline = time.time() + 400
        while (rt.hits == 0 and rt.refused is None and rt.error is None) and time.time() < deadline:
            drv.run(max_steps=5)
            time.sleep(0.05)  # the programs leave the cores to the compiles, which run at the lowest priority
        print(json.dumps({"hits": rt.hits, "refused": rt.refused, "error": repr(rt.error), "state": rt.state}))
    """)
    env = python_env(FLOWVM_COMPILE_PROCESSES="1")
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    mark = tmp_path / "short"
    programs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=dict(env, SHORT_ONCE=str(mark) if k == 0 else ""))
                for k in range(2)]
    for program in programs:
        out, err = program.communicate(timeout=450)
        assert program.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["hits"] > 0 and got["refused"] is None and got["error"] == "None", got
    assert mark.exists()  # the injected shortage happened, and was tried again
