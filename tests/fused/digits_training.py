"""The training program that the real-compile tests of test_stateful.py and test_guards.py run in a fresh
python process (they import it from there): a network trained with SGD on scikit-learn's digits, fused and
compiled at once, next to an untouched copy of it for torch's own eager loop."""

from __future__ import annotations

import copy

import torch
from sklearn.datasets import load_digits

from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.passes.fuse_torch import fuse_torch

F = torch.nn.functional


def program(net):
    """(x, y, ref, opt, ref_opt, reg, done, fast): the data, the copy, both optimizers, the registers, a list
    growing by one at each of opt's steps, and the fused program training net without end."""
    digits = load_digits()
    x = torch.tensor(digits.data[:128], dtype=torch.float32) / 16
    y = torch.tensor(digits.target[:128])
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    reg = Registers(x=x, y=y)
    done: list = []
    opt.register_step_post_hook(lambda *a: done.append(1))
    body = SEQ([CALL(opt.zero_grad), CALL(net, reg("x"), store_to=reg("logits")),
                CALL(F.cross_entropy, reg("logits"), reg("y"), store_to=reg("loss")),
                CALL(torch.Tensor.backward, reg("loss")), CALL(opt.step)])
    fast = fuse_torch(REPEAT(10**9, body), compile_after=0, payback=0, form="compiled")
    return x, y, ref, opt, ref_opt, reg, done, fast
