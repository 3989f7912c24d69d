"""The optimizer: the pass registry and pipelines, debug verification, and the structural passes."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import flowvm
from flowvm import BUFFER, CALL, REPEAT, SEQ, WHILE, Registers
from flowvm.passes import DEFAULT_PIPELINE, PassError, get_pass, list_passes, optimize, register_pass, unregister_pass
from flowvm.passes.buffers import batch_buffers
from flowvm.passes.flatten import flatten
from flowvm.testing import diff, outcome

import progen


def inc(v):
    return v + 1


def twice(v):
    return 2 * v


# ------------------------------------------------------------------ registry
def test_the_built_in_passes_are_listed_in_pipeline_order_with_descriptions():
    names = [p.name for p in list_passes()]
    assert names[:3] == ["flatten", "batch-buffers", "fuse-torch"]
    assert DEFAULT_PIPELINE[:3] == ["flatten", "batch-buffers", "fuse-torch"]
    assert all(p.description for p in list_passes())
    # each description is a whole sentence, the first paragraph of the pass's docstring on one line
    assert all(p.description.endswith(".") and "\n" not in p.description for p in list_passes())
    assert get_pass("batch-buffers").description.endswith("(not inside a WEAVE, whose turns count the BUFFER's n "
                                                          "steps).")
    assert get_pass("flatten").run is flatten


def test_optimize_returns_a_new_program_and_leaves_the_original_untouched():
    reg = Registers(x=1)
    prog = SEQ([SEQ([CALL(inc, reg("x"), store_to=reg("x"))]), REPEAT(2, SEQ([CALL(twice, reg("x"), store_to=reg("x"))]))])
    before = str(prog)
    fast = optimize(prog)
    assert fast is not prog and str(prog) == before
    assert str(fast) == "SEQ:\n    x = inc(x)\n    REPEAT 2:\n        x = twice(x)"
    assert fast.run() == 8 and reg["x"] == 8


def test_unknown_pass_names_and_stray_options_are_errors_that_list_what_exists():
    prog = CALL(inc, 1)
    with pytest.raises(PassError, match="^no optimizer pass named 'nope'; known passes: flatten, batch-buffers") as e:
        optimize(prog, passes=["flatten", "nope"])
    assert isinstance(e.value, KeyError) and e.value.pass_name == "nope"
    with pytest.raises(PassError, match="options given for pass 'fuse-torch', which is not in the pipeline"):
        optimize(prog, passes=["flatten"], options={"fuse-torch": {"form": "eager"}})
    with pytest.raises(TypeError, match="a pass must be a registered name"):
        optimize(prog, passes=[42])
    with pytest.raises(TypeError, match="expects a flowvm program"):
        optimize("not a program")
    with pytest.raises(TypeError, match="options must map a pass name to its options"):
        optimize(prog, options=["flatten"])
    with pytest.raises(TypeError, match="pass 'fuse-torch' has no option 'compil_after'.*did you mean "
                                        "'compile_after'"):
        optimize(prog, options={"fuse-torch": {"compil_after": 5}})
    with pytest.raises(TypeError, match="pass 'batch-buffers' has no option 'x' \\(it takes: none\\)"):
        optimize(prog, passes=[("batch-buffers", {"x": 1})])


@pytest.mark.parametrize("given, error, message", [
    ({"payback": -1}, ValueError, "payback must be a number >= 0, got -1"),
    ({"payback": True}, ValueError, "payback must be a number >= 0, got True"),
    ({"compile_after": float("nan")}, ValueError, "compile_after must be a number of seconds >= 0, got nan"),
    ({"compile_in": "gpu"}, ValueError, "compile_in must be 'process' or 'thread', got 'gpu'"),
    ({"form": "fast"}, ValueError, "form must be one of"),
    ({"backend": 3}, TypeError, "backend must be a name or a callable, got int"),
    ({"backend": "eager", "mode": "max-autotune"}, ValueError, "mode and options apply to the inductor backend only"),
    ({"trials": 2.0}, ValueError, "trials must be an int >= 1, got 2.0"),
    ({"trials": 0}, ValueError, "trials must be an int >= 1, got 0"),
    ({"max_compiles": False}, ValueError, "max_compiles must be an int >= 1, got False"),
    ({"margin": 1}, ValueError, r"margin must be in \[0, 1\), got 1"),
])
def test_fuse_torch_options_out_of_range_are_refused_naming_the_option(given, error, message):
    with pytest.raises(error, match="fuse-torch: " + message):
        optimize(CALL(inc, 1), options={"fuse-torch": given})


def test_set_form_on_a_program_without_fused_steps_says_so():
    from flowvm.passes.fuse_torch import set_form

    with pytest.raises(LookupError, match="no FUSED element"):
        set_form(SEQ([CALL(inc, 1)]), "eager")


def test_a_single_name_a_function_and_a_pair_with_options_are_all_passes():
    reg = Registers(x=1)
    prog = SEQ([SEQ([CALL(inc, reg("x"), store_to=reg("x"))])])
    assert str(optimize(prog, passes="flatten")) == "x = inc(x)"
    seen = []

    def spy(program, tag="none"):
        seen.append(tag)
        return program

    optimize(prog, passes=[spy, (spy, {"tag": "pair"})])
    assert seen == ["none", "pair"]


def test_user_passes_register_by_decorator_join_pipelines_and_unregister():
    reg = Registers(x=1)

    @register_pass("test-double-calls", description="every CALL twice")
    def double_calls(program, times=2):
        from flowvm.passes.rewrite import rewrite

        return rewrite(program, lambda el, path: SEQ([el] * times) if isinstance(el, CALL) else el)

    try:
        assert "test-double-calls" in [p.name for p in list_passes()]
        assert "test-double-calls" not in DEFAULT_PIPELINE
        with pytest.raises(ValueError, match="already registered"):
            register_pass("test-double-calls", double_calls)
        prog = CALL(inc, reg("x"), store_to=reg("x"))
        fast = optimize(prog, passes=["test-double-calls", "flatten"], options={"test-double-calls": {"times": 3}})
        assert str(fast) == "SEQ:\n    x = inc(x)\n    x = inc(x)\n    x = inc(x)"
        assert fast.run() == 4
    finally:
        unregister_pass("test-double-calls")
    with pytest.raises(KeyError):
        get_pass("test-double-calls")


def test_debug_verifies_after_every_pass_and_names_the_pass_that_broke_the_program():
    reg = Registers(x=1)
    prog = SEQ([CALL(inc, reg("x"), store_to=reg("y")), CALL(twice, reg("y"), store_to=reg("z"))])

    def drop_first(program):
        return SEQ(program.elements[1:])

    broken = optimize(prog, passes=["flatten", drop_first])  # without debug nothing checks it
    with pytest.raises(flowvm.VerifyError):
        broken.start()
    with pytest.raises(PassError) as info:
        optimize(prog, passes=["flatten", drop_first], debug=True)
    err = info.value
    assert err.pass_name == "drop_first" and err.register == "y" and err.path == "0"
    assert "pass 'drop_first' produced a program that does not verify" in str(err)
    assert ">>     z = twice(y)  # here" in str(err)


def test_debug_catches_a_pass_that_edits_its_input_in_place():
    reg = Registers(x=1)
    prog = SEQ([flowvm.PRINT("hi"), CALL(inc, reg("x"), store_to=reg("y"))])

    def drop_prints(program):
        return program.find(flowvm.PRINT).remove()  # edits in place: wrong for a pass

    with pytest.raises(PassError, match="pass 'drop_prints' changed the program it was given in place"):
        optimize(prog, passes=[drop_prints], debug=True)


def test_debug_also_checks_the_input_and_what_a_pass_returns():
    reg = Registers()
    with pytest.raises(PassError, match="the program given to optimize does not verify") as info:
        optimize(CALL(inc, reg("missing")), debug=True)
    assert info.value.pass_name == "<input>"
    with pytest.raises(PassError, match="pass 'to_none' returned NoneType"):
        optimize(CALL(inc, 1), passes=[_named(lambda p: None, "to_none")])


def _named(fn, name):
    fn.__name__ = name
    return fn


def test_an_exception_inside_a_pass_gets_a_note_naming_the_pass():
    def explode(program):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        optimize(CALL(inc, 1), passes=["flatten", explode])
    assert "flowvm: in optimizer pass 'explode'" in info.value.__notes__


# ------------------------------------------------------------------ flatten
def test_flatten_golden_text_before_and_after():
    reg = Registers(x=0)
    f = CALL(inc, reg("x"), store_to=reg("x"))
    prog = SEQ([f, SEQ([SEQ([f, f]), SEQ([])]), REPEAT(2, SEQ([f])), WHILE(CALL(lambda v: v < 9, reg("x")), SEQ([SEQ([f])])),
                SEQ([])])
    assert str(prog) == """\
SEQ:
    x = inc(x)
    SEQ:
        SEQ:
            x = inc(x)
            x = inc(x)
        SEQ: pass
    REPEAT 2:
        SEQ:
            x = inc(x)
    WHILE <lambda>(x):
        SEQ:
            SEQ:
                x = inc(x)
    SEQ: pass"""
    assert str(flatten(prog)) == """\
SEQ:
    x = inc(x)
    x = inc(x)
    x = inc(x)
    REPEAT 2:
        x = inc(x)
    WHILE <lambda>(x):
        x = inc(x)
    SEQ: pass"""
    a, b = prog.start(), flatten(prog).start()
    a.run()
    reg["x"] = 0
    b.run()
    assert (a.result, a.steps) == (b.result, b.steps) == (None, 14)


def test_flatten_keeps_an_empty_last_seq_whose_value_is_the_result():
    reg = Registers(x=0)
    prog = SEQ([CALL(inc, reg("x"), store_to=reg("x")), SEQ([])])
    assert flatten(prog).run() is None
    assert flatten(SEQ([SEQ([])])).run() is None
    same = SEQ([CALL(inc, 1), CALL(inc, 2)])
    assert flatten(same) is same  # nothing to do: the very same object


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(progen.programs(depth=4))
def test_flatten_preserves_registers_result_and_steps_of_generated_programs(program):
    expected = copy.deepcopy(program).start()
    expected.run()
    got = flatten(copy.deepcopy(program)).start()
    got.run()
    assert not diff(outcome(expected), outcome(got))


# ------------------------------------------------------------------ batch-buffers
class Counter:
    def __init__(self):
        self.i = 0
        self.batch_calls = 0

    def next(self, scale=1):
        self.i += 1
        return np.array([self.i * scale])

    def next_batch(self, n, scale=1):
        self.batch_calls += 1
        return np.stack([self.next(scale) for _ in range(n)])


class NoBatch:
    def next(self):
        return 1


def test_batch_buffers_golden_text_values_and_steps():
    reg = Registers(k=3)
    src, src2 = Counter(), Counter()
    prog = SEQ([
        BUFFER(4, CALL(src.next, scale=reg("k")), store_to=reg("xs")),
        BUFFER(reg("k"), CALL(src.next), store_to=reg("ys")),
        BUFFER(2, CALL(NoBatch().next), store_to=reg("zs")),
        BUFFER(2, CALL(src2.next, store_to=reg("last")), store_to=reg("ws")),
        BUFFER(0, CALL(src.next), store_to=reg("none")),
    ])
    fast = batch_buffers(prog)
    assert str(fast) == """\
SEQ:
    xs = Counter.next_batch(4, scale=k)
    ys = batch_or_empty(Counter.next_batch, k)
    zs = BUFFER 2:
        NoBatch.next()
    ws = BUFFER 2:
        last = Counter.next()
    none = BUFFER 0:
        Counter.next()"""
    reference = copy.deepcopy(prog).start()
    reference.run()
    drv = fast.start()
    drv.run()
    for name in ("xs", "ys", "zs", "ws", "last", "none"):
        assert np.array_equal(np.asarray(reg[name]), np.asarray(reference.registers[name])), name
    assert reg["xs"].shape == (4, 1) and src.batch_calls == 2
    assert (reference.steps, drv.steps) == (4 + 3 + 2 + 2, 1 + 1 + 2 + 2)


def test_batch_buffers_leaves_a_buffer_inside_a_weave_alone_since_turns_count_its_steps():
    from flowvm import WEAVE

    def build():
        reg = Registers(ticks=[])
        return WEAVE(1, [BUFFER(3, CALL(Counter().next)), REPEAT(2, CALL(list.append, reg("ticks"), "t"))]), reg

    prog, reg = build()
    expected = prog.run()
    fast, got = build()
    fast = optimize(fast, passes=["batch-buffers"])
    assert str(fast) == str(prog)
    assert fast.run() == expected and got["ticks"] == reg["ticks"] == ["t", "t"]


def test_optimize_returns_a_new_program_even_when_no_pass_changes_anything():
    reg = Registers(x=1)
    prog = SEQ([CALL(abs, reg("x"), store_to=reg("x"))])
    prog.dependency_overrides[abs] = round
    fast = optimize(prog, passes=["flatten"])
    assert fast is not prog and str(fast) == str(prog)
    fast.find(abs).insert_after(CALL(print, "hook"))
    fast.dependency_overrides[abs] = abs
    assert str(prog) == "SEQ:\n    x = abs(x)" and prog.dependency_overrides[abs] is round


def test_a_register_count_of_zero_gives_an_empty_buffer_without_calling_the_source():
    reg = Registers(n=0)
    src = Counter()
    fast = batch_buffers(BUFFER(reg("n"), CALL(src.next), store_to=reg("xs")))
    assert fast.run() == [] and src.batch_calls == 0 and src.i == 0
    for bad, error in ((2.0, TypeError), (-1, ValueError)):  # checked as BUFFER checks its count
        reg["n"] = bad
        with pytest.raises(error, match="BUFFER count holds .*expected an int >= 0"):
            fast.run()


def test_the_pca_program_gives_the_same_components_after_optimizing():
    from flowvm.programs import pca

    prog = pca.build(samples=50, batches=3)
    expected = prog.start()
    expected.run()
    fast = optimize(pca.build(samples=50, batches=3), debug=True)
    assert "next_batch(50)" in str(fast) and "BUFFER" not in str(fast)
    drv = fast.start()
    drv.run()
    assert drv.steps < expected.steps
    assert not diff({**outcome(expected), "steps": 0}, {**outcome(drv), "steps": 0})


def test_golden_listing_after_each_pass_of_the_default_pipeline():
    import torch

    F = torch.nn.functional

    @flowvm.fusable
    def to_tensor(xs):
        return torch.as_tensor(xs, dtype=torch.float32)

    reg = Registers(w=torch.ones(1, 1))
    src = Counter()
    prog = SEQ([
        SEQ([BUFFER(3, CALL(src.next), store_to=reg("xs"))]),
        CALL(to_tensor, reg("xs"), store_to=reg("x")),
        SEQ([CALL(F.linear, reg("x"), reg("w"), store_to=reg("h")), SEQ([CALL(F.relu, reg("h"), store_to=reg("h"))])]),
    ])
    listings = [str(prog)]
    current = prog
    for name in DEFAULT_PIPELINE:
        current = optimize(current, passes=[(name, {"form": "eager"} if name == "fuse-torch" else {})], debug=True)
        listings.append(str(current))
    assert listings == [
        "SEQ:\n"
        "    SEQ:\n"
        "        xs = BUFFER 3:\n"
        "            Counter.next()\n"
        "    x = to_tensor(xs)\n"
        "    SEQ:\n"
        "        h = linear(x, w)\n"
        "        SEQ:\n"
        "            h = relu(h)",
        # flatten
        "SEQ:\n"
        "    xs = BUFFER 3:\n"
        "        Counter.next()\n"
        "    x = to_tensor(xs)\n"
        "    h = linear(x, w)\n"
        "    h = relu(h)",
        # batch-buffers
        "SEQ:\n"
        "    xs = Counter.next_batch(3)\n"
        "    x = to_tensor(xs)\n"
        "    h = linear(x, w)\n"
        "    h = relu(h)",
        # fuse-torch
        "SEQ:\n"
        "    xs = Counter.next_batch(3)\n"
        "    FUSED 3 calls, torch.compile(inductor): eager (forced):\n"
        "        x = to_tensor(xs)  # was 1\n"
        "        h = linear(x, w)  # was 2\n"
        "        h = relu(h)  # was 3",
    ]
    drv = current.start()
    assert drv.run().tolist() == [[1.0], [2.0], [3.0]] and drv.steps == 2
