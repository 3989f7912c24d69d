"""A background compile never changes what the running program does (flowvm/fused/isolation.py): torch.fx's
process-wide patches made while tracing on the compile thread, and dynamo's and inductor's restoring of the
global random generator, stay off the program's thread."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flowvm
from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.fused import compiler
from flowvm.passes import optimize
from flowvm.program.paths import walk


class Doubled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, y):
        return torch.relu(self.lin(y)) * 2


def test_tracing_on_the_compile_thread_leaves_the_programs_module_calls_alone():
    """What AOTAutograd, inductor's pattern matcher and the direct form do on the compile thread, hundreds
    of times, while the program calls an nn.Sequential eagerly on the main thread."""
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reg = Registers(x=torch.randn(32, 8))
    prog = REPEAT(10**9, CALL(model, reg("x"), store_to=reg("out")))
    expected = model(reg["x"])
    traced = []

    def tracing():
        traced_module = Doubled()
        for _ in range(300):
            torch.fx.symbolic_trace(traced_module)  # patches torch.nn.Module.__call__ while it traces
            make_fx(traced_module)(torch.randn(2, 4))
            traced.append(1)

    done = threading.Event()
    compiler.submit_compile(lambda: (tracing(), done.set()))
    drv = prog.start()
    while not done.wait(0):
        drv.run(max_steps=50)  # raised NameError: module is not installed as a submodule
        assert torch.equal(reg["out"], expected)
    assert len(traced) == 300 and drv.steps > 0


@pytest.mark.heavy
def test_a_background_compile_leaves_the_programs_random_generators_and_settings_alone():
    """A real inductor compile of a training step (forward and backward, its disk cache off so that it
    takes a while) in the background while the program runs eagerly and draws from torch's, Python's and
    numpy's global generators: every number drawn is the one drawn with no compile at all."""
    torch.manual_seed(0)
    prog = optimize(build_training(), options={"fuse-torch": {"form": "compiled",
                                                              "options": {"fx_graph_cache": False}}})
    fused = next(el for _, el in walk(prog) if isinstance(el, flowvm.FUSED))
    rt = fused.runtime()

    def draw():
        return torch.rand(1).item(), random.random(), float(np.random.random())

    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    drv = prog.start()
    drawn, settings = [], set()
    deadline = time.monotonic() + 240
    while (rt.compiles == 0 or rt.state == "compiling") and time.monotonic() < deadline:
        drv.run(max_steps=1)
        for _ in range(200):
            drawn.append(draw())
        settings.add((torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()))
    assert rt.compiles == 1 and rt.error is None and rt.state != "compiling"
    overlapped = len(drawn)
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    assert [draw() for _ in range(overlapped)] == drawn  # no number replayed or skipped
    assert settings == {(torch.float32, False)}


def build_training(steps=10**6):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    reg = Registers(x=torch.randn(16, 4, generator=g), y=torch.randn(16, 1, generator=g))
    return SEQ([REPEAT(steps, SEQ([
        CALL(opt.zero_grad),
        CALL(model, reg("x"), store_to=reg("out")),
        CALL(F.mse_loss, reg("out"), reg("y"), store_to=reg("loss")),
        CALL(torch.Tensor.backward, reg("loss")),
        CALL(opt.step),
    ]))])



def test_the_compile_threads_setting_back_the_process_wide_settings_changes_nothing():
    """Dynamo sets the default dtype and deterministic algorithms back to what they were when its trace
    began; from the compile thread, after the program changed them meanwhile, that would undo the change."""
    import threading

    from flowvm.fused.isolation import isolate_random_state

    done = threading.Event()
    go = threading.Event()

    def compile_thread():
        go.wait(10)
        torch.set_default_dtype(torch.float32)  # what dynamo's preserve_global_state does at its end
        torch.use_deterministic_algorithms(False)
        done.set()

    thread = threading.Thread(target=compile_thread, name="flowvm-compile-test")
    isolate_random_state(thread)
    thread.start()
    try:
        torch.set_default_dtype(torch.float64)  # the program's own changes, made while the compile runs
        torch.use_deterministic_algorithms(True)
        go.set()
        assert done.wait(10)
        thread.join(10)
        assert torch.get_default_dtype() is torch.float64 and torch.are_deterministic_algorithms_enabled()
        torch.set_default_dtype(torch.float32)  # the program's own thread still sets them
        assert torch.get_default_dtype() is torch.float32
    finally:
        torch.set_default_dtype(torch.float32)
        torch.use_deterministic_algorithms(False)
