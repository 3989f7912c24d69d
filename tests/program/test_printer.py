"""Golden-text tests of the listing printers: a change in output shows up as a diff here."""

from __future__ import annotations

import textwrap

from flowvm import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Registers

import toy


def golden(text):
    return textwrap.dedent(text).strip("\n")


def test_program_listing():
    reg = Registers(mode="train", n=3, log=[])
    prog = SEQ([
        REPEAT(reg("n"), CALL(toy.mix, reg("x"), 2, k=5, store_to=reg("x")), counter=reg("i")),
        WHILE(CALL(toy.below, reg("w"), 2, store_to=reg("w")), PRINT("w is", reg("w"))),
        SWITCH(reg("mode"), {"train": BUFFER(4, CALL(toy.const, 1.5), store_to=reg("b")), "eval": SEQ([])},
               default=LOOP(CALL(toy.inc, 0))),
        WEAVE(1, [LOOP(CALL(toy.record, reg("log"), "tick")),
                  SWITCH(CALL(toy.mod3, reg("x")), {0: CALL(toy.pair, reg("x"), [reg("i"), {"k": "v"}])},
                         default=CALL(toy.const, None))], weights=[2, 1]),
    ])
    assert str(prog) == golden("""
        SEQ:
            REPEAT n (counter i):
                x = mix(x, 2, k=5)
            WHILE w = below(w, 2):
                PRINT 'w is', w
            SWITCH mode:
                CASE 'train':
                    b = BUFFER 4:
                        const(1.5)
                CASE 'eval':
                    SEQ: pass
                DEFAULT:
                    LOOP:
                        inc(0)
            WEAVE 1 of 2 (weights 2, 1):
                LOOP:
                    record(log, 'tick')
                SWITCH mod3(x):
                    CASE 0:
                        pair(x, [i, {'k': 'v'}])
                    DEFAULT:
                        const(None)
    """)
    assert repr(prog) == "<SEQ (4 children)>"
    assert repr(prog.elements[0].body) == "<CALL x = mix(x, 2, k=5)>"


def test_driver_listing_with_paused_weave_child():
    reg = Registers(log=[], w=0)
    prog = SEQ([
        CALL(toy.const, 0, store_to=reg("x")),
        WEAVE(-1, [REPEAT(3, SEQ([CALL(toy.inc, reg("x"), store_to=reg("x")), CALL(toy.record, reg("log"), reg("x"))])),
                   WHILE(CALL(toy.below, reg("w"), 2, store_to=reg("w")), PRINT("w", reg("w")))]),
    ])
    drv = prog.start()
    drv.run(max_steps=4)
    assert str(drv) == golden("""
        # flowvm driver: step 4, next: path '1.1.1'
           SEQ:  # at child 1 of 2
               x = const(0)
               WEAVE all of 2:  # 0 of 2 required finished, turn of child 1
                   REPEAT 3:  # 1 of 3 done
        ..             SEQ:  # not started
                           x = inc(x)
                           record(log, x)
                   WHILE w = below(w, 2):  # 0 iterations done
        >>             PRINT 'w', w
    """)


def test_names_of_callables():
    import functools

    import numpy as np
    import torch

    from flowvm.program.printer import fn_name

    class Source:
        def next(self):
            return 1

        @classmethod
        def make(cls):
            return cls()

    def outer():
        return lambda: 1

    assert fn_name(Source().next) == "Source.next"
    assert fn_name(Source.make) == "Source.make"
    assert fn_name(outer()) == "<lambda>"
    assert fn_name(np.zeros) == "zeros"
    assert fn_name([].append) == "list.append"
    assert fn_name(torch.nn.Linear(2, 2)) == "Linear"
    assert fn_name(torch.sin) == "torch.sin"  # not its hidden _VariableFunctionsClass
    assert fn_name(torch.Tensor.add) == "Tensor.add" and fn_name(str.upper) == "str.upper"
    assert fn_name(functools.partial(toy.add, 1)) == "partial(add, ...)"
    assert str(CALL(toy.add, np.zeros((2, 3)), torch.ones(4))) == "add(<array float64 2x3>, <tensor float32 4>)"


def test_a_container_holding_itself_prints_and_long_ones_are_cut():
    from flowvm.program.printer import fmt

    loop = [1, 2]
    loop.append(loop)
    assert fmt(loop) == "[1, 2, [...]]" and fmt({"me": loop}) == "{'me': [1, 2, [...]]}"
    big = list(range(100_000))
    assert fmt(big) == repr(big)[:37] + "..." and fmt({"k": big}, 20) == repr({"k": big})[:17] + "..."


def test_numpy_ufuncs_and_dispatchers_are_named_as_users_call_them():
    import types

    import numpy as np

    from flowvm import CALL, SEQ, Registers
    from flowvm.views.dot import to_mermaid

    reg = Registers(x=0.5)
    program = SEQ([CALL(np.clip, reg("x"), 0, 1, store_to=reg("y")), CALL(np.add, reg("y"), 2)])
    clip = "numpy.clip" if not isinstance(np.clip, types.FunctionType) else "clip"  # a plain function in numpy 1
    assert str(program).splitlines()[1:] == [f"    y = {clip}(x, 0, 1)", "    numpy.add(y, 2)"]
    assert f"{clip}(x, 0, 1)" in to_mermaid(program) and "Dispatcher" not in to_mermaid(program)
