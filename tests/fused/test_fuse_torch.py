"""The fuse-torch pass: what fuses, golden listings, equivalence, errors, fallback, autograd.

Most compiles here use torch.compile's "eager" backend (dynamo tracing only,
a fraction of a second); one module-scope fixture compiles a training step
with inductor, the real thing, and several tests share it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowvm
from flowvm import CALL, LOOP, REPEAT, SEQ, WEAVE, WHILE, Registers
from flowvm.program.analysis import reads, writes
from flowvm.program.paths import walk
from flowvm.passes import optimize
from flowvm.passes.fuse_torch import FUSED, FusionWarning, fusable, fuse_torch, is_fusable, set_form
from flowvm.testing import same
import toy

F = torch.nn.functional
SYNC = {"background": False}
EAGER_BACKEND = {"backend": "eager", "options": {}, "background": False}


# ------------------------------------------------------------------ what fuses
@fusable
def scaled(x, k=2.0):
    return x * k


@fusable(enabled=False)
def excluded(x):
    return x


def test_fusable_callables():
    x = torch.ones(2)
    lin = torch.nn.Linear(2, 2)
    yes = [lin, torch.sin, F.relu, F.linear, torch.linalg.norm, torch.Tensor.add, torch.Tensor.sum, x.add_,
           scaled, torch.special.expit]
    no = [torch.Tensor.backward, torch.Tensor.item, x.item, torch.manual_seed, torch.save, excluded,
          lambda t: t, print, torch.optim.SGD(lin.parameters(), lr=1).step, torch.nn.Linear]
    assert [is_fusable(f) for f in yes] == [True] * len(yes)
    assert [is_fusable(f) for f in no] == [False] * len(no)
    marked = fusable(torch.optim.SGD(lin.parameters(), lr=1).step)  # a bound method: wrapped in a partial
    assert is_fusable(marked)
    with pytest.raises(TypeError, match="fusable: expected a callable"):
        fusable(3)


def test_runs_of_two_or_more_fuse_in_seqs_and_loop_bodies_but_not_under_a_weave():
    reg = Registers(x=torch.ones(3), n=0)
    lin = torch.nn.Linear(3, 3)

    def count(n):
        return n + 1

    relu, soft = CALL(F.relu, reg("x"), store_to=reg("x")), CALL(F.softplus, reg("x"), store_to=reg("x"))
    prog = SEQ([
        relu,                                              # alone: stays a CALL
        CALL(count, reg("n"), store_to=reg("n")),
        CALL(lin, reg("x"), store_to=reg("h")), relu, soft,  # fused
        REPEAT(2, SEQ([relu, soft])),                      # the body becomes the FUSED itself
        WHILE(CALL(lambda n: n < 3, reg("n")), SEQ([CALL(count, reg("n"), store_to=reg("n")), relu, soft])),
        WEAVE(-1, [SEQ([relu, soft]), SEQ([relu, soft])]),
    ])
    fast = fuse_torch(prog, form="eager")
    assert str(fast) == """\
SEQ:
    x = relu(x)
    n = count(n)
    FUSED 3 calls, torch.compile(inductor): eager (forced):
        h = Linear(x)  # was 2
        x = relu(x)  # was 3
        x = softplus(x)  # was 4
    REPEAT 2:
        FUSED 2 calls, torch.compile(inductor): eager (forced):
            x = relu(x)  # was 5.0.0
            x = softplus(x)  # was 5.0.1
    WHILE <lambda>(n):
        SEQ:
            n = count(n)
            FUSED 2 calls, torch.compile(inductor): eager (forced):
                x = relu(x)  # was 6.1.1
                x = softplus(x)  # was 6.1.2
    WEAVE all of 2:
        SEQ:
            x = relu(x)
            x = softplus(x)
        SEQ:
            x = relu(x)
            x = softplus(x)"""
    loop = fuse_torch(LOOP(SEQ([relu, soft])))
    assert type(loop.body) is FUSED


def test_origins_are_paths_in_the_program_given_to_optimize_even_after_flatten():
    reg = Registers(x=torch.ones(3))
    relu = CALL(F.relu, reg("x"), store_to=reg("y"))
    soft = CALL(F.softplus, reg("y"), store_to=reg("z"))
    prog = SEQ([SEQ([relu]), SEQ([SEQ([soft])])])
    fast = optimize(prog, options={"fuse-torch": {"form": "eager"}})
    assert fast.origins == ("0.0", "1.0.0")
    assert fast.detail_lines() == ["y = relu(x)  # was 0.0", "z = softplus(y)  # was 1.0.0"]


def test_a_fused_step_reads_what_its_calls_read_first_and_writes_all_they_write():
    reg = Registers(x=torch.ones(3), w=torch.ones(3))
    prog = SEQ([CALL(torch.mul, reg("x"), reg("w"), store_to=reg("h")),
                CALL(torch.add, reg("h"), [reg("x")][0], alpha=2, store_to=reg("x")),
                CALL(torch.stack, [reg("h"), reg("x")], store_to=reg("s"))])
    fast = fuse_torch(prog, form="eager")
    assert [r.name for r in fast.inputs] == ["x", "w"] and [r.name for r in fast.outputs] == ["h", "x", "s"]
    assert reads(fast) == {"x", "w"} and writes(fast) == {"h", "x", "s"}
    expected = prog.run()
    reg.update(x=torch.ones(3), w=torch.ones(3))
    assert same(fast.run(), expected)


def test_verify_sees_through_a_fused_step():
    reg = Registers()
    prog = SEQ([CALL(torch.zeros, 3, store_to=reg("a")), SEQ([CALL(F.relu, reg("a"), store_to=reg("b")),
                                                           CALL(F.relu, reg("missing"))])])
    fast = fuse_torch(optimize(prog, passes=["flatten"]), form="eager")
    with pytest.raises(flowvm.VerifyError) as info:
        fast.start()
    assert info.value.register == "missing" and info.value.path == ""


# ------------------------------------------------------------------ equivalence
UNARY = [torch.sin, torch.tanh, torch.sigmoid, F.relu, F.softplus, torch.neg, torch.abs, torch.Tensor.exp]
BINARY = [torch.add, torch.mul, torch.sub, torch.Tensor.mul]


@st.composite
def chains(draw):
    """A chain of torch calls over registers x, y and the temporaries it writes."""
    names = ["x", "y"]
    steps = []
    for _ in range(draw(st.integers(2, 6))):
        if draw(st.booleans()):
            op, args = draw(st.sampled_from(UNARY)), [draw(st.sampled_from(names))]
        else:
            op = draw(st.sampled_from(BINARY))
            args = [draw(st.sampled_from(names)), draw(st.sampled_from(names + [0.5]))]
        out = draw(st.sampled_from(names + [f"t{len(names)}"]))
        if out not in names:
            names.append(out)
        steps.append((op, args, out))
    return steps


def build_chain(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    reg = Registers(x=torch.randn(5, generator=g), y=torch.randn(5, generator=g))
    calls = [CALL(op, *[reg(a) if isinstance(a, str) else a for a in args], store_to=reg(out))
             for op, args, out in steps]
    return SEQ(calls), reg


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_generated_chains_give_the_same_registers_fused_eager_and_compiled(steps):
    prog, reg = build_chain(steps)
    prog.run()
    expected = dict(reg)
    for opts in ({"form": "eager"}, {"form": "compiled", **EAGER_BACKEND},
                 {"form": "compiled", "backend": "aot_eager", "options": {}, "background": False}):
        prog, reg = build_chain(steps)
        drv = fuse_torch(prog, **opts).start()
        drv.run()
        assert drv.steps == 1
        assert reg.keys() == expected.keys()
        for name in expected:
            if opts.get("backend") == "aot_eager":  # decomposed ops: equal up to rounding
                assert torch.allclose(reg[name], expected[name], rtol=1e-5, atol=1e-6, equal_nan=True), (opts, name)
            else:  # the same torch operations in the same order: bit for bit
                assert same(reg[name], expected[name]), (opts, name)


def test_an_inductor_compiled_chain_of_ten_ops_agrees_with_the_interpreted_program():
    ops = [torch.sin, torch.cos, torch.exp, torch.tanh, torch.sigmoid, torch.relu, torch.neg, torch.abs,
           torch.sqrt, torch.log1p]

    def build():
        reg = Registers(x=torch.linspace(-2, 2, 1000))
        return REPEAT(3, SEQ([CALL(op, reg("x" if i == 0 else "h"), store_to=reg("h")) for i, op in enumerate(ops)])), reg

    prog, reg = build()
    prog.run()
    fast, got = build()
    fast = fuse_torch(fast, form="compiled", **SYNC)
    drv = fast.start()
    drv.run()
    rt = fast.body.runtime()
    assert drv.steps == 3 and rt.hits == 3
    assert torch.allclose(got["h"], reg["h"], rtol=1e-5, atol=1e-6)
    # plain tensors in, no autograd: inductor's graph is called directly, behind flowvm's own guard
    assert rt._direct is not None
    rt._runonly = None  # the dynamo path would fail now: only the direct form can run
    again = fast.start()
    again.run()
    assert rt.hits == 6 and torch.allclose(got["h"], reg["h"], rtol=1e-5, atol=1e-6)


def test_the_direct_compiled_form_is_only_for_plain_tensors_with_its_layouts():
    from flowvm.fused.compiler import direct_compile
    from flowvm.fused.reads import Reads
    from flowvm.fused.runtime import Runtime

    x = torch.zeros(4, 3)
    reg = Registers(x=x)
    rt = Runtime(fuse_torch(SEQ([CALL(torch.sin, reg("x"), store_to=reg("y")), CALL(torch.relu, reg("y"), store_to=reg("z"))]),
                            form="compiled", **SYNC))
    ran = []

    def kernel(args):  # stands for inductor's graph: the head, computed eagerly
        ran.append("direct")
        return rt.generated.head(*args)

    def dynamo_path(*args):
        ran.append("dynamo")
        return rt.generated.head(*args)

    reads = Reads.capture(rt.el.calls)  # nothing mutable among the calls' arguments: the torch settings only
    rt._direct = (((torch.Tensor, x.dtype, x.device, x.shape, x.stride()),), kernel, None, reads)
    rt._runonly = dynamo_path
    rt.compiles = rt.settings.max_compiles  # no compile for the inputs the direct graph refuses
    first = rt._install_direct()
    for other in (torch.ones(4, 3), torch.ones(3, 4), torch.ones(4, 3, dtype=torch.float64),
                  torch.ones(4, 3).t().contiguous().t(), torch.ones(4, 3, requires_grad=True),
                  torch.nn.Parameter(torch.ones(4, 3)), torch.ones(4, 3)):
        ran.clear()
        y, z, last = rt._compiled_call(other)
        assert ran == (["direct"] if type(other) is torch.Tensor and other.shape == (4, 3) and other.is_contiguous()
                       and other.dtype == torch.float32 and not other.requires_grad else ["dynamo"]), other
        assert same(z, torch.relu(torch.sin(other))) and last is z
    assert rt.hits == 2 and rt._compiled_call is not first  # after one call through the graph's wrapper, its bare form

    def broken(args):
        raise RuntimeError("kernel failed")

    from flowvm.fused.compiler import _direct_caller

    rt._compiled_call = _direct_caller(rt, broken, first=False)
    with pytest.warns(FusionWarning, match="kernel failed"):
        y, z, last = rt._compiled_call(torch.ones(4, 3))  # the graph failed: eager result, eager from now on
    assert same(z, torch.relu(torch.sin(torch.ones(4, 3)))) and rt.state == "failed" and rt.current == rt.eager

    def runtime_of(calls, reg):
        fused = fuse_torch(SEQ(calls), form="compiled", **SYNC)
        return Runtime(fused)

    reg = Registers(x=torch.ones(3), w=torch.ones(3, requires_grad=True))
    model = torch.nn.Linear(3, 3)
    cases = {
        "in place": [CALL(torch.Tensor.add_, reg("x"), 1, store_to=reg("y")), CALL(torch.relu, reg("y"), store_to=reg("z"))],
        "a module": [CALL(model, reg("x"), store_to=reg("y")), CALL(torch.relu, reg("y"), store_to=reg("z"))],
        "random": [CALL(torch.rand_like, reg("x"), store_to=reg("y")), CALL(torch.relu, reg("y"), store_to=reg("z"))],
        "a view": [CALL(torch.sin, reg("x"), store_to=reg("y")), CALL(torch.Tensor.view, reg("y"), 3, 1, store_to=reg("z"))],
    }
    for what, calls in cases.items():
        rt = runtime_of(calls, reg)
        assert direct_compile(rt, (reg["x"],), False) is None, what
    rt = runtime_of([CALL(torch.sin, reg("w"), store_to=reg("y")), CALL(torch.relu, reg("y"), store_to=reg("z"))], reg)
    assert direct_compile(rt, (reg["w"],), False) is None  # needs a gradient


def test_fused_steps_inside_while_and_switch_run_like_the_original_and_resume_exactly():
    from flowvm import SWITCH
    from flowvm.testing import assert_same_run

    def build(optimized):
        reg = Registers(x=torch.linspace(-1, 1, 8), n=0)

        def bump(n):
            return n + 1

        body = SEQ([CALL(bump, reg("n"), store_to=reg("n")),
                    SWITCH(reg("n"), {1: SEQ([CALL(F.relu, reg("x"), store_to=reg("x")),
                                              CALL(torch.mul, reg("x"), 3.0, store_to=reg("x"))])},
                           default=SEQ([CALL(F.softplus, reg("x"), store_to=reg("y")),
                                        CALL(torch.sub, reg("x"), reg("y"), store_to=reg("x"))]))])
        prog = SEQ([WHILE(CALL(lambda n: n < 4, reg("n")), body), CALL(torch.Tensor.sum, reg("x"))])
        return fuse_torch(prog, form="eager") if optimized else prog

    plain = build(False).start()
    plain.run()
    fused = build(True)
    assert sum(type(el) is FUSED for _, el in walk(fused)) == 2
    drv = fused.start()
    drv.run()
    assert same(drv.result, plain.result) and same(drv.registers["x"], plain.registers["x"])
    assert drv.steps == plain.steps - 4
    assert_same_run(lambda: build(True), cuts=[0, 3, 7, 11])


# ------------------------------------------------------------------ errors and fallback
def test_an_error_names_the_original_call_and_its_path_eager_and_compiled():
    for opts in ({"form": "eager"}, {"form": "compiled", **EAGER_BACKEND}):
        reg = Registers(x=torch.ones(2, 3), w=torch.ones(4, 4))
        prog = SEQ([CALL(F.relu, reg("x"), store_to=reg("h")), SEQ([CALL(F.linear, reg("h"), reg("w"), store_to=reg("h")),
                                                                 CALL(F.relu, reg("h"))])])
        fast = optimize(prog, passes=["flatten", "fuse-torch"], options={"fuse-torch": opts})
        drv = fast.start()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the user's own error is no compile failure: no warning
            with pytest.raises(RuntimeError, match="cannot be multiplied|size mismatch|shapes") as info:
                drv.step()
        notes = "\n".join(info.value.__notes__)
        assert "raised by CALL h = linear(h, w), call 2 of 3 in a fused step (path '1.0' before optimization)" in notes
        assert "while running FUSED 3 calls" in notes and drv.steps == 0
        reg["w"] = torch.ones(4, 3)  # fixed: the retried step goes through
        drv.run()
        assert same(reg["h"], torch.full((2, 4), 3.0))


@fusable
def breaks_the_graph(x):
    torch._dynamo.graph_break()
    return x + 1


def test_a_function_torch_compile_cannot_handle_runs_eagerly_after_one_warning():
    reg = Registers(x=torch.zeros(2))
    prog = REPEAT(4, SEQ([CALL(breaks_the_graph, reg("x"), store_to=reg("x")), CALL(F.relu, reg("x"), store_to=reg("x"))]))
    fast = fuse_torch(prog, form="compiled", **EAGER_BACKEND)
    with pytest.warns(FusionWarning, match="torch.compile failed for the fused step") as record:
        drv = fast.start()
        drv.run()
    assert len([w for w in record if issubclass(w.category, FusionWarning)]) == 1
    assert same(reg["x"], torch.full((2,), 4.0)) and drv.steps == 4
    assert "eager, compile failed (" in fast.body.header_text()


def test_an_unknown_backend_is_a_compile_failure_too():
    reg = Registers(x=torch.zeros(2))
    fast = fuse_torch(SEQ([CALL(F.relu, reg("x"), store_to=reg("x"))] * 2), backend="no-such-backend", options={},
                      background=False)
    with pytest.warns(FusionWarning):
        fast.run()
    assert same(reg["x"], torch.zeros(2))


# ------------------------------------------------------------------ choosing and overriding
def test_auto_times_both_forms_and_shows_the_decision_which_set_form_overrides(monkeypatch):
    from flowvm.fused import choosing

    monkeypatch.setattr(choosing, "MIN_TRIAL_SECONDS", 0.0)
    reg = Registers(x=torch.ones(3))
    prog = REPEAT(40, SEQ([CALL(F.relu, reg("x"), store_to=reg("x")), CALL(F.softplus, reg("x"), store_to=reg("x"))]))
    fast = fuse_torch(prog, trials=3, **EAGER_BACKEND)
    assert fast.body.header_text() == "FUSED 2 calls, torch.compile(eager): auto, not run yet:"
    drv = fast.start()
    drv.run(max_steps=3)
    assert "measuring compiled against eager" in fast.body.header_text()
    drv.run()
    rt = fast.body.runtime()
    assert rt.state in ("compiled", "eager") and rt.measured is not None
    header = fast.body.header_text()
    assert header.startswith(f"FUSED 2 calls, torch.compile(eager): {rt.state}, measured compiled ")
    assert " vs eager " in header and "per execution" in header
    assert "eager (forced)" in set_form(fast, "eager").body.header_text()
    assert "compiled (forced), not run yet" in set_form(fast, "compiled", paths=["0"]).body.header_text()
    with pytest.raises(LookupError, match="no FUSED element at path"):
        set_form(fast, "eager", paths=["1"])
    with pytest.raises(ValueError, match="form must be one of"):
        fuse_torch(prog, form="fastest")


@pytest.mark.parametrize("compile_after", [0.05, 0.0])
def test_auto_compiles_only_a_step_that_has_run_compile_after_seconds(compile_after):
    """A compile costs seconds of CPU shared with the run: a step must prove long-lived before paying it."""
    import time

    compiled = []

    def counting_backend(gm, example_inputs):
        compiled.append(1)
        return gm.forward

    def slow_relu(x):
        time.sleep(0.002)
        return F.relu(x)

    reg = Registers(x=torch.ones(3))
    body = SEQ([CALL(fusable(slow_relu), reg("x"), store_to=reg("x")), CALL(torch.neg, reg("x"), store_to=reg("x"))])
    fast = fuse_torch(REPEAT(200, body), backend=counting_backend, options={}, compile_after=compile_after)
    drv = fast.start()
    drv.run(max_steps=3)
    rt = fast.body.runtime()
    if compile_after:
        assert rt.compiles == 0 and rt.state == "proving" and "compiles once it has run" in fast.body.header_text()
        drv.run(max_steps=60)  # about 0.12 s of eager executions
        assert rt.compiles == 1
    else:
        assert rt.compiles == 1
    with pytest.raises(ValueError, match="compile_after"):
        fuse_torch(REPEAT(2, body), compile_after=-1)


def test_a_short_run_does_not_wait_for_a_background_compile():
    import threading
    import time

    release = threading.Event()

    def slow_backend(gm, example_inputs):
        release.wait(30)  # a compile that takes as long as the test wants
        return gm.forward

    reg = Registers(x=torch.ones(3))
    prog = REPEAT(1000, SEQ([CALL(F.relu, reg("x"), store_to=reg("x")), CALL(torch.neg, reg("x"), store_to=reg("x"))]))
    fast = fuse_torch(prog, backend=slow_backend, form="compiled")
    start = time.perf_counter()
    drv = fast.start()
    drv.run(max_steps=200)
    assert time.perf_counter() - start < 5 and drv.steps == 200
    rt = fast.body.runtime()
    assert rt.state == "compiling" and rt.hits == 0
    assert "compiling in the background, eager meanwhile" in fast.body.header_text()
    release.set()
    deadline = time.time() + 30
    while rt.state == "compiling" and time.time() < deadline:
        drv.run(max_steps=10)
        time.sleep(0.01)
    drv.run()
    assert rt.state == "compiled" and rt.hits > 0 and drv.done
    assert same(reg["x"], torch.zeros(3))


def test_new_input_shapes_run_eagerly_then_get_their_own_compile():
    reg = Registers(x=torch.ones(3))
    fast = fuse_torch(SEQ([CALL(F.relu, reg("x"), store_to=reg("y")), CALL(torch.neg, reg("y"), store_to=reg("y"))]),
                      form="compiled", **EAGER_BACKEND)
    rt = fast.runtime()
    fast.run()
    assert (rt.compiles, rt.hits) == (1, 1)
    reg["x"] = torch.ones(5)
    fast.run()  # the guards reject the new shape: eager, and a compile for it
    assert (rt.compiles, rt.hits) == (2, 1) and same(reg["y"], -torch.ones(5))
    fast.run()
    assert rt.hits == 2


# ------------------------------------------------------------------ autograd, pickling, random numbers
def build_training(steps=4, dropout=0.25, optimizer="sgd"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(8, 1))
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1)
    reg = Registers(x=torch.randn(16, 4, generator=g), y=torch.randn(16, 1, generator=g))
    return SEQ([
        REPEAT(steps, SEQ([
            CALL(opt.zero_grad),
            CALL(model, reg("x"), store_to=reg("out")),
            CALL(F.mse_loss, reg("out"), reg("y"), store_to=reg("loss")),
            CALL(torch.Tensor.backward, reg("loss")),
            CALL(opt.step),
        ])),
        CALL(lambda m: [p.detach().clone() for p in m.parameters()], model, store_to=reg("weights")),
    ])


def test_a_training_step_fuses_forward_loss_and_backward_golden_text():
    prog = build_training()
    fast = optimize(prog, options={"fuse-torch": {"form": "compiled"}})
    assert str(prog).splitlines()[:7] == [
        "SEQ:",
        "    REPEAT 4:",
        "        SEQ:",
        "            SGD.zero_grad()",
        "            out = Sequential(x)",
        "            loss = mse_loss(out, y)",
        "            Tensor.backward(loss)",
    ]
    assert str(fast).splitlines()[:9] == [
        "SEQ:",
        "    REPEAT 4:",
        "        SEQ:",
        "            SGD.zero_grad()",
        "            FUSED 3 calls, torch.compile(inductor): compiled (forced), not run yet:",
        "                out = Sequential(x)  # was 0.0.1",
        "                loss = mse_loss(out, y)  # was 0.0.2",
        "                Tensor.backward(loss)  # was 0.0.3",
        "            SGD.step()",
    ]
    fused = fast.elements[0].body.elements[1]
    assert [r.name for r in fused.inputs] == ["x", "y"] and [r.name for r in fused.outputs] == ["out", "loss"]
    gen = fused.runtime().generated
    assert gen.head is not gen.fused and gen.tail is not None and gen.head_positions is None


def finish(prog):
    drv = prog.start()
    drv.run()
    return drv


@pytest.fixture(scope="module")
def inductor_training():
    """One real inductor compile (forward and backward), shared by the tests below."""
    torch.manual_seed(5)
    reference = finish(build_training())
    rng_after_reference = torch.get_rng_state()
    torch.manual_seed(5)
    fast = optimize(build_training(), options={"fuse-torch": {"form": "compiled", **SYNC}})
    drv = finish(fast)
    return reference, rng_after_reference, fast, drv, torch.get_rng_state()


def test_inductor_training_step_matches_with_autograd_through_the_fused_forward(inductor_training):
    reference, rng_ref, fast, drv, rng = inductor_training
    fused = fast.elements[0].body.elements[1]
    assert type(fused) is FUSED and fused.header_text() == "FUSED 3 calls, torch.compile(inductor): compiled (forced):"
    assert fused.runtime().hits == 4
    assert drv.steps == reference.steps - 2 * 4
    for a, b in zip(drv.registers["weights"], reference.registers["weights"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    # dropout drew the same numbers from the same global generator (fallback_random): the state agrees exactly
    assert torch.equal(rng, rng_ref)


@pytest.mark.parametrize("tail", [False, True])
def test_a_fused_step_runs_on_the_drivers_fast_paths_with_the_same_steps_and_resume_points(tail):
    from flowvm.testing import assert_same_run

    def build(optimized=True):
        torch.manual_seed(2)
        reg = Registers(x=torch.randn(3), log=[])
        calls = [CALL(torch.sin, reg("x"), store_to=reg("h")), CALL(torch.mul, reg("h"), 1.5, store_to=reg("x"))]
        if tail:  # REPEAT(SEQ([FUSED, CALL])) rather than REPEAT(FUSED)
            calls.append(CALL(list.append, reg("log"), reg("x")))
        prog = REPEAT(7, SEQ(calls))
        return optimize(prog, options={"fuse-torch": {"form": "eager"}}) if optimized else prog

    plain = build(optimized=False).start()
    plain.run()
    drv = build().start()
    drv.run(max_steps=3)
    assert drv.fast_path == ("repeat-seq" if tail else "repeat-leaf")  # the tight loop, not the general path
    drv.run()
    assert same(drv.registers["x"], plain.registers["x"]) and drv.steps == plain.steps - 7
    assert same(drv.registers["log"], plain.registers["log"])
    assert_same_run(build, cuts=[0, 1, 2, 3, 5, 8, 11], copiers=["pickle", "deepcopy"])


def test_a_background_compile_reads_no_gradient_while_the_program_runs(inductor_training, monkeypatch):
    """Dynamo and AOTAutograd read each real tensor's .grad, which a backward pass in the program writes
    without holding the GIL; the program waits until they are done (the rest compiles on fake tensors).
    (inductor_training compiles the same graphs first: this compile finds them in inductor's disk cache.)"""
    import threading
    import time

    import torch._subclasses.meta_utils as meta_utils

    torch.manual_seed(5)
    fast = optimize(build_training(), options={"fuse-torch": {"form": "compiled", "compile_in": "thread"}})
    rt = fast.elements[0].body.elements[1].runtime()
    reads = {"while paused": 0, "while running": 0}
    original = meta_utils.safe_grad

    def safe_grad(t):
        if threading.current_thread().name == "flowvm-compile" and t.requires_grad:
            reads["while running" if rt._traced.is_set() else "while paused"] += 1
        return original(t)

    monkeypatch.setattr(meta_utils, "safe_grad", safe_grad)
    drv = fast.start()
    deadline = time.time() + 120
    while (rt.compiles == 0 or rt._job_running) and time.time() < deadline:
        drv.run(max_steps=1)  # the first fused execution starts the compile (after the compiler is imported)
        if drv.done:
            drv = fast.start()
    assert rt.compiles == 1 and rt.error is None and len(rt.paused_seconds) == 1
    assert reads["while paused"] > 0 and reads["while running"] == 0, reads


def test_a_half_run_compiled_driver_pickles_without_its_compiled_code_and_resumes(inductor_training):
    import pickle

    _, _, fast, done, _ = inductor_training
    torch.manual_seed(5)
    prog = optimize(build_training(), options={"fuse-torch": {"form": "compiled", **SYNC}})
    drv = prog.start()
    drv.run(max_steps=5)  # mid-training: after the second fused forward, loss and backward
    rng = torch.get_rng_state()
    blob = pickle.dumps(drv)
    copy = pickle.loads(blob)
    fused = copy.program.elements[0].body.elements[1]
    assert "_c_runtime" not in fused.__dict__ and "_c_runtime" in drv.program.elements[0].body.elements[1].__dict__
    torch.set_rng_state(rng)
    copy.run()
    torch.set_rng_state(rng)
    drv.run()
    for a, b, c in zip(copy.registers["weights"], drv.registers["weights"], done.registers["weights"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7) and torch.allclose(b, c, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_eager_fused_training_is_bit_for_bit_and_resumes_exactly_after_any_copy(optimizer):
    from flowvm.testing import assert_same_run, outcome

    torch.manual_seed(9)
    plain = finish(build_training(optimizer=optimizer))
    torch.manual_seed(9)
    fused = finish(optimize(build_training(optimizer=optimizer), options={"fuse-torch": {"form": "eager"}}))
    assert all(torch.equal(a, b) for a, b in zip(plain.registers["weights"], fused.registers["weights"]))

    def build():
        torch.manual_seed(9)
        return optimize(build_training(optimizer=optimizer), options={"fuse-torch": {"form": "eager"}})

    # the backward pass is inside the fused step: every step boundary is a resume point
    expected = assert_same_run(build, cuts=[0, 1, 2, 5, 7, 11, 13])
    assert expected["steps"] == outcome(fused)["steps"] == 4 * 3 + 1


def test_a_compiled_run_saved_mid_way_finishes_in_a_fresh_process(tmp_path):
    import os
    import pickle
    import subprocess
    import sys

    def build():
        torch.manual_seed(3)
        return optimize(build_training(dropout=0.0), options={"fuse-torch": {"form": "compiled", **EAGER_BACKEND}})

    reference = finish(build())
    drv = build().start()
    drv.run(max_steps=6)
    flowvm.save(drv, tmp_path / "half.ckpt")
    script = ("import pickle, sys, flowvm\n"
              "d = flowvm.load(sys.argv[1]); d.run()\n"
              "fused = d.program.elements[0].body.elements[1]\n"
              "pickle.dump(([w for w in d.registers['weights']], d.steps, fused.runtime().hits), open(sys.argv[2], 'wb'))\n")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "half.ckpt"), str(tmp_path / "out.pkl")],
                   check=True, timeout=120, cwd=str(tmp_path),
                   env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), str(toy.TESTS)])})
    weights, steps, hits = pickle.loads((tmp_path / "out.pkl").read_bytes())
    assert steps == reference.steps and hits == 2  # recompiled there on first use: 2 of the 4 forwards were left
    assert all(torch.equal(a, b) for a, b in zip(weights, reference.registers["weights"]))


def test_switching_forms_mid_run_keeps_the_random_numbers(monkeypatch):
    """With inductor's fallback_random, compiled dropout draws what eager dropout draws; the eager
    backend runs the same aten ops: either way auto may switch forms at any step without changing them."""
    from flowvm.fused import choosing

    monkeypatch.setattr(choosing, "MIN_TRIAL_SECONDS", 0.0)
    reg = Registers(x=torch.ones(64))
    body = SEQ([CALL(F.dropout, reg("x"), 0.5, store_to=reg("h")), CALL(torch.mul, reg("h"), 2.0, store_to=reg("h")),
                CALL(torch.Tensor.sum, reg("h"), store_to=reg("s"))])
    prog = SEQ([REPEAT(12, SEQ([body, CALL(lambda log, s: log + [s.item()], reg("log"), reg("s"), store_to=reg("log"))]))])
    reg["log"] = []
    torch.manual_seed(1)
    prog.run()
    expected, rng = list(reg["log"]), torch.get_rng_state()
    reg["log"] = []
    torch.manual_seed(1)
    fast = fuse_torch(prog, trials=2, **EAGER_BACKEND)
    fast.run()
    assert reg["log"] == expected and torch.equal(torch.get_rng_state(), rng)


def test_force_switches_a_live_runtime_and_compiles_for_example_inputs_if_needed():
    reg = Registers(x=torch.ones(3))
    fast = fuse_torch(SEQ([CALL(F.relu, reg("x"), store_to=reg("x")), CALL(torch.neg, reg("x"), store_to=reg("x"))]),
                      **EAGER_BACKEND)
    rt = fast.runtime()
    with pytest.raises(ValueError, match="pass example inputs"):
        rt.force("compiled")
    rt.force("compiled", example=(reg["x"],))
    assert rt.compiles == 1 and "compiled, forced at run time" in fast.header_text()
    fast.run()
    assert rt.hits == 1 and same(reg["x"], -torch.ones(3))
    rt.force("eager")
    fast.run()
    assert rt.hits == 1 and "eager, forced at run time" in fast.header_text() and same(reg["x"], torch.zeros(3))


@fusable
def slow_unless_compiled(x):
    if not torch.compiler.is_compiling():  # traced as True: the compiled graph skips the sleep
        import time

        time.sleep(0.002)
    return x + 1


def slow_backend(gm, example_inputs):
    def run(*args):
        import time

        time.sleep(0.002)
        return gm.forward(*args)

    return run


@pytest.mark.parametrize("slower, kept", [("eager", "compiled"), ("compiled", "eager")])
def test_auto_keeps_the_faster_form(monkeypatch, slower, kept):
    from flowvm.fused import choosing

    monkeypatch.setattr(choosing, "MIN_TRIAL_SECONDS", 0.0)
    reg = Registers(x=torch.zeros(3))
    first = slow_unless_compiled if slower == "eager" else F.relu
    prog = REPEAT(30, SEQ([CALL(first, reg("x"), store_to=reg("x")), CALL(torch.neg, reg("x"), store_to=reg("x"))]))
    backend = "eager" if slower == "eager" else slow_backend
    fast = fuse_torch(prog, backend=backend, options={}, background=False, trials=4)
    drv = fast.start()
    drv.run()
    rt = fast.body.runtime()
    assert rt.state == kept and fast.body.header_text().split(": ", 1)[1].startswith(f"{kept}, measured compiled")
    mc, me = rt.measured
    assert (mc < me) == (kept == "compiled")
    assert drv.steps == 30


def test_a_call_used_at_two_places_names_both_of_its_paths_before_optimization():
    reg = Registers(h=torch.ones(3), w=torch.ones(3, 3))
    relu = CALL(F.relu, reg("h"), store_to=reg("h"))  # one element at paths 1.0 and 1.2
    prog = SEQ([CALL(print, "start"), SEQ([relu, CALL(F.linear, reg("h"), reg("w"), store_to=reg("h")), relu])])
    fast = optimize(prog, options={"fuse-torch": {"form": "eager"}})
    fused = [el for _, el in walk(fast) if type(el) is FUSED][0]
    assert fused.origins == ("1.0 or 1.2", "1.1", "1.0 or 1.2")
    assert fused.detail_lines()[0] == "h = relu(h)  # was 1.0 or 1.2"


def test_a_fused_step_keeps_the_calls_it_was_made_from_when_the_originals_are_edited_in_place():
    reg = Registers(x=torch.zeros(2))
    first = CALL(torch.add, reg("x"), 1.0, store_to=reg("x"))
    prog = SEQ([first, CALL(torch.mul, reg("x"), 2.0, store_to=reg("x"))])
    fast = optimize(prog, options={"fuse-torch": {"form": "eager"}})
    listing = str(fast)
    first.find(CALL).replace_with(CALL(torch.sub, reg("x"), 1.0, store_to=reg("y")))  # the original, in place
    assert str(fast) == listing and sorted(writes(fast)) == ["x"]
    fast.run()
    assert same(reg["x"], torch.full((2,), 2.0)) and "y" not in reg  # (0 + 1) * 2: the calls as fused
