"""A program holding its model and optimizer in registers (as a user's own file often does), for
tests/distributed/test_replicas.py: trained on each rank's shard, wrapped in DistributedDataParallel or not
(``--set wrap=True``); a module-level ``PER_RANK`` may be appended to a copy of this file."""

from __future__ import annotations

import torch

import flowvm
from flowvm import CALL, REPEAT, SEQ, Batches, Registers

_WRAPPED: dict = {}  # id(model) -> its DDP wrapper: made on first use, never saved (it holds the group)


def _forward(net, wrap):
    if wrap and flowvm.world_size() > 1:
        if id(net) not in _WRAPPED:
            _WRAPPED[id(net)] = torch.nn.parallel.DistributedDataParallel(net)
        return _WRAPPED[id(net)]
    return net


def loss_of(net, batch, wrap):
    x, y = batch
    return torch.nn.functional.mse_loss(_forward(net, wrap)(x).squeeze(1), y)


def step(net, opt, batch, wrap):
    x, y = batch
    forward = _forward(net, wrap)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(forward(x).squeeze(1), y)
    loss.backward()
    opt.step()
    return loss.item()


def build(epochs: int = 2, wrap: bool = False, momentum: float = 0.0, split: bool = False):
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x @ torch.arange(1.0, 5.0)
    data = Batches((x, y), batch_size=8, seed=0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reg = Registers(net=net, opt=torch.optim.SGD(net.parameters(), lr=0.05, momentum=momentum), loss=None)
    if split:  # the training step as CALLs: a copy between the loss and its backward needs its autograd graph
        opt = reg["opt"]
        return REPEAT(epochs * len(data), SEQ([
            CALL(data.next_batch, store_to=reg("batch")), CALL(opt.zero_grad),
            CALL(loss_of, reg("net"), reg("batch"), wrap, store_to=reg("loss")),
            CALL(torch.Tensor.backward, reg("loss")), CALL(opt.step)]))
    return REPEAT(epochs * len(data), SEQ([
        CALL(data.next_batch, store_to=reg("batch")),
        CALL(step, reg("net"), reg("opt"), reg("batch"), wrap, store_to=reg("loss")),
    ]))


def model(registers):
    return registers["net"]


def report(registers) -> str:
    return "weights " + " ".join(float(v).hex() for p in registers["net"].parameters() for v in p.flatten().tolist())
