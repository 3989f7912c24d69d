"""A fused step computing with the user's own code (a module's forward, an activation of theirs) compiles in a
child process under dynamo's guards: the package runs only while every value that code read (a global, a
config object's setting, a function it calls) is what the child saw, and code the child cannot trust as
one graph with no other effect stays on the thread."""

from __future__ import annotations

import dataclasses
import json
import os
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from flowvm import CALL, Registers
from flowvm.fused import guards, guardtrace, outofprocess, stateful

F = torch.nn.functional


def python_env() -> dict:
    import os

    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


class Config:
    shift = 0.5


SCALE = 2.0
config = Config()
MODE = ""
seen: list = []
MASK = torch.ones(16)


def swish(x):
    return x * torch.sigmoid(x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
        self.act = swish
        self.temperature = 1.5
        self.calls = 0

    def forward(self, x):
        h = self.act(self.fc1(x)) * SCALE + config.shift
        if MODE == "print":
            print("a line")
        elif MODE == "counter":
            self.calls += 1
        elif MODE == "append":
            seen.append(1)
        elif MODE == "branch on a value" and h.sum() > 0:
            h = h * 2
        elif MODE == "a global tensor":
            h = h * MASK  # its values would be frozen in the package
        return self.fc2(h) / self.temperature


def planned(net):
    g = torch.Generator().manual_seed(3)
    reg = Registers(x=torch.randn(32, 8, generator=g), y=torch.randint(0, 3, (32,), generator=g))
    calls = [CALL(net, reg("x"), store_to=reg("logits")),
             CALL(F.cross_entropy, reg("logits"), reg("y"), store_to=reg("loss"))]
    p = stateful.plan(calls, [reg("x"), reg("y")], (reg["x"], reg["y"]))
    assert isinstance(p, stateful.Plan) and p.guarded
    return p, reg


def test_the_guards_hold_while_what_the_code_reads_is_unchanged(monkeypatch):
    net = Net()
    p, reg = planned(net)
    reads = guardtrace.trace(p.head, p.modules, [reg["x"], reg["y"]], True)
    sources = {source for _, source, _, _ in reads["guards"]}
    assert "G['__import_test_guards'].SCALE" in sources  # a global of the module the code lives in
    assert "dict(type(G['__import_test_guards'].config).__dict__)['shift']" in sources  # a class attribute
    assert "G['f0'].temperature" in sources and "G['f0'].calls" not in sources  # what forward reads, only
    holds = guards.check(p.head, p.modules, reads)
    assert holds()
    net.calls += 1
    assert holds()  # a counter forward does not read
    for change, undo in [(lambda: monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0), monkeypatch.undo),
                         (lambda: setattr(config, "shift", 0.25), lambda: delattr(config, "shift")),
                         (lambda: setattr(Config, "shift", 0.25), lambda: setattr(Config, "shift", 0.5)),
                         (lambda: setattr(net, "temperature", 2), lambda: setattr(net, "temperature", 1.5)),
                         (lambda: setattr(net, "act", torch.tanh), lambda: setattr(net, "act", swish))]:
        change()
        assert not holds()
        undo()
        assert holds()


def test_a_package_is_not_used_when_what_the_code_read_changed_before_it_arrived(monkeypatch):
    net = Net()
    p, reg = planned(net)
    reads = guardtrace.trace(p.head, p.modules, [reg["x"], reg["y"]], True)
    monkeypatch.setattr(Config, "shift", 0.75)
    with pytest.raises(ValueError, match=r"\['shift'\] is builtins.float 0.75 here, the compile saw builtins.float 0.5"):
        guards.check(p.head, p.modules, reads)
    monkeypatch.undo()
    monkeypatch.setattr(Net, "forward", lambda self, x: self.fc2(self.fc1(x)))  # other code than the child's
    with pytest.raises(ValueError, match="Net.forward has other code here than the compile saw"):
        guards.check(p.head, p.modules, reads)


@dataclasses.dataclass
class Hyper:
    scale: float = 2.0
    residual: bool = True


hyper = Hyper()
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}
CHOICE = {"act": "relu"}


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        return x + F.gelu(self.lin(self.norm(x))) if hyper.residual else self.lin(x)


class Deep(torch.nn.Module):  # a ModuleList walked in a loop, a dataclass and a dict of settings
    def __init__(self):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
        self.blocks = torch.nn.ModuleList([Block(16) for _ in range(3)])
        self.width = 16

    def forward(self, x):
        h = self.inp(x) / math.sqrt(self.width)
        for block in self.blocks:
            h = block(h)
        return self.out(ACTIVATIONS[CHOICE["act"]](h) * hyper.scale)


class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.Linear(8, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x.view(x.size(0), 1, 2, 4)))), 2)
        return self.fc(torch.flatten(x, 1) * hyper.scale)


class Recurrent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.fc = torch.nn.LSTM(8, 16, batch_first=True), torch.nn.Linear(16, 3)

    def forward(self, x):
        out, _ = self.rnn(x.unsqueeze(1))
        return self.fc(out[:, -1]) * hyper.scale


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.emb, self.enc, self.fc = torch.nn.Linear(8, 16), torch.nn.TransformerEncoder(layer, 2), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc(self.enc(self.emb(x).unsqueeze(1)).mean(1)) * hyper.scale


@pytest.mark.parametrize("model", [Deep, Conv, Recurrent, Encoder])
def test_the_guards_of_common_model_shapes_are_checked_here(model, monkeypatch):
    net = model()
    p, reg = planned(net)
    holds = guards.check(p.head, p.modules, guardtrace.trace(p.head, p.modules, [reg["x"], reg["y"]], True))
    assert holds()
    monkeypatch.setattr(hyper, "scale", 3.0)
    assert not holds()  # a dataclass's field the forward reads
    monkeypatch.undo()
    assert holds()
    if model is Deep:
        monkeypatch.setitem(CHOICE, "act", "gelu")
        assert not holds()  # a dict's entry, and the function it names


@pytest.mark.parametrize("mode", ["print", "counter", "append", "branch on a value", "a global tensor"])
def test_the_child_leaves_code_with_effects_beyond_one_graph_to_the_thread_and_says_why(mode, tmp_path, monkeypatch):
    """Run as the program's child runs it: the step pickled, traced in another process."""
    p, _ = planned(Net())
    (tmp_path / "job.pkl").write_bytes(stateful.payload(p, {"fallback_random": True}))
    env = python_env()
    script = f"import test_guards; test_guards.MODE = {mode!r}; " + outofprocess.CHILD
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=200)
    assert out.returncode == 3, out.stderr[-2000:]
    reason = json.loads(out.stdout.strip().splitlines()[-1])["refused"]
    if mode in ("counter", "append"):
        assert reason.startswith("it changes objects of the program"), reason
    elif mode == "a global tensor":
        assert reason.startswith("a tensor constant"), reason
    else:
        assert reason.startswith("dynamo cannot trace it as one graph"), reason
    assert not any(f.suffix == ".pt2" for f in tmp_path.iterdir())


@pytest.mark.heavy
@pytest.mark.timeout(400)
def test_a_model_of_the_users_trains_on_its_package_and_runs_eagerly_while_a_global_it_reads_differs():
    """A script's own model (its classes and functions pickled by value), with BatchNorm and dropout, trained
    on scikit-learn's digits: as eager code trains it, through the package while SCALE is as compiled."""
    script = textwrap.dedent("""
        import json, threading, time
        import torch
        import digits_training
        F = torch.nn.functional
        SCALE = 1.0

        class Settings:
            def __init__(self):
                self.shift = 0.1

        settings = Settings()

        def swish(x):
            return x * torch.sigmoid(x)

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1, self.bn = torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32)
                self.drop, self.fc2 = torch.nn.Dropout(0.2), torch.nn.Linear(32, 10)
                self.act = swish
                self.updates = 0

            def forward(self, x):
                return self.fc2(self.drop(self.act(self.bn(self.fc1(x))) * SCALE + settings.shift))

        torch.manual_seed(0)
        net = Net()
        x, y, ref, opt, ref_opt, reg, done, fast = digits_training.program(net)
        rt = next(e for _, e in fast.walk() if type(e).__name__ == "FUSED").runtime()
        torch.manual_seed(1)
        drv = fast.start()

        def updates(k):
            target = len(done) + k
            while len(done) < target:
                drv.run(max_steps=1)
            net.updates += k  # a counter forward does not read: the package still runs

        updates(1)
        deadline = time.time() + 240
        while rt._direct is None and rt.refused is None and time.time() < deadline:
            updates(1)
            time.sleep(0.05)
        before = len(done)
        updates(100)
        hits_compiled = rt.hits
        threads = sorted(t.name for t in threading.enumerate())
        SCALE = 2.0  # read by forward: eager until it is 1.0 again
        updates(50)
        hits_changed = rt.hits
        SCALE = 1.0
        updates(50)
        torch.manual_seed(1)
        for k in range(len(done)):
            SCALE = 2.0 if before + 100 <= k < before + 150 else 1.0
            ref_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
        print(json.dumps({
            "refused": rt.refused, "state": rt.state, "hits": [hits_compiled, hits_changed, rt.hits],
            "max_diff": max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters())),
            "stats": max((a - b).abs().max().item() for a, b in zip(net.buffers(), ref.buffers())),
            "loss": float(F.cross_entropy(net(x), y)), "threads": threads}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=python_env(),
                         timeout=380)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["refused"] is None and got["state"] == "compiled", got
    compiled, changed, last = got["hits"]
    assert compiled >= 100 and changed == compiled and last >= changed + 50, got  # eager while SCALE differed
    assert got["max_diff"] < 1e-3 and got["stats"] < 1e-3 and got["loss"] < 0.5, got  # as torch's eager loop
    assert "flowvm-compile" not in got["threads"]  # the compile thread had not run before SCALE changed


SOFT = torch.nn.Softplus(beta=2.0)  # a module the code reaches through a global, not a submodule


class Base(torch.nn.Module):
    shift = 0.5


class Middle(Base):
    pass


class Reaching(Middle):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def post(self, h):
        return h * 2

    def forward(self, x):
        return self.fc2(self.post(SOFT(self.fc1(x))) + self.shift)


def test_hooks_methods_and_class_attributes_changed_since_are_seen(monkeypatch):
    """What dynamo's own guards leave out: hooks of a module outside the step's modules, a method replaced on
    the class, a class attribute shadowed in a class between the instance's and the one it was read from."""
    p, reg = planned(Reaching())
    holds = guards.check(p.head, p.modules, guardtrace.trace(p.head, p.modules, [reg["x"], reg["y"]], True))
    assert holds()
    handle = SOFT.register_forward_hook(lambda module, args, out: out * 10)
    assert not holds()
    handle.remove()
    assert holds()
    monkeypatch.setattr(Reaching, "post", lambda self, h: h * 3)
    assert not holds()
    monkeypatch.undo()
    assert holds()
    monkeypatch.setattr(Middle, "shift", 0.25, raising=False)
    assert not holds()
    monkeypatch.undo()
    assert holds()


def test_a_functions_code_is_told_apart_by_its_constants_and_defaults_and_not_by_the_process():
    import cloudpickle

    def scaled(x, k=2):
        return [v * 2.0 for v in x] if k in {"a", "b"} else x

    def other_constant(x, k=2):
        return [v * 3.0 for v in x] if k in {"a", "b"} else x

    def other_default(x, k=3):
        return [v * 2.0 for v in x] if k in {"a", "b"} else x

    other_constant.__name__ = other_constant.__qualname__ = other_default.__qualname__ = scaled.__qualname__
    seen = guards.describe("FUNCTION_MATCH", scaled)
    assert guards.describe("FUNCTION_MATCH", other_constant) != seen  # a constant inside the comprehension
    assert guards.describe("FUNCTION_MATCH", other_default) != seen
    names = frozenset({"alpha", "beta", "gamma", "delta", "epsilon"})
    script = ("import pickle, sys; from flowvm.fused import guards; fn, names = pickle.loads(sys.stdin.buffer.read()); "
              "print(guards.describe('FUNCTION_MATCH', fn)); print(guards.describe('CONSTANT_MATCH', names))")
    out = subprocess.run([sys.executable, "-c", script], input=cloudpickle.dumps((scaled, names)),
                         capture_output=True, env=dict(python_env(), PYTHONHASHSEED="12345"), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # the same in another process, whose string hashes (and so the order of a set) differ
    assert out.stdout.decode().split("\n")[:2] == [seen, guards.describe("CONSTANT_MATCH", names)]


def test_a_module_pickled_partly_by_value_must_read_the_same_values_in_both_parts(tmp_path, monkeypatch):
    """A lambda of an importable module is pickled by value with the program's values of the module's
    globals; the module's classes are imported in the child with the values of its import."""
    (tmp_path / "halfpickled.py").write_text(textwrap.dedent("""
        import torch

        class Settings:
            def __init__(self):
                self.shift = 0.1

        settings = Settings()

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
                self.act = lambda x: torch.relu(x) + settings.shift  # pickled by value

            def forward(self, x):  # imported in the child
                return self.fc2(self.act(self.fc1(x)) * (1 + settings.shift))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import halfpickled

    env = dict(python_env(), PYTHONPATH=os.pathsep.join([str(tmp_path), python_env()["PYTHONPATH"]]))
    script = textwrap.dedent("""
        import json, pickle, sys
        import torch
        from flowvm.fused import guards, guardtrace
        job = pickle.loads(open(sys.argv[1], "rb").read())
        inputs = [torch.empty_strided(s, t, dtype=d).zero_() for s, t, d in job["layouts"]]
        try:
            guardtrace.trace(job["head"], job["modules"], inputs, job["grad"])
            print(json.dumps({"refused": None}))
        except guards.Untraceable as why:
            print(json.dumps({"refused": str(why)}))
    """)  # what the child does first (flowvm/fused/stateful.py compile_job), without the compile after it
    reasons = []
    for shift in (0.1, 0.5):  # as imported, then changed by the program
        monkeypatch.setattr(halfpickled.settings, "shift", shift)
        p, _ = planned(halfpickled.Net())
        job = tmp_path / f"job{shift}.pkl"
        job.write_bytes(stateful.payload(p, {"fallback_random": True}))
        out = subprocess.run([sys.executable, "-c", script, str(job)], capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        reasons.append(json.loads(out.stdout.strip().splitlines()[-1])["refused"])
    assert reasons[0] is None, reasons  # the same values in both parts
    assert "pickled with the program's values" in reasons[1], reasons


PROJ = torch.nn.Linear(16, 16)
MODES = {"alpha", "beta"}


class Helper:
    def bend(self, h):
        return h * 2


helper = Helper()


class Rebinding(torch.nn.Module):
    calls = 0  # a counter of the class's, which forward does not read

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
        self.proj = PROJ  # a submodule, which forward reads through the global

    def forward(self, x):
        h = PROJ(self.fc1(x))
        if "beta" in MODES:
            h = helper.bend(h)
        return self.fc2(h)


def test_globals_rebound_sets_changed_in_place_helpers_patched_and_classes_swapped_are_seen(monkeypatch):
    net = Rebinding()
    p, reg = planned(net)
    holds = guards.check(p.head, p.modules, guardtrace.trace(p.head, p.modules, [reg["x"], reg["y"]], True))
    assert holds() and p.ready() is not None
    monkeypatch.setattr(Rebinding, "calls", 5)
    assert holds()  # a class attribute the code does not read
    monkeypatch.setattr(sys.modules[__name__], "PROJ", torch.nn.Linear(16, 16))
    assert not holds()  # the global bound to another Linear: its parameters are not the submodule's
    monkeypatch.undo()
    assert holds()
    MODES.discard("beta")
    try:
        assert not holds()  # a set changed in place
    finally:
        MODES.add("beta")
    assert holds()
    monkeypatch.setattr(Helper, "bend", lambda self, h: h * 3)
    assert not holds()  # a method of a helper object's class
    monkeypatch.undo()

    class Other(Rebinding):
        def forward(self, x):
            return self.fc2(self.fc1(x))

    net.__class__ = Other
    assert p.ready() is None  # the module's class swapped
    net.__class__ = Rebinding
    assert holds() and p.ready() is not None


class Environment(Net):
    def forward(self, x):
        return super().forward(x) * float(os.environ.get("FLOWVM_TEST_SCALE", "1"))


def test_code_reading_environment_variables_is_left_to_the_thread():
    p, reg = planned(Environment())
    with pytest.raises(guards.Untraceable, match="environment variables"):  # dynamo's guards miss them
        guardtrace.trace(p.head, p.modules, [reg["x"], reg["y"]], True)


def test_a_guard_read_through_a_functions_globals_is_checked_against_its_modules_globals_here(monkeypatch):
    """torch 2.14 names the globals of code it inlines, when they are not those of a module imported in the
    child (code pickled by value), by an id of the child's (``___unnamed_scope_<id>_c0``): here they are the
    globals of the module of that name."""
    p, _ = planned(Net())
    name = "___unnamed_scope_1234_c0"
    imports = guardtrace._imports({name: {"__name__": __name__, "SCALE": 2.0}})
    assert imports == {name: "globals of " + __name__}
    traced = {"guards": [["CONSTANT_MATCH", f"G[{name!r}]['SCALE']", guards.describe("CONSTANT_MATCH", 2.0), None]],
              "imports": imports, "classes": {}}
    holds = guards.check(p.head, p.modules, traced)
    assert holds()
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
    assert not holds()
    with pytest.raises(guards.Untraceable, match="not a module's"):
        guardtrace._imports({name: {"SCALE": 2.0}})
