"""Python source that rebuilds a program: round trips, values, imports, names, errors."""

import collections
import copy
import functools
import math
import operator
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from flowvm import (CALL, PRINT, REPEAT, SEQ, SWITCH, WEAVE, Depends, Registers, SourceError, from_source,
                    isolate, to_source)
from flowvm.program.paths import walk
from flowvm.testing import diff, outcome, same

import progen
import toy

Point = collections.namedtuple("Point", "x y")


class Dataset:
    def __init__(self):
        self.i = 0

    def next(self):
        self.i += 1
        return self.i


def get_device():
    return "cpu"


def fake_device():
    return "fake"


def echo(*args, **kwargs):
    return args, kwargs


def run_outcome(program):
    drv = copy.deepcopy(program).start()
    drv.run()
    return outcome(drv)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(progen.programs(depth=5))
def test_generated_programs_round_trip(program):
    text = to_source(program)
    rebuilt = from_source(text)
    assert to_source(rebuilt) == text  # a fixed point
    assert str(rebuilt) == str(program)
    assert not diff(run_outcome(program), run_outcome(rebuilt))


def test_values_of_every_supported_kind_round_trip_exactly():
    reg = Registers(arr=np.array([[1.5, np.nan], [np.inf, -0.0]], dtype=np.float32), t=torch.arange(4.0) / 3,
                    empty=np.zeros((0, 3)), big=2 ** 70, c=complex(1, -2.5))
    values = [math.nan, -math.inf, 0.1, b"\x00b", {1, 2}, frozenset({"a"}), Point(1, [2]), (1,), None, True,
              np.float32(0.1), np.int64(-3), torch.tensor([[1, 2]], dtype=torch.int16), "line\n'q'\"",
              functools.partial(echo, 1, k=2), {"nested": [reg("arr"), (reg("big"),)]}]
    prog = CALL(echo, *values, store_to=reg("out"), weird={"a-b": 1}, **{"not an identifier": 2})
    text = to_source(prog)
    rebuilt = from_source(text)
    for got, want in zip(rebuilt.args, prog.args):
        if isinstance(want, functools.partial):
            assert got.func is want.func and got.args == want.args and got.keywords == want.keywords
        elif isinstance(want, dict):
            assert str(got) == str(want)
        else:
            assert same(got, want) or (isinstance(want, float) and math.isnan(want) and math.isnan(got)) \
                or (isinstance(want, (set, frozenset)) and got == want), (got, want)
    assert type(rebuilt.args[6]) is Point
    for name in reg:
        assert same(rebuilt.args[-1]["nested"][0].file[name], reg[name]), name
    assert to_source(rebuilt) == text


def test_imports_global_generators_and_aliases():
    reg = Registers()
    prog = SEQ([CALL(random.random, store_to=reg("r")), CALL(np.random.rand, 2), CALL(math.sqrt, 4.0),
                CALL(collections.OrderedDict), CALL(toy.add, 1, 2), CALL(toy.const, Dataset), CALL(abs, -1)])
    text = to_source(prog)
    assert "from random import random" in text and "from numpy.random import rand" in text
    assert "from math import sqrt" in text and "CALL(abs, -1)" in text
    rebuilt = from_source(text)
    assert rebuilt.elements[0].fn == random.random and rebuilt.elements[1].fn == np.random.rand
    assert rebuilt.elements[5].args[0] is Dataset
    # two functions of one name from two modules
    clash = SEQ([CALL(toy.add, 1, 2), CALL(operator.add, 2, 3)])
    text = to_source(clash)
    assert "from toy import add\n" in text and "operator import add as add_2" in text
    rebuilt = from_source(text)
    assert rebuilt.elements[0].fn is toy.add and rebuilt.elements[1].fn is operator.add


def test_objects_by_name_shared_elements_scopes_and_overrides():
    reg = Registers(x=0)
    data = Dataset()
    step = CALL(data.next, store_to=reg("x"))
    sub = isolate(SEQ([step, PRINT(reg("x"))]), "a")
    prog = SEQ([sub, REPEAT(2, step), WEAVE(-1, [step, CALL(echo, Depends(get_device), store_to=reg("d"))])])
    prog.dependency_overrides[get_device] = fake_device
    with pytest.raises(SourceError, match=r"CALL x = Dataset.next\(\) at path '1.0'.*cannot be imported"):
        to_source(prog)
    text = to_source(prog, names={"data": data})
    assert "data.next" in text and "shared_1 = " in text
    assert ".with_scope(Scope('a', None, frozenset()))" in text
    rebuilt = from_source(text, names={"data": data})
    assert rebuilt.elements[1].body is rebuilt.elements[2].elements[0]  # shared as in the original
    assert rebuilt.elements[0].scope == sub.scope
    assert rebuilt.dependency_overrides == {get_device: fake_device}
    assert to_source(rebuilt, names={"data": data}) == text
    rebuilt.run()
    assert data.i == 4 and rebuilt.elements[1].body.store_to.file["d"] == (("fake",), {})


def test_sub_program_overrides_and_an_element_shared_before_its_container_round_trip():
    def build():
        reg = Registers(x=0)
        t = CALL(toy.inc, reg("x"), store_to=reg("x"))
        a = SEQ([t, CALL(echo, Depends(get_device), store_to=reg("d"))])
        a.dependency_overrides[get_device] = fake_device
        return SEQ([t, a, a])

    prog = build()
    text = to_source(prog)
    assert ".with_overrides({get_device: fake_device})" in text
    rebuilt = from_source(text)
    assert rebuilt.elements[0] is rebuilt.elements[1].elements[0] and rebuilt.elements[1] is rebuilt.elements[2]
    assert rebuilt.elements[1].dependency_overrides == {get_device: fake_device} and not rebuilt.dependency_overrides
    assert to_source(rebuilt) == text
    expected = prog.start()
    expected.run()
    got = rebuilt.start()
    got.run()
    assert dict(got.registers) == dict(expected.registers) == {"x": 3, "d": (("fake",), {})}


def test_method_descriptors_are_written_by_their_class():
    import torch

    reg = Registers(s="ab", d={"k": 1})
    prog = SEQ([CALL(str.upper, reg("s"), store_to=reg("u")), CALL(dict.get, reg("d"), "k", store_to=reg("v")),
                CALL(torch.Tensor.add, torch.ones(2), 1, store_to=reg("t"))])
    text = to_source(prog)
    assert "CALL(str.upper, reg('s')" in text and "CALL(dict.get, reg('d'), 'k'" in text and "builtins" not in text
    assert "from torch import Tensor" in text and "CALL(Tensor.add, torch.tensor(" in text
    rebuilt = from_source(text)
    assert str(rebuilt) == str(prog)
    rebuilt.run()
    assert rebuilt.elements[0].store_to.file["u"] == "AB" and rebuilt.elements[2].store_to.file["t"].tolist() == [2.0, 2.0]


def test_errors_name_the_element_or_register():
    reg = Registers(obj=Dataset())
    with pytest.raises(SourceError, match=r"at path '1'.*lambda.*cannot be imported") as info:
        to_source(SEQ([PRINT("a"), CALL(lambda: 1)]))
    assert info.value.path == "1"
    with pytest.raises(SourceError, match=r"a Dataset value .* has no source form"):
        to_source(CALL(toy.const, Dataset()))
    prog = CALL(toy.const, reg("obj"))
    with pytest.raises(SourceError, match="register 'obj' holds .*Dataset.*registers=False"):
        to_source(prog)
    text = to_source(prog, registers=False)
    assert "reg = Registers()" in text
    assert "Registers({'obj'" not in to_source(prog, registers=[])
    with pytest.raises(SourceError, match="did not bind 'program'"):
        from_source("x = 1")


def test_switch_cases_and_weave_weights():
    reg = Registers(s="b")
    prog = SWITCH(reg("s"), {"a": PRINT("a"), ("t", 1): PRINT("t"), None: PRINT("none")}, default=PRINT("d"))
    prog2 = WEAVE(-1, [prog, PRINT("x")], [2, 0.5])
    rebuilt = from_source(to_source(prog2))
    assert list(rebuilt.elements[0].cases) == ["a", ("t", 1), None] and rebuilt.weights == (2, 0.5)
    assert str(rebuilt) == str(prog2)
    assert len(list(walk(rebuilt))) == len(list(walk(prog2)))


def test_other_kinds_use_their_constructor_form():
    from toy import Opaque, Scaled

    reg = Registers(x=1)
    prog = SEQ([Scaled(CALL(toy.inc, reg("x"), store_to=reg("y")), 3, reg("z"))])
    text = to_source(prog)
    assert "from toy import Scaled" in text
    assert "Scaled(CALL(inc, reg('x'), store_to=reg('y')), 3, store_to=reg('z'))" in text
    assert str(from_source(text)) == str(prog) and to_source(from_source(text)) == text
    with pytest.raises(SourceError, match="no source form for OPAQUE elements"):
        to_source(Opaque(reg("x")))


def test_a_spawn_round_trips_with_its_fragment_and_shared_elements():
    from flowvm import POPEN, SPAWN

    def build():
        reg = Registers(x=2)
        step = CALL(toy.add, reg("x"), 1, store_to=reg("y"))
        frag = SEQ([step, CALL(toy.inc, reg("y"), store_to=reg("z"))])
        return SEQ([step, SPAWN(frag, store_to=reg("v"), timeout=60),
                    WEAVE(-1, [SPAWN(step), POPEN(["true"], store_to=reg("rc"))])])

    prog = build()
    text = to_source(prog)
    assert "from flowvm import CALL, POPEN, Registers, SEQ, SPAWN, WEAVE" in text
    assert "SPAWN(SEQ([shared_1, CALL(inc, reg('y'), store_to=reg('z'))]), store_to=reg('v'), timeout=60.0)" in text
    rebuilt = from_source(text)
    assert str(rebuilt) == str(prog) and to_source(rebuilt) == text
    spawn = rebuilt.elements[1]
    assert spawn.body.elements[0] is rebuilt.elements[0] is rebuilt.elements[2].elements[0].body
    assert [r.name for r in spawn.own_reads()] == ["x"] and spawn.timeout == 60.0
    reference = build()
    assert rebuilt.run() == reference.run() == [3, 0]  # the WEAVE's values
    assert dict(spawn.store_to.file) == dict(reference.elements[1].store_to.file) == {
        "x": 2, "y": 3, "z": 4, "v": 4, "rc": 0}


def test_elements_in_list_arguments_are_written_as_elements_and_errors_name_their_path():
    from toy import Pick

    reg = Registers(x=1)
    step = CALL(toy.inc, reg("x"), store_to=reg("y"))
    prog = SEQ([step, Pick([SEQ([PRINT("a")]), step], reg("k"))])
    text = to_source(prog)
    assert "Pick([SEQ([PRINT('a')]), shared_1], store_to=reg('k'))" in text
    rebuilt = from_source(text)
    assert str(rebuilt) == str(prog) and rebuilt.elements[1].options[1] is rebuilt.elements[0]
    bad = SEQ([step, Pick([SEQ([PRINT("a"), CALL(toy.const, Dataset())]), step], reg("k"))])
    with pytest.raises(SourceError, match="at path '1.0.1'") as info:
        to_source(bad)
    assert info.value.path == "1.0.1"
