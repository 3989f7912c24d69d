"""find / replace_with / insert_before / insert_after / remove on programs (edits change the program in place)."""

import copy
import pickle

import numpy as np
import pytest

import flowvm
from flowvm import ANY, BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, EditError, Registers
from flowvm.editing.edit import matches


class Layer:
    def __init__(self, name):
        self.name = name

    def forward(self, v):
        return v + 1


def cd1_update(v, layer, lr=0.1):
    layer.log.append((layer.name, v))
    return v + 1


def debug(log, v):
    log.append(("debug", v))


def double(v):
    return 2 * v


def build(reg, layer1, layer2):
    return REPEAT(2, SEQ([
        CALL(cd1_update, reg("v"), layer=layer1, store_to=reg("v")),
        CALL(cd1_update, reg("v"), layer=layer2, lr=0.5, store_to=reg("v")),
    ]))


def layers():
    a, b = Layer("a"), Layer("b")
    a.log = b.log = []
    return a, b


def test_the_example_from_the_issue_works_as_written():
    reg = Registers(v=0, log=[])
    layer1, layer2 = layers()
    prog = build(reg, layer1, layer2)
    body = prog.body
    prog.find(CALL(cd1_update, layer=layer1)).replace_with(
        SEQ([CALL(cd1_update, reg("v"), layer=layer1, store_to=reg("v")), CALL(debug, reg("log"), reg("v"))]))
    assert str(prog).count("debug") == 1  # edited in place
    assert str(body).count("debug") == 0  # the elements below the root are never changed
    prog.run()
    assert reg["log"] == [("debug", 1), ("debug", 3)]
    assert layer1.log == [("a", 0), ("b", 1), ("a", 2), ("b", 3)]


def test_an_edit_leaves_drivers_started_before_it_and_copies_of_the_program_as_they_were():
    reg = Registers(v=0, log=[])
    layer1, layer2 = layers()
    prog = build(reg, layer1, layer2)
    kept = copy.copy(prog)
    drv = prog.start()
    drv.run(max_steps=1)
    again = prog.find(cd1_update).insert_after(CALL(debug, reg("log"), reg("v")))
    assert again is prog and str(prog).count("debug") == 2
    assert "debug" not in str(kept) and "debug" not in str(drv)
    drv.run()
    assert reg["log"] == [] and drv.steps == 4
    with pytest.raises(EditError, match="already used"):
        matches = prog.find(debug)
        matches.remove()
        matches.remove()


def test_matches_found_before_another_edit_of_the_program_are_refused():
    reg = Registers(v=0, log=[])
    prog = build(reg, *layers())
    updates = prog.find(cd1_update)
    prog.at("0").insert_before(CALL(debug, reg("log"), reg("v")))  # moves every update one place on
    before = str(prog)
    with pytest.raises(EditError, match="changed since these matches") as err:
        updates.remove()
    assert err.value.path is not None and str(prog) == before  # nothing half-done
    prog.find(cd1_update).remove()
    assert "cd1_update" not in str(prog) and str(prog).count("debug") == 1


def test_a_class_function_finds_the_calls_of_its_bound_methods_also_in_a_loaded_run():
    reg = Registers(v=0, log=[])
    a, b = layers()
    prog = SEQ([CALL(a.forward, 1, store_to=reg("v")), CALL(b.forward, reg("v"), store_to=reg("v"))])
    assert len(prog.find(Layer.forward)) == 2 and len(prog.find(a.forward)) == 1
    drv = pickle.loads(pickle.dumps(prog.start()))  # methods of copies of the layers
    reg = drv.registers
    drv.find(Layer.forward).insert_after(CALL(debug, reg("log"), reg("v")))
    assert str(drv.program).count("debug") == 2
    drv.run()
    assert reg["log"] == [("debug", 2), ("debug", 3)]


def test_wrapping_the_root_in_place_keeps_a_tree():
    reg = Registers(v=0, log=[])
    prog = build(reg, *layers())
    prog.find(REPEAT).insert_after(CALL(debug, reg("log"), reg("v")))
    assert isinstance(prog, SEQ) and isinstance(prog.elements[0], REPEAT) and prog.elements[0] is not prog
    prog.run()
    assert reg["log"] == [("debug", 4)]


def test_pattern_arguments_not_named_match_anything_and_named_ones_must_be_equal():
    reg = Registers(v=0)
    layer1, layer2 = layers()
    prog = build(reg, layer1, layer2)
    assert prog.find(CALL(cd1_update)).paths == ["0.0", "0.1"]
    assert prog.find(CALL(cd1_update, layer=layer2)).paths == ["0.1"]
    assert prog.find(CALL(cd1_update, lr=0.5)).paths == ["0.1"]
    # a positional pattern argument is compared with the positional argument, not a keyword one
    assert prog.find(CALL(cd1_update, reg("v"), layer2), missing_ok=True).paths == []
    assert prog.find(CALL(cd1_update, ANY, layer=layer1)).paths == ["0.0"]
    assert prog.find(CALL(cd1_update, store_to=reg("v"))).paths == ["0.0", "0.1"]
    assert prog.find(cd1_update).paths == ["0.0", "0.1"]  # a function matches its CALLs
    with pytest.raises(EditError, match="no element matches CALL cd1_update.*other arguments"):
        prog.find(CALL(cd1_update, lr=0.3))
    assert len(prog.find(CALL(cd1_update, lr=0.3), missing_ok=True)) == 0


def test_registers_match_by_name_and_values_by_equality():
    reg, other = Registers(x=1), Registers(x=1)
    arr = np.arange(3)
    prog = SEQ([CALL(double, reg("x")), CALL(np.sum, arr), CALL(double, [reg("x"), {"k": 2}])])
    assert prog.find(CALL(double, other("x"))).paths == ["0"]
    assert prog.find(CALL(np.sum, np.arange(3))).paths == ["1"]
    assert prog.find(CALL(np.sum, np.arange(4)), missing_ok=True).paths == []
    assert prog.find(CALL(double, [reg("x"), {"k": 2}])).paths == ["2"]
    assert prog.find(CALL(double, [reg("x"), {"k": 3}]), missing_ok=True).paths == []
    assert prog.find(CALL(double, [ANY, {"k": 2}])).paths == ["2"]


def test_container_patterns_match_settings_and_children():
    reg = Registers(x=1, n=2)
    body = CALL(double, reg("x"), store_to=reg("x"))
    prog = SEQ([REPEAT(2, body), REPEAT(3, body), REPEAT(reg("n"), body), BUFFER(2, body),
                WEAVE(1, [body, LOOP(body)], [2, 1]), SWITCH(reg("x"), {1: body}, default=PRINT("x"))])
    assert prog.find(REPEAT(3, CALL(double))).paths == ["1"]
    assert prog.find(REPEAT(reg("n"), CALL(double))).paths == ["2"]
    assert prog.find(BUFFER(2, CALL(double))).paths == ["3"]
    assert prog.find(WEAVE(1, [CALL(double), LOOP(CALL(double))])).paths == ["4"]
    assert prog.find(WEAVE(1, [CALL(double), LOOP(CALL(double))], [1, 1]), missing_ok=True).paths == []
    assert prog.find(SWITCH(reg("x"), {1: CALL(double)}, default=PRINT())).paths == ["5"]
    assert prog.find(where=lambda el: el.kind == "REPEAT").paths == ["0", "1", "2"]
    assert prog.find(REPEAT).paths == ["0", "1", "2"] and prog.find(LOOP).paths == ["4.1"]
    with pytest.raises(EditError, match="no element matches any WHILE"):
        prog.find(WHILE)
    assert prog.find(CALL(double), where=lambda el: el is body).paths == ["0.0", "1.0", "2.0", "3.0", "4.0",
                                                                         "4.1.0", "5.0"]
    assert matches(SEQ([]), SEQ([])) and not matches(SEQ([]), SEQ([body]))


def test_insert_before_and_after_go_into_a_seq_or_wrap_the_element():
    reg = Registers(x=1, log=[])
    hook = CALL(debug, reg("log"), reg("x"))
    prog = SEQ([CALL(double, reg("x"), store_to=reg("x")), REPEAT(2, CALL(double, reg("x"), store_to=reg("x")))])
    edited = copy.copy(prog).find(double).insert_after(hook)
    assert str(edited) == "\n".join([
        "SEQ:",
        "    x = double(x)",
        "    debug(log, x)",
        "    REPEAT 2:",
        "        SEQ:",
        "            x = double(x)",
        "            debug(log, x)",
    ])
    edited.run()
    assert reg["log"] == [("debug", 2), ("debug", 4), ("debug", 8)]
    before = prog.find(double).insert_before(hook, PRINT("x"))
    assert [el.kind for el in before.elements] == ["CALL", "PRINT", "CALL", "REPEAT"]
    assert [el.kind for el in before.elements[3].body.elements] == ["CALL", "PRINT", "CALL"]
    root = CALL(double, 3).find(double).insert_after(PRINT("done"))  # the root itself is wrapped
    assert isinstance(root, SEQ) and root.run() is None


def test_remove_from_seq_and_weave_and_elsewhere_an_empty_seq():
    reg = Registers(x=1)
    d = CALL(double, reg("x"), store_to=reg("x"))
    prog = SEQ([d, PRINT("a"), REPEAT(2, d), WEAVE(-1, [d, PRINT("b")], [2, 1])])
    out = prog.find(double).remove()
    assert [el.kind for el in out.elements] == ["PRINT", "REPEAT", "WEAVE"]
    assert out.elements[1].body.kind == "SEQ" and out.elements[1].body.elements == ()
    assert out.elements[2].weights == (1,) and len(out.elements[2].elements) == 1
    with pytest.raises(EditError, match="requires 2 finished children"):
        WEAVE(2, [d, PRINT("b")]).find(PRINT()).remove()
    with pytest.raises(EditError, match="cannot remove the root"):
        d.find(double).remove()


def test_while_condition_and_switch_selector_must_stay_calls():
    reg = Registers(w=0)
    cond = CALL(lambda w: w + 1 if w < 2 else 0, reg("w"), store_to=reg("w"))
    prog = SEQ([WHILE(cond, PRINT("x")), SWITCH(CALL(double, 1), {2: PRINT("two")})])
    with pytest.raises(EditError, match="condition of its parent"):
        prog.find(where=lambda el: el is cond).insert_before(PRINT("no"))
    with pytest.raises(EditError, match="a condition must be a CALL"):
        prog.find(where=lambda el: el is cond).replace_with(SEQ([cond]))
    with pytest.raises(EditError, match="selector of its parent"):
        prog.find(double).remove()
    swapped = prog.find(double).replace_with(CALL(double, 2))
    assert swapped.elements[1].selector.args == (2,)


def test_replace_with_a_function_of_the_match_and_nested_matches():
    reg = Registers(x=1)
    inner = SEQ([CALL(double, reg("x"), store_to=reg("x"))])
    prog = SEQ([inner, SEQ([inner])])
    wrapped = copy.copy(prog).find(where=lambda el: el.kind == "CALL").replace_with(lambda old: REPEAT(2, old))
    assert wrapped.run() == 16 and reg["x"] == 16
    # outer matches replace what inner edits produced: every SEQ becomes an empty one
    assert str(copy.copy(prog).find(where=lambda el: el.kind == "SEQ").replace_with(SEQ([]))) == "SEQ: pass"
    with pytest.raises(TypeError, match="expected a flowvm element"):
        prog.find(double).replace_with(lambda old: "nope")
    with pytest.raises(TypeError, match="at least one element"):
        prog.find(double).insert_after()


def test_at_addresses_by_path_and_edits_keep_other_elements_shared():
    reg = Registers(x=1)
    a, b = CALL(double, reg("x"), store_to=reg("x")), PRINT("b")
    prog = SEQ([a, SEQ([b, a])])
    out = prog.at("1.0").replace_with(PRINT("c"))
    assert out.elements[0] is a and out.elements[1].elements[1] is a
    assert prog.at("1.1", (0,)).paths == ["1.1", "0"]
    with pytest.raises(EditError, match="no element at path '1.5'"):
        prog.at("1.5")


def test_edited_programs_verify_pickle_and_carry_dependency_overrides():
    reg = Registers(x=1)
    prog = SEQ([CALL(double, reg("x"), store_to=reg("x"))])
    prog.dependency_overrides[double] = double
    edited = copy.copy(prog).find(double).insert_before(CALL(double, reg("y"), store_to=reg("x")))
    with pytest.raises(flowvm.VerifyError, match="'y'"):
        edited.start()
    assert edited.dependency_overrides == {double: double}
    assert edited.dependency_overrides is not prog.dependency_overrides
    ok = prog.find(double).insert_after(PRINT(reg("x")))
    clone = pickle.loads(pickle.dumps(ok))
    assert str(clone) == str(ok)


def test_bad_patterns_are_clear_errors():
    prog = SEQ([PRINT("a")])
    with pytest.raises(TypeError, match="pattern must be an element or a function"):
        prog.find("PRINT")
    with pytest.raises(TypeError, match="give a pattern"):
        prog.find()
    with pytest.raises(EditError, match="0 REPEAT elements"):
        prog.find(REPEAT(2, PRINT("a")))


def test_functions_of_a_script_match_their_copies_in_a_copied_or_loaded_run(tmp_path):
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import copy, pickle, sys
        import flowvm
        from flowvm import CALL, PRINT, REPEAT, SEQ, Registers

        def inc(v):
            return v + 1

        class Layer:
            def forward(self, v):
                return v * 2

        def other(v):
            return v + 1   # the same code as inc, but another function

        if __name__ == "__main__":
            reg = Registers(v=0)
            layer = Layer()
            prog = SEQ([REPEAT(3, CALL(inc, reg("v"), store_to=reg("v"))), CALL(layer.forward, reg("v")),
                        CALL(other, 1)])
            drv = prog.start()
            drv.run(max_steps=2)
            flowvm.save(drv, sys.argv[1])
            for copied in (pickle.loads(pickle.dumps(drv)), copy.deepcopy(drv), flowvm.load(sys.argv[1])):
                print(copied.find(inc).paths, copied.find(Layer.forward).paths)
    """))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run.ckpt")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['0.0'] ['1']"] * 3


def test_an_element_a_driver_is_running_is_not_edited_in_place_under_it():
    reg = Registers(v=0, log=[])
    inner = SEQ([CALL(debug, reg("log"), 1), CALL(debug, reg("log"), 2), CALL(debug, reg("log"), 3)])
    drv = SEQ([CALL(debug, reg("log"), 0), inner]).start()
    drv.run(max_steps=2)  # inside inner
    with pytest.raises(EditError, match=r"SEQ is running in a driver \(step 2, at path '1'\)"):
        inner.at("0").insert_after(CALL(debug, reg("log"), "W"))
    with pytest.raises(EditError, match="is running in a driver"):
        drv.program.find(debug).insert_after(PRINT("x"))  # the driver's own root
    assert "W" not in str(inner)
    drv.at("1.1").insert_before(CALL(debug, drv.registers("log"), "W"))  # through the driver instead
    drv.run()
    assert reg["log"] == [("debug", 0), ("debug", 1), ("debug", "W"), ("debug", 2), ("debug", 3)]
    inner.at("0").insert_after(CALL(debug, reg("log"), "late"))  # once the run is over, in place again
    assert "late" in str(inner)


def test_an_element_edited_in_place_changes_the_analysis_of_programs_holding_it():
    from flowvm.program.analysis import can_step, info, reads, writes

    reg = Registers(x=1)
    inner = SEQ([CALL(double, reg("x"), store_to=reg("y"))])
    outer = SEQ([inner, CALL(debug, [], "done")])
    assert sorted(reads(outer)) == ["x"] and sorted(writes(outer)) == ["y"]  # cached on outer
    inner.find(double).insert_after(CALL(double, reg("never_written"), store_to=reg("z")))
    assert sorted(reads(outer)) == sorted(info(outer).reads) == ["never_written", "x"]
    assert sorted(writes(outer)) == ["y", "z"]
    with pytest.raises(flowvm.VerifyError, match="'never_written'"):
        flowvm.verify(outer)
    body = SEQ([CALL(double, 1)])
    loop = LOOP(body)
    assert can_step(loop)
    body.find(double).remove()
    with pytest.raises(flowvm.VerifyError, match="can never take a step"):
        flowvm.verify(loop)


def test_a_paused_driver_runs_an_element_edited_in_place_before_it_started_as_its_copies_do():
    reg = Registers(log=[])
    step = CALL(debug, reg("log"), "f")
    drv = REPEAT(4, step).start()
    drv.run(max_steps=2)  # paused with `step` next: entered, not started, so it may be edited in place
    step.find(debug).replace_with(CALL(debug, reg("log"), "hook"))
    copy_ = pickle.loads(pickle.dumps(drv))
    drv.run()
    copy_.run()
    assert [v for _, v in reg["log"]] == [v for _, v in copy_.registers["log"]] == ["f", "f", "hook", "hook"]

    reg = Registers(log=[])
    later = SEQ([CALL(debug, reg("log"), "c1"), CALL(debug, reg("log"), "c2")])
    drv = SEQ([CALL(debug, reg("log"), "a"), CALL(debug, reg("log"), "b"), later]).start()
    drv.run(max_steps=1)  # `later` is not entered yet
    later.find(where=lambda el: el is later).replace_with(
        lambda old: WEAVE(-1, [old, SEQ([CALL(debug, reg("log"), "d1"), CALL(debug, reg("log"), "d2")])]))
    drv.run()
    assert [v for _, v in reg["log"]] == ["a", "b", "c1", "d1", "c2", "d2"]  # the new WEAVE interleaves


def test_a_leaf_polling_work_it_started_is_not_edited_in_place_under_its_driver():
    import sys

    from flowvm import POPEN

    reg = Registers(log=[])
    proc = POPEN([sys.executable, "-c", "import time; time.sleep(0.5)"], store_to=reg("rc"))
    drv = SEQ([proc, CALL(debug, reg("log"), "after")]).start()
    drv.step()  # launched: each later step polls it
    with pytest.raises(EditError, match=r"POPEN .* is running in a driver \(step 1, at path '0'\)"):
        proc.find(POPEN).replace_with(CALL(debug, reg("log"), "replacement"))
    drv.run()
    assert reg["rc"] == 0 and [v for _, v in reg["log"]] == ["after"] and drv.live == {}


def test_an_edit_made_by_a_call_of_the_running_program_is_refused_alike_by_step_and_run():
    def build():
        reg = Registers(log=[], k=0)
        work = CALL(debug, reg("log"), "old")
        outcome = []

        def installer(k, drv_box):
            if k == 1:
                try:
                    work.find(debug).replace_with(CALL(debug, reg("log"), "new"))
                except EditError as err:
                    outcome.append(("program", str(err)))
                try:
                    drv_box[0].find(debug).insert_after(PRINT("x"))
                except EditError as err:
                    outcome.append(("driver", str(err)))
            return k + 1

        box = []
        drv = REPEAT(3, SEQ([CALL(installer, reg("k"), box, store_to=reg("k")), work])).start()
        box.append(drv)
        return drv, reg, outcome

    for how in ("step", "run", "timeout"):
        drv, reg, outcome = build()
        if how == "step":
            while drv.step() is flowvm.INCOMPLETE:
                pass
        else:
            drv.run(timeout=30 if how == "timeout" else None)
        assert [v for _, v in reg["log"]] == ["old"] * 3, how
        assert [w for w, _ in outcome] == ["program", "driver"], how
        assert "a CALL of that run is refused" in outcome[0][1] and "patch it between steps" in outcome[1][1]


@pytest.mark.parametrize("call, message", [
    (lambda q: q.at(3.5), "an element path is a str like '0.2.1' or a tuple of child indices, got float 3.5"),
    (lambda q: q.find(CALL, where=3), "find: where must be a predicate taking an element, got int 3"),
    (lambda q: flowvm.to_source(q, names=[1]), "to_source: names must be a dict of name -> object, got list"),
    (lambda q: flowvm.from_source(5), "from_source: text must be the str to_source wrote, got int"),
    (lambda q: flowvm.to_dot(5), "to_dot: expected a flowvm program or Driver, got int 5"),
    (lambda q: flowvm.to_mermaid("x"), "to_mermaid: expected a flowvm program or Driver, got str 'x'"),
])
def test_bad_arguments_to_the_program_tools_name_the_function_and_what_it_expects(call, message):
    with pytest.raises(TypeError) as info:
        call(SEQ([CALL(double, 1)]))
    assert str(info.value) == message
