"""A training step fused by fuse-torch around a DDP module, for tests/distributed/test_fused_ddp.py: run on
two ranks by flowvm.distributed.launch, it reports each rank's fused state and the final weights."""

from __future__ import annotations

import torch

import flowvm
from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.fused import FUSED


def _fused_in(element) -> list:
    if isinstance(element, FUSED):
        return [element]
    return [f for child in (getattr(element, "children", None) or [getattr(element, "body", None)])
            if child is not None for f in _fused_in(child)]


def _status(fused) -> str:
    runtime = fused.runtime()
    return f"{runtime.state}|{runtime.compiles}|{runtime.refused}"


def build(form: str = "compiled"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ddp = torch.nn.parallel.DistributedDataParallel(model) if flowvm.world_size() > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(flowvm.rank())  # each rank its own data
    reg = Registers(x=torch.randn(16, 4, generator=g), y=torch.randint(0, 3, (16,), generator=g), status=None)
    step = SEQ([CALL(opt.zero_grad), CALL(ddp, reg("x"), store_to=reg("logits")),
                CALL(torch.nn.functional.cross_entropy, reg("logits"), reg("y"), store_to=reg("loss")),
                CALL(torch.Tensor.backward, reg("loss")), CALL(opt.step)])
    step = flowvm.optimize(step, options={"fuse-torch": {"form": form, "background": False}})
    status = [CALL(_status, f, store_to=reg("status")) for f in _fused_in(step)[:1]]
    return SEQ([REPEAT(10, step), *status,
                CALL(lambda: [p.detach().clone() for p in model.parameters()], store_to=reg("weights"))])
