"""A fused step that communicates with other ranks (a DistributedDataParallel module, a torch.distributed
collective) is never compiled: every rank must run the same collectives in the same order, and each rank
would change forms at its own time.  It stays eager and says why in runtime().refused."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

import flowvm
from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.fused import FUSED


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    # a DDP module's reducer holds the group: collected while the group lives, not by a later test's garbage
    # collection (where the group's destructor joined threads that waited on it: the process hung)
    gc.collect()
    dist.destroy_process_group()


def _fused(element):
    if isinstance(element, FUSED):
        return [element]
    return [f for child in (getattr(element, "children", None) or [getattr(element, "body", None)])
            if child is not None for f in _fused(child)]


def _training(wrap, form):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    net = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    reg = Registers(x=torch.randn(16, 4, generator=g), y=torch.randint(0, 3, (16,), generator=g))
    step = SEQ([CALL(opt.zero_grad), CALL(net, reg("x"), store_to=reg("logits")),
                CALL(torch.nn.functional.cross_entropy, reg("logits"), reg("y"), store_to=reg("loss")),
                CALL(torch.Tensor.backward, reg("loss")), CALL(opt.step)])
    step = flowvm.optimize(step, options={"fuse-torch": {"form": form, "background": False}})
    return REPEAT(5, step), model


@pytest.mark.parametrize("wrap", [torch.nn.parallel.DistributedDataParallel,
                                  lambda m: torch.nn.Sequential(torch.nn.parallel.DistributedDataParallel(m))],
                         ids=["ddp", "ddp inside a module"])
def test_a_step_holding_a_ddp_module_stays_eager_and_says_why(group, wrap):
    program, model = _training(wrap, "compiled")
    fused = _fused(program)
    assert fused, "the pass fused the training step"
    program.run()
    runtime = fused[0].runtime()
    assert runtime.state == "eager" and runtime.compiles == 0 and runtime.hits == 0
    assert "DistributedDataParallel communicates with the other ranks" in runtime.refused
    reference, ref_model = _training(wrap, "eager")
    reference.run()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_a_collective_is_never_inside_a_fused_step(group):
    reg = Registers(x=torch.ones(3))
    step = SEQ([CALL(torch.mul, reg("x"), 2.0, store_to=reg("x")), CALL(torch.sin, reg("x"), store_to=reg("x")),
                CALL(dist.all_reduce, reg("x")),
                CALL(torch.add, reg("x"), 1.0, store_to=reg("x")), CALL(torch.cos, reg("x"), store_to=reg("x"))])
    program = REPEAT(3, flowvm.optimize(step, options={"fuse-torch": {"form": "compiled", "background": False}}))
    fused = _fused(program)
    assert len(fused) == 2  # the runs before and after the collective
    assert not any(c.fn is dist.all_reduce for f in fused for c in f.calls)
    program.run()
    x = torch.ones(3)
    for _ in range(3):
        x = torch.cos(torch.sin(x * 2.0) + 1.0)
    assert torch.allclose(reg["x"], x)
