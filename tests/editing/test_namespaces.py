"""Namespaces: isolated instances of one template side by side, and collisions reported by verify."""

import pickle

import pytest

import flowvm
from flowvm import BUFFER, CALL, PRINT, REPEAT, SEQ, SWITCH, WEAVE, Registers, VerifyError, isolate, template
from flowvm.editing.namespaces import Scope, collisions

import toy
from toy import Scaled, Opaque, Pick


class Model:
    def __init__(self, scale):
        self.scale = scale

    def step(self, w, x):
        return w * self.scale + x


def make_train(reg):
    @template(shared=["data", "log"])
    def train(model, steps=3):
        return SEQ([
            CALL(toy.const, 0, store_to=reg("w")),
            REPEAT(steps, SEQ([
                CALL(toy.const, reg("data"), store_to=reg("x")),
                CALL(model.step, reg("w"), reg("x"), store_to=reg("w")),
                CALL(toy.record, reg("log"), reg("w")),
            ]), counter=reg("i")),
            SWITCH(reg("i"), {steps: PRINT("done", reg("w"))}, default=PRINT("?")),
        ])
    return train


def test_two_isolated_instances_run_side_by_side_without_sharing_registers():
    reg = Registers(data=1, log=[])
    train = make_train(reg)
    a, b = Model(2), Model(3)
    prog = WEAVE(-1, [train(a).isolate("model_a"), train(b).isolate("model_b")])
    prog.run()
    assert reg["model_a.w"] == 7 and reg["model_b.w"] == 13  # (0*2+1)*2+1..., (0*3+1)*3+1...
    assert reg["model_a.i"] == reg["model_b.i"] == 3
    assert sorted(reg["log"]) == [1, 1, 3, 4, 7, 13]  # the shared log gets both
    assert "w" not in reg and "x" not in reg


def test_verify_reports_two_instances_of_a_template_writing_the_same_registers():
    reg = Registers(data=1, log=[])
    train = make_train(reg)
    prog = SEQ([train(Model(2)), train(Model(3))])
    with pytest.raises(VerifyError, match=r"register collision: two instances of template .*train \(paths '0' "
                                          r"and '1'.*both write 'i', 'w', 'x'; isolate them") as info:
        prog.start()
    assert info.value.path == "1" and info.value.register == "i"
    assert ">>" in str(info.value)  # the listing marks both instances
    assert collisions(SEQ([train(Model(2)).isolate("a"), train(Model(3)).isolate("b")])) == []


def test_the_same_namespace_twice_collides_and_the_same_element_twice_does_not():
    reg = Registers(data=1, log=[])
    train = make_train(reg)
    one = train(Model(2)).isolate("a")
    assert collisions(SEQ([one, one])) == []  # running one instance twice is not a collision
    with pytest.raises(VerifyError, match="they share a namespace; give each its own"):
        flowvm.verify(SEQ([one, train(Model(3)).isolate("a")]))


def test_isolate_renames_every_kind_of_register_reference_and_copies_initial_values():
    reg = Registers(n=2, x=5, keep=1)
    sub = SEQ([
        REPEAT(reg("n"), CALL(toy.pair, reg("x"), [reg("keep"), {"k": reg("x")}], store_to=reg("y")),
               counter=reg("c")),
        BUFFER(reg("n"), CALL(toy.inc, reg("x")), store_to=reg("b")),
        SWITCH(reg("x"), {5: PRINT(reg("x"))}),
    ])
    out = isolate(sub, "ns", shared=["keep"])
    names = {r.name for _, el in out.walk() for r in el.own_reads() + el.own_writes()}
    assert names == {"ns.n", "ns.x", "ns.y", "ns.c", "ns.b", "keep"}
    assert reg["ns.n"] == 2 and reg["ns.x"] == 5 and reg["x"] == 5  # copied, the originals stay
    assert out.scope == Scope("ns", None, frozenset({"keep"}))
    out.run()
    assert reg["ns.y"] == [5, [1, {"k": 5}]] and reg["ns.c"] == 2 and reg["ns.b"] == [6, 6]
    assert str(pickle.loads(pickle.dumps(out))) == str(out)
    assert pickle.loads(pickle.dumps(out)).scope == out.scope


def test_nested_namespaces_and_edits_keep_the_marks():
    reg = Registers(data=1, log=[])
    train = make_train(reg)
    inner = SEQ([train(Model(2)).isolate("a"), train(Model(3)).isolate("b")]).isolate("exp1")
    assert inner.scope.namespace == "exp1"
    assert inner.elements[0].scope.namespace == "a"  # inner marks survive renaming
    assert {r.name for r in inner.elements[0].elements[0].own_writes()} == {"exp1.a.w"}
    edited = inner.find(toy.record).insert_after(PRINT("hook"))
    assert edited.scope == inner.scope and edited.elements[1].scope == inner.elements[1].scope
    prog = SEQ([inner, SEQ([train(Model(2)).isolate("a"), train(Model(3)).isolate("b")]).isolate("exp2")])
    prog.run()
    assert reg["exp1.a.w"] == reg["exp2.a.w"] == 7


def test_bad_namespaces_are_clear_errors():
    reg = Registers(x=1)
    with pytest.raises(ValueError, match="identifier"):
        CALL(toy.inc, reg("x")).isolate("a.b")
    with pytest.raises(TypeError, match="shared register names must be str"):
        CALL(toy.inc, reg("x")).isolate("a", shared=[1])

    @template
    def not_a_program():
        return 3

    with pytest.raises(TypeError, match="must return a flowvm element"):
        not_a_program()


def test_other_kinds_are_renamed_through_their_constructor_form():
    reg = Registers(x=1)
    out = Scaled(CALL(toy.inc, reg("x"), store_to=reg("y")), 3, reg("z")).isolate("n")
    assert out.store_to.name == "n.z" and out.body.store_to.name == "n.y" and out.factor == 3
    with pytest.raises(TypeError, match="cannot rename the registers of a OPAQUE element"):
        Opaque(reg("x")).isolate("n")


def test_elements_inside_constructor_arguments_are_renamed_and_shared_ones_stay_shared():
    reg = Registers(x=1)
    step = CALL(toy.inc, reg("x"), store_to=reg("y"))
    out = SEQ([step, Pick([step, CALL(toy.add, reg("y"), 1, store_to=reg("z"))], reg("k"))]).isolate("n")
    pick = out.elements[1]
    assert [o.store_to.name for o in pick.options] == ["n.y", "n.z"] and pick.store_to.name == "n.k"
    assert pick.options[1].args[0].name == "n.y"
    assert pick.options[0] is out.elements[0]  # one element at two places: rebuilt once


def test_isolate_renames_commands_and_spawned_fragments():
    from flowvm import POPEN, SPAWN

    reg = Registers(x=2, tag="hello")
    frag = SEQ([CALL(toy.add, reg("x"), 1, store_to=reg("y")), CALL(toy.inc, reg("y"), store_to=reg("z"))])
    prog = SEQ([
        POPEN(["python3", "-c", "import sys; print(sys.argv[1])", reg("tag")], capture=True,
              store_to=reg("out")),
        SPAWN(frag, store_to=reg("v")),
    ])
    out = prog.isolate("a", shared=["tag"])
    assert str(out) == "\n".join([
        "SEQ:",
        "    a.out = POPEN ['python3', '-c', 'import sys; print(sys.argv[1])', tag] (capture)",
        "    a.v = SPAWN:",
        "        SEQ:",
        "            a.y = add(a.x, 1)",
        "            a.z = inc(a.y)",
    ])
    assert flowvm.program.analysis.writes(out) == {"a.out", "a.v", "a.y", "a.z"}
    assert flowvm.program.analysis.reads(out) == {"tag", "a.x", "a.y"}
    assert [r.name for r in out.elements[1].own_reads()] == ["a.x"]  # what the fragment needs shipped
    assert out.run() == 4
    assert reg["a.out"].stdout == "hello\n" and (reg["a.y"], reg["a.z"], reg["a.v"]) == (3, 4, 4)
    assert "y" not in reg and "v" not in reg and "out" not in reg  # the template's own names are untouched
    assert str(prog).count("a.") == 0  # and so is the template


def test_what_a_template_shares_stays_shared_when_an_enclosing_program_is_isolated():
    reg = Registers()

    @flowvm.template(shared=["log"])
    def train(tag):
        return SEQ([CALL(toy.const, tag, store_to=reg("w")), CALL(toy.const, tag, store_to=reg("log"))])

    prog = SEQ([SEQ([train("a").isolate("x"), CALL(toy.const, 1, store_to=reg("own"))]).isolate("o"),
                train("b").isolate("b")])
    prog.run()
    assert sorted(reg) == ["b.w", "log", "o.own", "o.x.w"]
    outer_writes_log = SEQ([train("a").isolate("x"), CALL(toy.const, 1, store_to=reg("log"))]).isolate("o")
    assert "o.log" in flowvm.program.analysis.writes(outer_writes_log)  # its own write is not the template's to share


def test_each_instance_gets_its_own_copy_of_a_value_its_template_register_holds():
    reg = Registers(history=[])
    body = CALL(list.append, reg("history"), "x")
    prog = SEQ([isolate(body, "a"), isolate(body, "b"), isolate(body, "b")])
    prog.run()
    assert reg["a.history"] == ["x"] and reg["b.history"] == ["x", "x"] and reg["history"] == []


def test_a_template_returning_another_templates_program_keeps_both_shared_names():
    reg = Registers(log=[], w=0)

    @template(shared="log")  # one name as a str
    def inner():
        return SEQ([CALL(toy.const, 1, store_to=reg("w")), CALL(list.append, reg("log"), "i")])

    @template(shared=["extra"])
    def outer():
        return inner()

    inst = isolate(outer(), "a")
    assert inst.scope.shared == frozenset({"log", "extra"}) and inst.scope.namespace == "a"
    assert sorted(flowvm.program.analysis.writes(inst)) == ["a.w"]  # log stays shared: appended to, never written
    assert "list.append(log, 'i')" in str(inst)
    with pytest.raises(TypeError, match="shared register names must be str"):
        isolate(inner(), "b", shared=[3])
