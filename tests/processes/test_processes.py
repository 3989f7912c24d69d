"""POPEN and SPAWN together: listings, analysis, mixed programs, and no process left behind at exit."""

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from flowvm import CALL, POPEN, REPEAT, SEQ, SPAWN, WEAVE, Registers, VerifyError
from flowvm.program.analysis import reads, writes
from flowvm.machine.driver import has_weave

pytestmark = pytest.mark.timeout(90)

PY = sys.executable


def square(x):
    return x * x


def test_the_listing_shows_the_fragment_under_its_spawn_and_the_cursor_on_a_running_leaf():
    reg = Registers(x=3)
    prog = SEQ([SPAWN(CALL(square, reg("x"), store_to=reg("y"))), POPEN(["true"], store_to=reg("rc"))])
    drv = prog.start()
    drv.step()
    assert str(drv).splitlines()[1:] == [
        "   SEQ:  # at child 0 of 2",
        ">>     SPAWN:",
        "           y = square(x)",
        "       rc = POPEN ['true']",
    ]
    drv.run()
    assert reg["y"] == 9 and reg["rc"] == 0


def test_analysis_and_verification_see_through_a_spawn():
    reg = Registers(x=1)
    frag = SEQ([CALL(square, reg("x"), store_to=reg("y")), POPEN(["echo", reg("y")], store_to=reg("rc"))])
    prog = SEQ([SPAWN(frag, store_to=reg("v")), CALL(square, reg("rc"))])
    assert reads(prog) == {"x", "y", "rc"} and writes(prog) == {"y", "rc", "v"}
    prog.start()  # rc is written by the fragment before it is read
    with pytest.raises(VerifyError) as info:
        SEQ([CALL(square, reg("rc")), SPAWN(frag)]).start()
    assert info.value.register == "rc"


def test_a_weave_inside_a_fragment_keeps_the_parent_on_its_fast_path():
    reg = Registers(x=1)
    inner = SPAWN(WEAVE(-1, [CALL(square, reg("x"), store_to=reg("a")), CALL(square, reg("x"), store_to=reg("b"))]))
    assert not has_weave(SEQ([REPEAT(3, CALL(square, reg("x"))), inner]))
    assert has_weave(WEAVE(-1, [inner]))
    SEQ([REPEAT(3, CALL(square, reg("x"))), inner]).run()
    assert reg["a"] == reg["b"] == 1


def test_a_sweep_of_spawns_and_commands_under_arun():
    reg = Registers(lrs=[0.1, 0.2, 0.3])
    trials = [SPAWN(CALL(lambda lrs, i=i: (lrs[i], os.getpid()), reg("lrs"), store_to=reg(f"trial{i}")))
              for i in range(3)]
    prog = SEQ([WEAVE(-1, trials + [POPEN([PY, "-c", "print('side job')"], capture=True, store_to=reg("side"))]),
                CALL(lambda *ts: sorted(t[0] for t in ts), reg("trial0"), reg("trial1"), reg("trial2"))])
    assert asyncio.run(prog.start().arun()) == [0.1, 0.2, 0.3]
    assert reg["side"].stdout == "side job\n"
    assert all(reg[f"trial{i}"][1] != os.getpid() for i in range(3))


def test_nothing_outlives_an_interpreter_that_exits_with_work_in_flight():
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        import psutil
        from flowvm import CALL, POPEN, SPAWN, WEAVE
        if __name__ == "__main__":
            drv = WEAVE(-1, [SPAWN(CALL(time.sleep, 60)), SPAWN(CALL(time.sleep, 60)),
                             POPEN(["sleep", "60"]), POPEN(["sh", "-c", "sleep 60 & wait"])]).start()
            drv.run(max_steps=8)
            time.sleep(1.0)  # let the pool's workers and the shell's child start
            print(*(p.pid for p in psutil.Process().children(recursive=True)), flush=True)
    """)
    t0 = time.monotonic()
    done = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) >= 5  # two commands, the shell's sleep, the pool's worker(s) and its server
    assert took < 30  # exit does not wait for the 60 s fragments
    end = time.monotonic() + 10
    left = pids
    while left and time.monotonic() < end:
        left = [p for p in left if alive(p)]
        time.sleep(0.05)
    assert left == [], f"processes left behind: {left}"


def alive(pid):
    """Running or sleeping; a zombie is dead (reparented to init once its parent exited)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_command_round_trips_through_python_source():
    reg = Registers(x=2)
    prog = SEQ([CALL(square, reg("x"), store_to=reg("y")),
                POPEN(["echo", reg("y")], store_to=reg("rc"), check=True, capture=True, timeout=30)])
    el = prog.elements[1]
    assert el.__flowvm_source__() == (POPEN, (["echo", reg("y")],),
                                      {"store_to": reg("rc"), "check": True, "capture": True, "timeout": 30.0})
    from flowvm.views.source import from_source, to_source

    again = from_source(to_source(prog))
    assert str(again) == str(prog) and again.run().stdout == "4\n"


def test_a_spawn_names_its_constructor_arguments_for_source():
    reg = Registers(x=2)
    frag = CALL(square, reg("x"), store_to=reg("y"))
    el = SPAWN(frag, executor="cluster", store_to=reg("v"), timeout=5)
    assert el.__flowvm_source__() == (SPAWN, (frag,), {"executor": "cluster", "store_to": reg("v"), "timeout": 5.0})
    ctor, args, kwargs = el.__flowvm_source__()
    assert str(ctor(*args, **kwargs)) == str(el)


def test_assert_same_run_compares_everything_but_timing_dependent_step_counts():
    from flowvm.testing import assert_same_run

    def build():
        reg = Registers(x=3, log=[])
        return SEQ([
            WEAVE(-1, [SPAWN(CALL(square, reg("x"), store_to=reg("y"))), POPEN([PY, "-c", "pass"], store_to=reg("rc"))]),
            CALL(square, reg("y"), store_to=reg("z")),
        ])

    expected = assert_same_run(build, cuts=[0, 1, 2], copiers=["pickle", "checkpoint"])
    assert expected["registers"]["z"] == 81 and expected["registers"]["rc"] == 0
    with pytest.raises(AssertionError, match="differ"):  # a run that cannot be the same twice is caught
        assert_same_run(lambda: SEQ([CALL(time.monotonic_ns, store_to=Registers()("t"))]), cuts=[0],
                        copiers=["pickle"])
