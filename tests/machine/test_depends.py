"""Depends: late-bound CALL arguments, and dependency_overrides on programs and drivers."""

import pickle

import pytest

import flowvm
from flowvm import CALL, REPEAT, SEQ, SWITCH, WHILE, Depends, FlowError, Registers
from flowvm.machine.leafcode import leaf_function
from flowvm.machine.depends import DependsCALL
from flowvm.testing import assert_same_run

CALLS = []


def get_device():
    CALLS.append("device")
    return "cuda:0"


def get_source(device=Depends(get_device)):
    CALLS.append("source")
    return f"source on {device}"


def cpu():
    return "cpu"


def stub_source():
    return "stub"


def describe(*parts, **named):
    return " | ".join(map(str, parts)) + (f" {named}" if named else "")


def counter_value(reg_value):
    return reg_value + 1


def test_a_depends_argument_is_resolved_each_time_the_call_runs():
    reg = Registers()
    CALLS.clear()
    prog = REPEAT(2, CALL(describe, Depends(get_device), store_to=reg("out")))
    assert isinstance(prog.body, DependsCALL) and isinstance(prog.body, CALL)
    assert prog.run() == "cuda:0" and CALLS == ["device", "device"]


def test_sub_dependencies_and_one_call_per_run_of_the_call():
    reg = Registers(x=1)
    CALLS.clear()
    prog = CALL(describe, Depends(get_source), [Depends(get_device)], reg("x"), dev={"d": Depends(get_device)})
    assert prog.run() == "source on cuda:0 | ['cuda:0'] | 1 {'dev': {'d': 'cuda:0'}}"
    assert CALLS == ["device", "source"]  # get_device once although used three times
    CALLS.clear()
    CALL(describe, Depends(get_device, use_cache=False), Depends(get_device, use_cache=False)).run()
    assert CALLS == ["device", "device"]


def test_program_overrides_replace_a_dependency_without_rebuilding():
    reg = Registers()
    prog = CALL(describe, Depends(get_source), store_to=reg("out"))
    prog.dependency_overrides[get_device] = cpu
    assert prog.run() == "source on cpu"
    prog.dependency_overrides[get_source] = stub_source
    assert prog.run() == "stub"
    prog.dependency_overrides.clear()
    assert prog.run() == "source on cuda:0"


def test_driver_overrides_take_precedence_and_can_change_mid_run():
    reg = Registers(out=[])
    prog = REPEAT(4, CALL(lambda log, d: log.append(d), reg("out"), Depends(get_device)))
    prog.dependency_overrides[get_device] = lambda: "program"
    drv = prog.start()
    drv.run(max_steps=1)
    drv.dependency_overrides[get_device] = cpu
    drv.run(max_steps=2)
    del drv.dependency_overrides[get_device]
    drv.run()
    assert reg["out"] == ["program", "cpu", "cpu", "program"]
    with pytest.raises(TypeError, match="must be a dict"):
        drv.dependency_overrides = [cpu]


def test_overrides_travel_with_copies_and_checkpoints(tmp_path):
    reg = Registers(out=[])
    prog = REPEAT(3, CALL(lambda log, d: log.append(d), reg("out"), Depends(get_device)))
    drv = prog.start()
    drv.dependency_overrides[get_device] = cpu
    drv.run(max_steps=1)
    flowvm.save(drv, tmp_path / "d.ckpt")
    loaded = flowvm.load(tmp_path / "d.ckpt")
    loaded.run()
    assert loaded.registers["out"] == ["cpu"] * 3
    copy = pickle.loads(pickle.dumps(drv))
    copy.run()
    assert copy.registers["out"] == ["cpu"] * 3


def test_depends_in_conditions_and_selectors_and_exact_resume():
    def build():
        reg = Registers(n=0, log=[])
        return SEQ([
            WHILE(CALL(lambda n, limit: n < limit, reg("n"), Depends(three)), CALL(counter_value, reg("n"),
                                                                                    store_to=reg("n"))),
            SWITCH(CALL(len, Depends(get_device)), {6: CALL(describe, "six", Depends(cpu), store_to=reg("r"))}),
        ])

    result = assert_same_run(build)
    assert result["registers"]["n"] == 3 and result["registers"]["r"] == "six | cpu"


def three():
    return 3


def test_plain_calls_keep_the_compiled_path_and_errors_name_the_dependency():
    reg = Registers()
    plain = CALL(describe, 1)
    assert type(plain) is CALL and leaf_function(plain, reg)() == "1"

    def broken():
        raise RuntimeError("no device")

    with pytest.raises(RuntimeError, match="no device") as info:
        CALL(describe, Depends(broken)).run()
    notes = "\n".join(info.value.__notes__)
    assert "while resolving Depends(broken)" in notes and "while running CALL describe" in notes

    def a(x=Depends(lambda: None)):
        return x

    def loop_a(x=Depends(a)):
        return x

    prog = CALL(describe, Depends(loop_a))
    prog.dependency_overrides[a] = loop_a
    with pytest.raises(FlowError, match="circular dependency"):
        prog.run()
    with pytest.raises(TypeError, match="provider must be callable"):
        Depends(3)


def test_depends_prints_matches_and_isolates_like_any_argument():
    reg = Registers(x=1)
    prog = CALL(describe, reg("x"), Depends(get_device), store_to=reg("y"))
    assert str(prog) == "y = describe(x, Depends(get_device))"
    assert prog.find(CALL(describe, reg("x"), Depends(get_device))).paths == [""]
    isolated = prog.isolate("a")
    assert isinstance(isolated, DependsCALL) and str(isolated) == "a.y = describe(a.x, Depends(get_device))"
    assert Depends(cpu) == Depends(cpu) and Depends(cpu) != Depends(cpu, use_cache=False)


def test_overrides_of_a_sub_program_apply_inside_it_when_composed_isolated_and_woven():
    from flowvm import WEAVE

    reg = Registers()
    stage = SEQ([CALL(describe, Depends(get_device), store_to=reg("dev"))])
    stage.dependency_overrides[get_device] = cpu
    other = CALL(describe, Depends(get_device), store_to=reg("other"))
    prog = SEQ([stage, other])
    prog.run()
    assert (reg["dev"], reg["other"]) == ("cpu", "cuda:0")  # the stage's override stays inside the stage

    woven = WEAVE(-1, [stage.isolate("a"), CALL(describe, Depends(get_device), store_to=reg("w"))])
    drv = pickle.loads(pickle.dumps(woven.start()))
    drv.run()
    assert (drv.registers["a.dev"], drv.registers["w"]) == ("cpu", "cuda:0")

    prog.dependency_overrides[get_device] = lambda: "outer"  # whoever composes has the last word
    prog.run()
    assert (reg["dev"], reg["other"]) == ("outer", "outer")
    drv = prog.start()
    drv.dependency_overrides[get_device] = lambda: "driver"  # and the driver has the very last
    drv.run()
    assert (reg["dev"], reg["other"]) == ("driver", "driver")


def test_optimizing_keeps_the_overrides_of_sub_programs():
    reg = Registers()
    stage = SEQ([CALL(describe, Depends(get_device), store_to=reg("dev"))])
    stage.dependency_overrides[get_device] = cpu
    prog = SEQ([SEQ([stage, CALL(describe, Depends(get_device), store_to=reg("other"))])])
    flowvm.optimize(prog).run()
    assert (reg["dev"], reg["other"]) == ("cpu", "cuda:0")



def test_fusing_torch_calls_keeps_the_overrides_and_namespace_of_their_seq():
    import torch

    def show(v):
        return v

    def provider():
        return "orig"

    reg = Registers(x=torch.ones(2))
    sub = SEQ([CALL(torch.add, reg("x"), 2.0, store_to=reg("y")), CALL(torch.relu, reg("y"), store_to=reg("z")),
               CALL(show, Depends(provider), store_to=reg("w"))])
    sub.dependency_overrides[provider] = lambda: "override"
    prog = SEQ([CALL(show, 1, store_to=reg("a")), sub])
    fast = flowvm.optimize(prog, options={"fuse-torch": {"form": "eager"}})
    assert "FUSED" in str(fast)
    fast.run()
    assert reg["w"] == "override"
    marked = flowvm.optimize(SEQ([sub.isolate("n"), CALL(show, 2)]), options={"fuse-torch": {"form": "eager"}})
    assert "FUSED" in str(marked) and marked.elements[0].scope is not None


def test_a_driver_keeps_the_overrides_its_program_had_when_it_started():
    for touched in (False, True):
        reg = Registers()
        prog = SEQ([CALL(describe, Depends(get_device), store_to=reg("d"))])
        if touched:
            prog.dependency_overrides  # noqa: B018 - reading it creates the (empty) table
        drv = prog.start()
        prog.dependency_overrides[get_device] = cpu  # set on the program after start()
        drv.run()
        assert reg["d"] == "cuda:0" and drv.program.dependency_overrides is not prog.dependency_overrides
