"""A fused step calling torch modules (a training step's forward pass, with the backward after it) compiles in
a child process too: its parameters and buffers become the packages' inputs, a backward package computes
their gradients, and anything the packages cannot do compiles on the thread instead."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from flowvm import CALL, REPEAT, SEQ, FusionWarning, Registers
from flowvm.fused import kernel, outofprocess, stateful, threadcompile
from flowvm.fused.refused import Refused
from flowvm.passes.fuse_torch import fuse_torch


F = torch.nn.functional


def python_env() -> dict:
    import os

    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


@pytest.fixture
def asked(monkeypatch) -> list:
    """The compiles asked of the compile thread (never started here)."""
    calls: list = []
    monkeypatch.setattr(threadcompile, "compiler_ready", lambda names: calls.append(names) or False)
    return calls


def mlp(*extra) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), *extra, torch.nn.Linear(16, 3))


def step_calls(net, reg):
    return [CALL(net, reg("x"), store_to=reg("logits")), CALL(F.cross_entropy, reg("logits"), reg("y"),
                                                                store_to=reg("loss"))]


def data():
    g = torch.Generator().manual_seed(3)
    return Registers(x=torch.randn(32, 8, generator=g), y=torch.randint(0, 3, (32,), generator=g))


def plan_of(calls, reg, names=("x", "y")):
    """The plan, or why the step is refused (the reason runtime().refused shows)."""
    try:
        return stateful.plan(calls, [reg(n) for n in names], tuple(reg[n] for n in names))
    except Refused as why:
        return str(why)


@pytest.mark.timeout(600)  # two cold compiles, each allowed 240 s by the script
def test_a_training_step_with_modules_compiles_in_a_child_process_and_trains_as_eager_does():
    """With BatchNorm (its running statistics updated in place) and dropout (random numbers drawn as eager
    code draws them, fallback_random), on scikit-learn's digits; then the same network's inference."""
    script = textwrap.dedent("""
        import json, sys, threading, time
        import torch
        import digits_training
        from flowvm import CALL, REPEAT, SEQ, Registers
        from flowvm.passes.fuse_torch import fuse_torch
        F = torch.nn.functional
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                  torch.nn.Dropout(0.2), torch.nn.Linear(32, 10))
        x, y, ref, opt, ref_opt, reg, done, fast = digits_training.program(net)
        torch.manual_seed(1)  # the dropout masks: the same draws for the program and the reference
        drv = fast.start()
        el = next(e for _, e in fast.walk() if type(e).__name__ == "FUSED")
        rt = el.runtime()
        drv.run(max_steps=5)
        header = el.header_text()
        deadline = time.time() + 240
        while rt._direct is None and rt.refused is None and time.time() < deadline:
            drv.run(max_steps=5)
            time.sleep(0.05)
        drv.run(max_steps=5 * 200)  # about 200 more updates, on the package
        for _ in range(10):  # up to the end of an update
            if int(net[1].num_batches_tracked) == len(done):
                break
            drv.run(max_steps=1)
        updates = len(done)
        torch.manual_seed(1)
        for _ in range(updates):
            ref_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
        stats = max((a - b).abs().max().item() for a, b in zip(net.buffers(), ref.buffers()))
        max_diff = max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters()))
        kernel = rt._direct[1]
        loss = kernel(kernel.ready(), [x, y])[1]
        try:
            loss.backward(create_graph=True)
            twice = "no error"
        except RuntimeError as err:
            twice = str(err)
        net.eval()  # BatchNorm's running statistics, no dropout
        ref.eval()
        with torch.no_grad():
            infer = fuse_torch(REPEAT(400, SEQ([CALL(net, reg("x"), store_to=reg("logits")),
                                                CALL(F.softmax, reg("logits"), dim=1, store_to=reg("p"))])),
                               compile_after=0, payback=0, form="compiled")
            inf_rt = next(e for _, e in infer.walk() if type(e).__name__ == "FUSED").runtime()
            d2 = infer.start()
            d2.run(max_steps=2)  # the compile starts; the 400 iterations wait for its package
            deadline = time.time() + 240
            while inf_rt._direct is None and inf_rt.refused is None and time.time() < deadline:
                time.sleep(0.05)
            d2.run()
            p = reg["p"]
            expected = F.softmax(net(x), dim=1)
        print(json.dumps({
            "header_while_compiling": header, "refused": rt.refused, "hits": rt.hits, "updates": updates,
            "state": rt.state, "inference_refused": inf_rt.refused, "inference_hits": inf_rt.hits,
            "inference_close": bool(torch.allclose(p, expected, atol=1e-6)),
            "max_diff": max_diff,
            "stats": stats, "loss": float(F.cross_entropy(net(x), y)), "ref_loss": float(F.cross_entropy(ref(x), y)),
            "twice": twice, "threads": sorted(t.name for t in threading.enumerate())}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=python_env(),
                         timeout=560)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "in another process" in got["header_while_compiling"]
    assert got["refused"] is None and got["state"] == "compiled"
    assert got["hits"] >= 200 and got["updates"] >= 200
    assert got["max_diff"] < 1e-3 and got["stats"] < 1e-3, got  # the same training as torch's own eager loop
    assert abs(got["loss"] - got["ref_loss"]) < 1e-3 and got["loss"] < 0.5
    assert got["inference_refused"] is None and got["inference_hits"] > 0 and got["inference_close"]
    assert "cannot be differentiated twice" in got["twice"]  # not a silent first-order gradient
    assert "flowvm-compile" not in got["threads"]  # the compile thread never ran


@pytest.mark.heavy
@pytest.mark.timeout(400)
def test_a_transformer_layer_trained_with_adam_on_the_package_matches_eager():
    """MultiheadAttention, LayerNorm and dropout in training, compiled in a child process."""
    script = textwrap.dedent("""
        import copy, json, time
        import torch
        from flowvm import CALL, REPEAT, SEQ, Registers
        from flowvm.passes.fuse_torch import fuse_torch
        F = torch.nn.functional
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True),
                                  torch.nn.Flatten(), torch.nn.Linear(16 * 8, 10))
        x, y = torch.randn(32, 8, 16), torch.randint(0, 10, (32,))
        ref = copy.deepcopy(net)
        opt, ref_opt = torch.optim.Adam(net.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3)
        reg = Registers(x=x, y=y)
        body = SEQ([CALL(opt.zero_grad), CALL(net, reg("x"), store_to=reg("logits")),
                    CALL(F.cross_entropy, reg("logits"), reg("y"), store_to=reg("loss")),
                    CALL(torch.Tensor.backward, reg("loss")), CALL(opt.step)])
        fast = fuse_torch(REPEAT(600, body), compile_after=0, payback=0, form="compiled")
        rt = next(e for _, e in fast.walk() if type(e).__name__ == "FUSED").runtime()
        torch.manual_seed(1)
        drv = fast.start()
        deadline = time.time() + 300
        while not drv.done:
            drv.run(max_steps=4)
            if rt._job_running and time.time() < deadline:
                time.sleep(0.5)  # few eager updates while it compiles
        torch.manual_seed(1)
        for _ in range(600):
            ref_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
        print(json.dumps({"refused": rt.refused, "hits": rt.hits, "state": rt.state,
                          "max_diff": max((a - b).abs().max().item() for a, b in zip(net.parameters(),
                                                                                   ref.parameters()))}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=python_env(),
                         timeout=380)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["refused"] is None and got["state"] == "compiled" and got["hits"] >= 300, got
    assert got["max_diff"] < 1e-3, got  # the same dropout masks, the same Adam updates to float rounding


def test_the_plan_lists_each_parameter_once_with_where_it_lives():
    net, reg = mlp(), data()
    shared = torch.nn.Linear(8, 8)
    twice = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)  # one Linear at two places
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    p = plan_of([CALL(opt.zero_grad)] + step_calls(net, reg), reg)
    assert p.pre == [opt.zero_grad] and p.modules == [net] and p.grad
    assert [id(s) for s in p.state] == [id(t) for t in net.parameters()]
    assert p.binds == [{"0.weight": 0, "0.bias": 1, "2.weight": 2, "2.bias": 3}]
    assert len(p.tree) == 4 and p.where[0] == [(net[0], "_parameters", "weight")]
    q = plan_of([CALL(twice, reg("x"), store_to=reg("h")), CALL(torch.sum, reg("h"), store_to=reg("s"))], reg, ("x",))
    assert len(q.state) == 2 and len(q.where[0]) == 2  # checked at both places before every call
    zero_grad_last = step_calls(net, reg) + [CALL(opt.zero_grad)]
    assert plan_of(zero_grad_last, reg) == "no module to compile, or a zero_grad call ends the step"


class Mine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x):  # code of the user's: it may read anything of this process
        return self.lin(x) * 2


SCALE = 1.0


def user_swish(x):  # reads a global of this process
    return x * torch.sigmoid(x) * SCALE


class ScaledConv(torch.nn.Conv1d):
    scale = 2.0

    def _conv_forward(self, x, weight, bias):  # torch's forward calls the user's code
        return super()._conv_forward(x, weight, bias) * self.scale


class Predicting(torch.nn.Sequential):
    def predict(self, x):  # a method of its own: what it computes is still torch's code
        return self(x).argmax(1)

    def extra_repr(self):
        return "predicting"


def test_a_subclass_computes_with_torch_code_when_it_overrides_nothing_torch_defines():
    assert stateful._torch_class(torch.nn.Linear) and stateful._torch_class(Predicting)
    assert not stateful._torch_class(ScaledConv) and not stateful._torch_class(Mine)


@pytest.mark.parametrize("case", ["forward hook", "parametrized", "tensor constant", "input needs grad", "no module",
                                  "sparse buffer", "forward set on the instance", "method set on the instance",
                                  "a bound method"])
def test_what_the_stateful_kind_leaves_to_the_thread(case):
    net, reg = mlp(), data()
    assert isinstance(plan_of(step_calls(net, reg), reg), stateful.Plan)
    calls = step_calls(net, reg)
    if case == "forward hook":
        net[0].register_forward_hook(lambda *a: None)
    elif case == "parametrized":
        torch.nn.utils.parametrizations.weight_norm(net[0])
    elif case == "tensor constant":
        calls = calls + [CALL(torch.add, reg("loss"), torch.ones(()), store_to=reg("loss"))]
    elif case == "input needs grad":
        reg["x"] = reg["x"].requires_grad_()
    elif case == "no module":
        calls = [CALL(torch.sin, reg("x"), store_to=reg("logits"))] + calls[1:]
    elif case == "sparse buffer":
        net[0].register_buffer("extra", torch.eye(3).to_sparse())
    elif case == "forward set on the instance":
        net[1].forward = lambda x: x * 2
    elif case == "method set on the instance":
        conv = torch.nn.Conv1d(1, 1, 3)
        conv._conv_forward = types.MethodType(lambda self, x, w, b: F.conv1d(x, w, b) * 2, conv)
        calls = [CALL(conv, reg("x"), store_to=reg("logits"))] + calls[1:]
    else:
        calls = [CALL(Predicting(torch.nn.Linear(8, 3)).predict, reg("x"), store_to=reg("logits"))] + calls[1:]
    why = plan_of(calls, reg)
    assert isinstance(why, str), why
    if case == "forward hook":
        assert why == "CALL logits = Sequential(x): Linear has hooks"


@pytest.mark.parametrize("case", ["user forward", "user function", "overridden torch method",
                                  "a function of the user's in a torch module"])
def test_a_step_with_code_of_the_users_compiles_in_the_child_under_guards(case):
    net, reg = mlp(), data()
    calls = step_calls(net, reg)
    if case == "user forward":
        calls = [CALL(Mine(), reg("x"), store_to=reg("logits"))] + calls[1:]
    elif case == "user function":
        calls = calls + [CALL(lambda v: v * 2, reg("loss"), store_to=reg("loss"))]
    elif case == "overridden torch method":
        calls = [CALL(ScaledConv(1, 1, 3), reg("x"), store_to=reg("logits"))] + calls[1:]
    else:
        layer = torch.nn.TransformerEncoderLayer(8, 2, activation=user_swish)
        calls = [CALL(layer, reg("x"), store_to=reg("logits"))] + calls[1:]
    p = plan_of(calls, reg)
    assert isinstance(p, stateful.Plan) and p.guarded and p.ready() is not None
    assert pickle.loads(stateful.payload(p, {}))["guarded"] is True
    assert not plan_of(step_calls(mlp(), reg), reg).guarded  # torch's own code needs no guards


def test_the_job_carries_layouts_not_data(tmp_path):
    torch.manual_seed(0)
    big = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 3))  # 16 MB
    opt = torch.optim.SGD(big.parameters(), lr=0.1, momentum=0.9)
    reg = Registers(x=torch.randn(4, 1000), y=torch.randint(0, 3, (4,)))
    for _ in range(2):  # momentum buffers: as large as the parameters
        opt.zero_grad()
        F.cross_entropy(big(reg["x"]), reg["y"]).backward()
        opt.step()
    p = plan_of([CALL(opt.zero_grad)] + step_calls(big, reg), reg)
    data_ = stateful.payload(p, {})
    assert len(data_) < 64_000
    job = pickle.loads(data_)
    module = job["modules"][0]
    assert job["kind"] == "stateful" and job["grad"] is True
    assert module[0].weight is job["state"][0]  # the same tensor in the modules and in the state
    assert isinstance(module[0].weight, torch.nn.Parameter) and module[0].weight.requires_grad
    assert module[0].weight.shape == (1000, 1000) and not module[0].weight.any()
    assert job["layouts"] == [((4, 1000), (1000, 1), torch.float32), ((4,), (1,), torch.int64)]


@pytest.mark.parametrize("case", ["dropout without fallback_random", "an input changed in place"])
def test_the_child_refuses_what_its_packages_cannot_do_as_eager_does_and_says_why(case, tmp_path):
    reg = data()
    if case == "dropout without fallback_random":
        net = mlp(torch.nn.Dropout(0.5))
        calls = step_calls(net, reg)
    else:
        net = mlp()
        calls = [CALL(torch.Tensor.mul_, reg("x"), 2, store_to=reg("x"))] + step_calls(net, reg)
    (tmp_path / "job.pkl").write_bytes(stateful.payload(plan_of(calls, reg), {"fallback_random": False}))
    out = subprocess.run([sys.executable, "-c", outofprocess.CHILD, str(tmp_path)], capture_output=True,
                         text=True, env=python_env(), timeout=200)
    assert out.returncode == 3, out.stderr[-2000:]
    reason = json.loads(out.stdout.strip().splitlines()[-1])["refused"]
    assert ("random numbers" in reason) if case.startswith("dropout") else ("in place" in reason), reason
    assert not any(f.suffix == ".pt2" for f in tmp_path.iterdir())


@pytest.mark.parametrize("make", [lambda: torch.nn.LSTM(8, 4, batch_first=True), lambda: torch.nn.GRU(8, 4),
                                  lambda: torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16),
                                  lambda: torch.nn.Sequential(torch.nn.Conv1d(1, 2, 3), torch.nn.BatchNorm1d(2))])
def test_the_state_check_passes_for_common_modules_as_they_are(make):
    module, reg = make(), data()
    p = plan_of([CALL(module, reg("x"), store_to=reg("h"))], reg, ("x",))
    assert isinstance(p, stateful.Plan) and p.ready() is not None
    module.train(not module.training)
    assert p.ready() is None


def test_a_parameter_added_where_there_was_none_is_seen():
    reg = data()
    net = torch.nn.Sequential(torch.nn.Linear(8, 3, bias=False))
    ready = stateful.ready_check(plan_of(step_calls(net, reg), reg))
    assert ready() is not None
    net[0].bias = torch.nn.Parameter(torch.zeros(3))
    assert ready() is None


def test_the_state_check_reads_the_modules_now():
    net, reg = mlp(torch.nn.Dropout(0.0)), data()
    p = plan_of(step_calls(net, reg), reg)
    ready = stateful.ready_check(p)
    got = ready()
    assert got is not None and all(a is b for a, b in zip(got, net.parameters()))
    net.eval()
    assert ready() is None  # a training flag
    net.train()
    with torch.no_grad():
        assert ready() is None  # the grad mode
    assert ready() is not None
    torch.set_default_dtype(torch.float64)
    try:
        assert ready() is None  # the default dtype, which the code's new tensors take
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.device("cpu"):
        assert ready() is None  # a default device (a torch function mode)
    assert ready() is not None
    net[0].weight.requires_grad_(False)
    assert ready() is None  # a frozen parameter
    net[0].weight.requires_grad_(True)
    net[2].p = 0.5
    assert ready() is None  # a setting (Dropout's p)
    net[2].p = 0.0
    handle = net[1].register_forward_hook(lambda *a: None)
    assert ready() is None  # a hook added since
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    assert ready() is None  # a hook for every module
    handle.remove()
    net.append(torch.nn.ReLU())
    assert ready() is None  # a submodule more
    del net[4]
    last = net[3]
    net[3] = torch.nn.Linear(16, 3)
    assert ready() is None  # another submodule in its place
    net[3] = last
    assert ready() is not None
    net[1].forward = lambda x: x
    assert ready() is None  # a forward of the instance's own
    del net[1].forward
    net[3].bias = torch.nn.Parameter(torch.zeros(4))
    assert ready() is None  # a parameter of another shape


class EagerKernel(kernel.Kernel):
    """Stands in for the packages: the step computed eagerly, its gradients doubled when ``wrong``."""

    wrong = False

    def __init__(self, p, workdir):
        self.plan, self.backward, self.ready, self.mutated, self.before = p, True, stateful.ready_check(p), [], None

    def __call__(self, state, inputs):
        if self.before is None:
            self.before = (state, [], torch.get_rng_state())
        if EagerKernel.wrong == "random numbers":
            torch.rand(1)  # a draw eager code does not make
        out = self.plan.head(*inputs)
        if EagerKernel.wrong != "gradients":
            return out
        return tuple(o.detach() + (o - o.detach()) * 2 if o.requires_grad else o for o in out)


class Immediate:
    def __init__(self, payload, load, on_done):
        on_done(load("no directory"), None)


def training(net, reg, n):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    body = SEQ([CALL(opt.zero_grad)] + step_calls(net, reg) + [CALL(torch.Tensor.backward, reg("loss")),
                                                                CALL(opt.step)])
    return fuse_torch(REPEAT(n, body), compile_after=0, payback=0, form="compiled"), opt


def eager_training(net, reg, n):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(n):
        opt.zero_grad()
        F.cross_entropy(net(reg["x"]), reg["y"]).backward()
        opt.step()


@pytest.mark.parametrize("wrong", ["gradients", "random numbers"])
def test_a_package_that_differs_from_eager_is_dropped_for_the_threads_compile_leaving_no_trace(monkeypatch, asked,
                                                                                               wrong):
    monkeypatch.setattr(outofprocess, "Compile", Immediate)
    monkeypatch.setattr(kernel, "Kernel", EagerKernel)
    monkeypatch.setattr(EagerKernel, "wrong", wrong)
    net, reg = mlp(), data()
    ref = mlp()
    fast, _ = training(net, reg, 6)
    torch.manual_seed(5)
    fast.run()
    after = torch.rand(3)
    rt = next(e for _, e in fast.walk() if type(e).__name__ == "FUSED").runtime()
    assert rt.refused.startswith(f"its first result differs from eager's ({wrong}") and rt._direct is None
    assert asked and rt.hits == 0
    torch.manual_seed(5)
    eager_training(ref, reg, 6)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters()))
    assert torch.equal(after, torch.rand(3))  # the generator as if the package had never run


def test_the_first_call_is_checked_with_the_parameters_it_ran_with(monkeypatch, asked):
    class Pending:  # a compile that finishes when the test says so
        done = None

        def __init__(self, payload, load, on_done):
            Pending.done = lambda: on_done(load("no directory"), None)

    monkeypatch.setattr(outofprocess, "Compile", Pending)
    monkeypatch.setattr(kernel, "Kernel", EagerKernel)
    monkeypatch.setattr(EagerKernel, "wrong", "gradients")
    net, reg = mlp(), data()
    fast, _ = training(net, reg, 1)
    fast.run()  # starts the compile
    net.load_state_dict({k: v.clone() for k, v in net.state_dict().items()}, assign=True)  # new tensors
    Pending.done()
    fast.run()  # the first call on the package: its gradients are twice eager's
    rt = next(e for _, e in fast.walk() if type(e).__name__ == "FUSED").runtime()
    assert rt.refused.startswith("its first result differs from eager's (gradients") and rt.hits == 0


def test_the_package_runs_only_for_the_state_it_was_built_for(monkeypatch, asked):
    monkeypatch.setattr(outofprocess, "Compile", Immediate)
    monkeypatch.setattr(kernel, "Kernel", EagerKernel)
    net, reg = mlp(), data()
    ref = mlp()
    fast, _ = training(net, reg, 5)
    rt = next(e for _, e in fast.walk() if type(e).__name__ == "FUSED").runtime()
    fast.run()
    assert rt.refused is None and rt.hits == 4 and not asked  # the first call started the compile
    net.eval()  # a training flag the package was not built for: eager, and the thread's compile asked for
    drv = fast.start()
    drv.run()
    assert rt.hits == 4 and asked
    net.train()
    eager_training(ref, reg, 10)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters()))


def test_a_step_left_to_the_thread_says_why(asked):
    reg = data()
    net = mlp()
    net[1].register_forward_hook(lambda *a: None)
    fast, _ = training(net, reg, 3)
    fast.run()
    rt = next(e for _, e in fast.walk() if type(e).__name__ == "FUSED").runtime()
    assert rt.refused == "CALL logits = Sequential(x): ReLU has hooks"
    assert asked and rt.compiles == 0  # the thread's compile, asked for instead


class DrawsThenRaises(EagerKernel):
    """The package's own call (Kernel.__call__) over a forward that computes eagerly, drawing its dropout
    masks; on its third call it draws and then raises, as a compiled call failing half-way would."""

    calls = 0

    def __init__(self, p, workdir):
        super().__init__(p, workdir)
        self.backward, self.draws = None, True

    def forward(self, args):
        DrawsThenRaises.calls += 1
        out = self.plan.head(*args[-2:])
        self.results, self.index = len(out), range(len(out))
        if DrawsThenRaises.calls == 3:
            raise RuntimeError("the compiled code failed")
        return list(out)

    __call__ = kernel.Kernel.__call__


def test_a_package_that_draws_and_then_raises_leaves_the_generator_as_it_was_for_the_eager_rerun(monkeypatch,
                                                                                                asked):
    monkeypatch.setattr(outofprocess, "Compile", Immediate)
    monkeypatch.setattr(kernel, "Kernel", DrawsThenRaises)
    monkeypatch.setattr(DrawsThenRaises, "calls", 0)
    net, reg = mlp(torch.nn.Dropout(0.3)), data()
    ref = mlp(torch.nn.Dropout(0.3))
    fast, _ = training(net, reg, 6)
    torch.manual_seed(5)
    with pytest.warns(FusionWarning, match="the compiled code failed"):
        fast.run()
    after = torch.rand(3)
    rt = next(e for _, e in fast.walk() if type(e).__name__ == "FUSED").runtime()
    assert DrawsThenRaises.calls == 3 and rt.state == "failed"
    torch.manual_seed(5)
    eager_training(ref, reg, 6)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters()))
    assert torch.equal(after, torch.rand(3))  # each dropout mask drawn once
