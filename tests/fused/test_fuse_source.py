"""A FUSED element through the editing tools of other modules: to_source/from_source and isolate."""

import torch

from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.editing.namespaces import isolate
from flowvm.passes import optimize
from flowvm.views.source import from_source, to_source

F = torch.nn.functional


def build():
    reg = Registers(x=torch.ones(3))
    prog = REPEAT(2, SEQ([CALL(F.relu, reg("x"), store_to=reg("h")),
                          CALL(F.softplus, reg("h"), beta=2.0, store_to=reg("x"))]))
    return optimize(prog, options={"fuse-torch": {"form": "eager", "trials": 5}}), reg


def test_an_optimized_program_round_trips_through_source():
    fast, reg = build()
    text = to_source(fast)
    assert "fused_step(" in text and "origins=['0.0', '0.1']" in text and "trials=5" in text
    back = from_source(text)
    assert str(back) == str(fast)
    assert back.body.settings == fast.body.settings
    assert torch.allclose(back.run(), fast.run())


def test_isolating_an_optimized_program_renames_the_registers_of_its_fused_steps():
    fast, reg = build()
    iso = isolate(fast, "a")
    assert [r.name for r in iso.body.inputs] == ["a.x"] and [r.name for r in iso.body.outputs] == ["a.h", "a.x"]
    assert iso.body.detail_lines() == ["a.h = relu(a.x)  # was 0.0", "a.x = softplus(a.h, beta=2.0)  # was 0.1"]
    iso.run()
    fast.run()
    assert torch.equal(reg["a.x"], reg["x"])
