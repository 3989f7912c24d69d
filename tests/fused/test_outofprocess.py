"""A background compile of a step over plain tensors runs in a child process (AOTInductor): the program's
interpreter never imports or runs the compiler; anything the child refuses compiles on the thread instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

import flowvm
from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.fused import checks, outofprocess, threadcompile
from flowvm.passes.fuse_torch import fuse_torch

F = torch.nn.functional


def chain(n, x=None):
    reg = Registers(x=torch.linspace(-2, 2, 64) if x is None else x)
    ops = [torch.sin, torch.exp, torch.tanh, torch.sigmoid]
    body = SEQ([CALL(op, reg("x" if i == 0 else "h"), store_to=reg("h")) for i, op in enumerate(ops)])
    return REPEAT(n, body), reg


@pytest.fixture
def asked(monkeypatch) -> list:
    """The compiles asked of the compile thread (its compiler imports checked first; never started here)."""
    calls: list = []
    monkeypatch.setattr(threadcompile, "compiler_ready", lambda names: calls.append(names) or False)
    return calls


def python_env() -> dict:
    """The environment for a fresh interpreter that imports flowvm the way this one does."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def test_a_plain_tensor_step_compiles_in_a_child_process_and_the_program_never_imports_the_compiler():
    script = textwrap.dedent(f"""
        import json, sys, threading, time
        import torch
        from flowvm import CALL, LOOP, SEQ, Registers
        from flowvm.fused import outofprocess
        from flowvm.passes.fuse_torch import fuse_torch
        reg = Registers(x=torch.linspace(-2, 2, 64))
        ops = [torch.sin, torch.exp, torch.tanh, torch.sigmoid]
        body = SEQ([CALL(op, reg("x" if i == 0 else "h"), store_to=reg("h")) for i, op in enumerate(ops)])
        fast = fuse_torch(LOOP(body), compile_after=0)
        drv = fast.start()
        rt = fast.body.runtime()
        drv.run(max_steps=5)
        header = fast.body.header_text()
        deadline = time.time() + 240
        while rt._direct is None and rt.refused is None and time.time() < deadline:
            drv.run(max_steps=20)
            time.sleep(0.05)
        drv.run(max_steps=20000)  # the trial: both forms timed, one kept
        expected = torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"]))))
        print(json.dumps({{
            "header_while_compiling": header, "header": fast.body.header_text(), "hits": rt.hits,
            "refused": rt.refused, "close": bool(torch.allclose(reg["h"], expected, rtol=1e-5, atol=1e-6)),
            "compiler_imported": [m for m in ("torch._dynamo", "torch._inductor", "torch._inductor.compile_fx")
                                  if m in sys.modules],
            "threads": sorted(t.name for t in threading.enumerate()), "children": len(outofprocess._children)}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=python_env(),
                         timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "in another process" in got["header_while_compiling"]
    assert got["refused"] is None and got["hits"] > 0 and got["close"]
    assert "measured compiled" in got["header"]
    assert got["compiler_imported"] == []  # neither dynamo nor inductor ran in the program's process
    assert "flowvm-compile" not in got["threads"] and got["children"] == 0


def test_the_child_refuses_a_graph_the_direct_form_would_refuse_and_says_why(tmp_path):
    def head(r0):
        v = torch.relu_(r0)  # in-place: the caller's tensor changes
        return (v,)

    (tmp_path / "job.pkl").write_bytes(outofprocess.job_payload(head, (torch.ones(4),), {}))
    out = subprocess.run([sys.executable, "-c", outofprocess.CHILD, str(tmp_path)], capture_output=True,
                         text=True, env=python_env(), timeout=120)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "in-place or view op" in json.loads(out.stdout.strip().splitlines()[-1])["refused"]
    assert not (tmp_path / outofprocess.PACKAGE).exists()


def test_a_step_the_child_refuses_compiles_on_the_thread_instead(monkeypatch, asked):
    class Refusing:
        def __init__(self, payload, load, on_done):
            on_done(None, "aten.relu_.default: in-place or view op")

    monkeypatch.setattr(outofprocess, "Compile", Refusing)
    fast, reg = chain(20)
    fast = fuse_torch(fast, compile_after=0, payback=0)
    fast.run()
    rt = fast.body.runtime()
    assert rt.refused == "aten.relu_.default: in-place or view op" and rt.compiles == 0
    assert asked  # the thread's compile was asked for next (its imports first)
    assert torch.equal(reg["h"], torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"])))))


def test_a_head_whose_pickle_carries_data_compiles_on_the_thread(monkeypatch, asked):
    monkeypatch.setattr(checks, "MAX_JOB_BYTES", 10)
    fast, reg = chain(5)
    fast = fuse_torch(fast, compile_after=0, payback=0)
    fast.run()
    rt = fast.body.runtime()
    assert rt.refused is not None and "carries data" in rt.refused and asked and not outofprocess._children


def user_sin(x):
    return torch.sin(x)


@pytest.mark.parametrize("case", ["module", "tensor constant", "needs grad", "module method", "user function",
                                  "bound tensor method", "compile_in thread"])
def test_what_stays_on_the_thread(case):
    x = torch.ones(4)
    reg = Registers(x=x)
    calls = [CALL(torch.sin, reg("x")), CALL(torch.cos, reg("x"))]
    args = (x,)
    assert outofprocess.eligible(calls, args)
    assert outofprocess.eligible([CALL(torch.Tensor.add, reg("x"), 1.0), CALL(F.relu, reg("x")),
                                  CALL(torch.ops.aten.cos.default, reg("x"))], args)
    if case == "module":
        calls = [CALL(torch.nn.ReLU(), reg("x")), CALL(torch.cos, reg("x"))]
    elif case == "tensor constant":
        calls = [CALL(torch.add, reg("x"), torch.ones(4)), CALL(torch.cos, reg("x"))]
    elif case == "needs grad":
        args = (torch.ones(4, requires_grad=True),)
    elif case == "module method":
        calls = [CALL(torch.nn.Linear(4, 4).forward, reg("x")), CALL(torch.cos, reg("x"))]
    elif case == "user function":  # it may read state of this process the child would not see
        calls = [CALL(user_sin, reg("x")), CALL(torch.cos, reg("x"))]
    elif case == "bound tensor method":
        calls = [CALL(torch.ones(4).add, reg("x")), CALL(torch.cos, reg("x"))]
    if case == "compile_in thread":
        with pytest.raises(ValueError, match="compile_in"):
            fuse_torch(chain(2)[0], compile_in="elsewhere")
        fast = fuse_torch(chain(2)[0], compile_in="thread")
        assert fast.body.settings.compile_in == "thread" and "compile_in='thread'" in flowvm.to_source(fast)
        return
    assert not outofprocess.eligible(calls, args)


def test_a_program_that_ends_leaves_no_compile_running(tmp_path):
    script = textwrap.dedent("""
        import torch
        from flowvm import CALL, REPEAT, SEQ, Registers
        from flowvm.fused import outofprocess
        from flowvm.passes.fuse_torch import fuse_torch
        reg = Registers(x=torch.ones(8))
        fast = fuse_torch(REPEAT(50, SEQ([CALL(torch.sin, reg("x"), store_to=reg("x")),
                                          CALL(torch.cos, reg("x"), store_to=reg("x"))])),
                          compile_after=0, payback=0)
        fast.run()
        import time
        deadline = time.time() + 30
        while not outofprocess._children and time.time() < deadline:
            time.sleep(0.01)
        print(*(p.pid for p in outofprocess._children), flush=True)
        print(*outofprocess._workdirs, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=python_env(),
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    pids, workdirs = [int(p) for p in lines[-2].split()], lines[-1].split()
    assert pids and workdirs  # a compile was under way when the program ended
    import time

    deadline = time.time() + 10
    while time.time() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids)
    assert not any(os.path.exists(w) for w in workdirs)  # and its files are gone


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Eager:
    """Stands in for a compile in a child process: its "package" computes the head eagerly, changed by wrong."""

    wrong = None

    def __init__(self, payload, load, on_done):
        import pickle

        head = pickle.loads(payload)["head"]

        def run(inputs):
            out = list(head(*inputs))
            if Eager.wrong == "values":
                return [o + 1 for o in out]
            return [o.double() for o in out] if Eager.wrong == "dtype" else out

        on_done(run, None)


@pytest.mark.parametrize("wrong", ["values", "dtype"])
def test_a_graph_compiled_elsewhere_that_disagrees_with_eager_is_dropped_for_the_threads_compile(monkeypatch, asked,
                                                                                                 wrong):
    monkeypatch.setattr(Eager, "wrong", wrong)
    monkeypatch.setattr(outofprocess, "Compile", Eager)
    fast, reg = chain(30)
    fast = fuse_torch(fast, compile_after=0, payback=0)
    fast.run()
    rt = fast.body.runtime()
    assert rt.refused.startswith("its first result differs from eager's") and rt._direct is None
    assert asked and rt.hits == 0 and rt.state == "compiling"
    assert torch.equal(reg["h"], torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"])))))


@pytest.mark.parametrize("other", ["negative view", "autocast", "new shape"])
def test_the_compiled_package_runs_only_for_the_inputs_it_was_built_for(monkeypatch, asked, other):
    monkeypatch.setattr(outofprocess, "Compile", Eager)
    fast, reg = chain(1)
    fast = fuse_torch(fast.body, compile_after=0, payback=0, form="compiled")
    rt = fast.runtime()
    fast.run()  # starts the (stand-in) compile
    fast.run()  # runs the package
    assert rt.hits == 1 and rt.refused is None and not asked
    x = reg["x"]
    if other == "negative view":
        reg["x"] = torch._neg_view(x.neg())  # the same values, with a lazy negation
        fast.run()
    elif other == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fast.run()
    else:
        reg["x"] = torch.linspace(-2, 2, 65)
        fast.run()
    assert rt.hits == 1 and asked  # eager, and a compile on the thread asked for
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=other == "autocast"):
        expected = torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"]))))
    assert torch.equal(reg["h"], expected)


@pytest.mark.parametrize("kind", ["nested", "sparse", "negative view", "conjugate"])
def test_inputs_a_package_cannot_take_compile_on_the_thread_without_an_error(monkeypatch, asked, kind):
    x = {"nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
         "sparse": lambda: torch.eye(3).to_sparse(),
         "negative view": lambda: torch._neg_view(torch.ones(3)),
         "conjugate": lambda: torch.ones(3, dtype=torch.complex64).conj()}[kind]()
    assert not outofprocess.plain_tensor(x)
    reg = Registers(x=x)
    fast = fuse_torch(REPEAT(3, SEQ([CALL(torch.mul, reg("x"), 2, store_to=reg("h")),
                                      CALL(torch.mul, reg("h"), 3, store_to=reg("h"))])), compile_after=0, payback=0)
    fast.run()
    assert asked and fast.body.runtime().compiles == 0


def test_the_torch_settings_that_change_results_travel_with_the_job():
    import pickle

    before, x = torch.get_default_dtype(), torch.ones(2)
    torch.set_default_dtype(torch.float64)
    try:
        job = pickle.loads(outofprocess.job_payload(torch.sin, (x,), {}))
    finally:
        torch.set_default_dtype(before)
    assert job["default_dtype"] is torch.float64
    assert job["matmul_precision"] == torch.get_float32_matmul_precision()
    assert job["layouts"] == [((2,), (1,), torch.float32)]


def test_a_process_forked_while_a_compile_runs_compiles_on_its_thread_instead(monkeypatch, asked):
    class Pending:  # a compile in a child process that has not finished when the program forks
        def __init__(self, payload, load, on_done):
            pass

    monkeypatch.setattr(outofprocess, "Compile", Pending)
    fast, reg = chain(10)
    fast = fuse_torch(fast, compile_after=0, payback=0)
    drv = fast.start()
    drv.run(max_steps=3)
    rt = fast.body.runtime()
    assert rt._job_running and rt.state == "compiling" and not asked
    pid = os.fork()
    if pid == 0:  # the forked process: its step must not wait for a result that only its parent gets
        ok = False
        try:
            drv.run()
            ok = (rt.refused == "the process forked while its compile ran" and asked and not rt._job_running
                  and torch.equal(reg["h"], torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"]))))))
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    drv.run()  # the parent still waits for its own compile
    assert rt._job_running and rt.refused is None and not asked


def test_a_child_that_gets_no_cpu_is_stopped_after_the_bound_and_one_that_works_is_not(monkeypatch):
    monkeypatch.setattr(outofprocess, "STARVE_SECONDS", 2.0)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    out, err, why = outofprocess._wait(idle)
    assert idle.returncode is not None and why is not None and "busy machine" in why and "compiles on the thread" in why
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass\n"
                             "print('done')"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err, why = outofprocess._wait(busy)
    assert why is None and busy.returncode == 0 and out.strip() == b"done"


def test_on_a_machine_whose_every_core_is_busy_the_childs_compile_gives_way_to_the_thread(monkeypatch, asked):
    monkeypatch.setattr(outofprocess, "STARVE_SECONDS", 5.0)
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        fast, reg = chain(10)
        fast = fuse_torch(REPEAT(10 ** 9, fast.body), compile_after=0, payback=0)
        drv = fast.start()
        rt = fast.body.runtime()
        deadline = time.monotonic() + 120
        while rt.refused is None and time.monotonic() < deadline:
            drv.run(max_steps=50)
            time.sleep(0.2)
        drv.run(max_steps=50)
    finally:
        for proc in spin:
            proc.kill()
            proc.wait()
    assert rt.refused is not None and "busy machine" in rt.refused, rt.refused
    assert asked and not outofprocess._children  # the thread's compile asked for next, no child left
    assert torch.equal(reg["h"], torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"])))))
