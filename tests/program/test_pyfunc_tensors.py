"""@flowvm.program with tensors, optimized, proven by search: random functions of the supported statements and
tensor statements (tests/program/pyfuncs.py, ``tensor_function``) are optimized (fuse-torch fuses runs of
tensor statements, here in the eager form) and must give what the function run as Python gives, bit for bit,
straight and from a copy cut at a random step, in this process and in a fresh one."""

from __future__ import annotations

import pickle

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import flowvm

from pyfuncs import tensor_function
from test_pyfunc_property import ARGS, load, outcome, resume_elsewhere


def tensors():
    gen = torch.Generator().manual_seed(0)
    t, u = torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)
    m = torch.eye(3) * 0.9 + 0.1 * torch.randn(3, 3, generator=gen)
    return t, u, m, torch.randn(3, generator=gen).requires_grad_()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(source=tensor_function(), which=st.sampled_from(ARGS), cut=st.floats(0, 1))
def test_a_random_tensor_function_optimized_runs_and_resumes_as_python_does(tmp_path_factory, source, which, cut):
    """The optimizer fuses runs of tensor statements (eager form: the same statement functions, in order): the
    optimized program gives Python's values bit for bit, and resumes so from a copy taken at any step where a
    copy may be taken (a run between a loss and its backward steps on to one)."""
    module = load(tmp_path_factory.mktemp("pyft"), source)
    plain_log: list = []
    want = outcome(lambda: module.f.function(*which, plain_log, *tensors()))
    eager = {"fuse-torch": {"form": "eager"}}

    def optimized(log):
        return flowvm.optimize(module.f(*which, log, *tensors()), options=eager)

    log: list = []
    drv = optimized(log).start()
    assert outcome(drv.run) == want, source
    assert drv.registers["log"] == plain_log, source
    event(f"fused steps: {min(len(flowvm.fused_steps(drv.program)), 3)}")
    first = optimized([]).start()
    done = outcome(lambda: first.run(max_steps=int(cut * drv.steps)))
    if done[0] == "raised":  # the cut came after the error
        assert done == want, source
        return
    assert outcome(first.run_to_copyable) == ("value", None), source
    copy = pickle.loads(pickle.dumps(first))
    assert outcome(copy.run) == want, f"cut at step {first.steps} of {drv.steps}\n{source}"
    assert copy.registers["log"] == plain_log, source


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(source=tensor_function(), which=st.sampled_from(ARGS))
def test_a_half_run_optimized_program_resumes_in_a_process_that_never_ran_the_function(tmp_path_factory, source,
                                                                                      which):
    folder = tmp_path_factory.mktemp("pyft")
    module = load(folder, source)
    plain_log: list = []
    want = outcome(lambda: module.f.function(*which, plain_log, *tensors()))
    fast = flowvm.optimize(module.f(*which, [], *tensors()), options={"fuse-torch": {"form": "eager"}})
    drv = fast.start()
    done = outcome(lambda: drv.run(max_steps=5))
    if done[0] == "raised":  # an error before the cut
        assert done == want, source
        return
    assert drv.run_to_copyable() is None
    value, log, fused = resume_elsewhere(folder, drv)
    assert value == repr(want) and log == repr(plain_log), source
    assert int(fused) == len(flowvm.fused_steps(fast)), source
