"""Builders for flowvm.testing.check_resume's tests (module level: a fresh process imports them by name)."""

from __future__ import annotations

import random

import numpy as np

from flowvm import CALL, REPEAT, SEQ, Registers


def add(total, u):
    return total + u


def good():
    """numpy's and random's global generators, seeded here: every copy carries their states."""
    np.random.seed(0)
    random.seed(0)
    reg = Registers(total=0.0, noise=0.0)
    return REPEAT(6, SEQ([CALL(np.random.rand, store_to=reg("u")),
                          CALL(add, reg("total"), reg("u"), store_to=reg("total")),
                          CALL(random.random, store_to=reg("v")),
                          CALL(add, reg("noise"), reg("v"), store_to=reg("noise"))]))


_PRIVATE = random.Random()  # a generator of the module's own: no copy carries it


def private_draw(total):
    return total + _PRIVATE.random()


def leaky():
    """Deterministic in one process (build() seeds the private generator), not resumable: a fresh process
    imports this module again and the private generator starts elsewhere."""
    _PRIVATE.seed(0)
    reg = Registers(total=0.0)
    return REPEAT(6, CALL(private_draw, reg("total"), store_to=reg("total")))


def train():
    """A training step as separate CALLs: a copy between the forward CALL and its backward is refused."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    reg = Registers(x=torch.randn(8, 3), y=torch.randn(8, 1), net=net, loss=None)
    return REPEAT(3, SEQ([CALL(opt.zero_grad),
                          CALL(forward, reg("net"), reg("x"), reg("y"), store_to=reg("loss")),
                          CALL(backward, reg("loss")),
                          CALL(opt.step)]))


def forward(net, x, y):
    import torch

    return torch.nn.functional.mse_loss(net(x), y)


def backward(loss):
    loss.backward()


def private_draw_unseeded():
    reg = Registers(total=0.0)
    return REPEAT(3, CALL(private_draw, reg("total"), store_to=reg("total")))
