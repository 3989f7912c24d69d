"""fuse-torch on a ``@flowvm.program`` training loop: its tensor statements (the forward pass, the loss, the
backward) become one FUSED step, which compiles (one thread compile, shared by the module's tests) and then
computes what the eager form computes, to float rounding; a copy of the run taken at a step boundary resumes
the compiled run."""

from __future__ import annotations

import importlib
import pickle
import sys
import textwrap

import pytest
import torch

import flowvm

SOURCE = """
import torch
import torch.nn.functional as F
import flowvm


@flowvm.program
def train(net, x, y, steps):
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    losses = []
    for s in range(steps):
        opt.zero_grad()
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
"""
COMPILED = {"fuse-torch": {"form": "compiled", "background": False, "compile_in": "thread"}}


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stmts")
    (folder / "stmt_train.py").write_text(textwrap.dedent(SOURCE))
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    yield importlib.import_module("stmt_train")
    sys.path.remove(str(folder))


def arguments(steps=12):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return net, torch.randn(64, 6), torch.randint(0, 4, (64,)), steps


@pytest.fixture(scope="module")
def compiled_run(module):
    fast = flowvm.optimize(module.train(*arguments()), options=COMPILED)
    drv = fast.start()
    drv.run()
    return drv


def test_the_forward_pass_loss_and_backward_fuse_into_one_step_that_compiles(module, compiled_run):
    [(where, step)] = flowvm.fused_steps(compiled_run.program)
    assert [c.fn.text for c in step.calls] == ["logits = net(x)", "loss = F.cross_entropy(logits, y)",
                                               "loss.backward()"]
    assert step.header_text() == "FUSED 3 calls, torch.compile(inductor): compiled (forced):"
    assert step.runtime().refused is None
    want = module.train.function(*arguments())
    assert compiled_run.result == pytest.approx(want, rel=1e-5)
    assert compiled_run.result[-1] < compiled_run.result[0]


def test_a_copy_of_the_compiled_run_resumes_it(module, compiled_run):
    drv = flowvm.optimize(module.train(*arguments()), options=COMPILED).start()
    drv.run(max_steps=30)
    assert drv.run_to_copyable() is None
    copy = pickle.loads(pickle.dumps(drv))
    assert copy.run() == pytest.approx(compiled_run.result, rel=1e-5)
    [(_, step)] = flowvm.fused_steps(copy.program)
    assert step.header_text() == "FUSED 3 calls, torch.compile(inductor): compiled (forced):"
