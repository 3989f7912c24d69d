"""A program that ends while a compile is under way (on the compile thread or in a child process) exits
cleanly: the compile thread's job is unwound and waited for, children are stopped, their files removed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

RUNS = 5


def python_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


STUCK = textwrap.dedent("""
    import threading, torch
    from flowvm.fused import compiler
    x = torch.randn(300, 300)
    started = threading.Event()
    def job():  # a compile's torch calls, each releasing the GIL, still running when the program ends
        started.set()
        while True:
            torch.mm(x, x)
    compiler.submit_compile(job)
    started.wait(10)
    print("done", flush=True)
""")


def test_a_program_ending_while_the_compile_thread_is_inside_torch_exits_cleanly_every_time():
    # A daemon thread inside a torch call when the interpreter finalizes is stopped where it takes the GIL
    # back, which unwinds C++ code: "terminate called without an active exception", exit status 134.
    procs = [subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=python_env()) for _ in range(RUNS)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.strip() == "done", err[-2000:]
        assert "terminate called" not in err


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_program_ending_with_a_real_compile_in_flight_exits_cleanly(where):
    script = textwrap.dedent(f"""
        import torch
        from flowvm import CALL, LOOP, SEQ, Registers
        from flowvm.fused import outofprocess
        from flowvm.passes.fuse_torch import fuse_torch
        reg = Registers(x=torch.ones(8), y=torch.ones(8))
        first = fuse_torch(LOOP(SEQ([CALL(torch.sin, reg("x"), store_to=reg("x")),
                                     CALL(torch.cos, reg("x"), store_to=reg("x"))])),
                           compile_after=0, payback=0, compile_in={where!r}).start()
        second = fuse_torch(LOOP(SEQ([CALL(torch.tanh, reg("y"), store_to=reg("y")),
                                      CALL(torch.exp, reg("y"), store_to=reg("y"))])),
                            compile_after=0, payback=0, compile_in="thread").start()
        for _ in range(200):
            first.run(max_steps=20)
            second.run(max_steps=20)
        print(first.program.body.runtime().state, second.program.body.runtime().state, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=python_env(),
                         timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compiling" in out.stdout  # a compile was under way at the end
