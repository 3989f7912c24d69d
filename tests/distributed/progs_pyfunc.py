"""A data-parallel regression whose training loop is plain Python under @flowvm.program: each rank trains on
its shard of the Batches, the gradients averaged by DistributedDataParallel, made on first use and kept out
of the registers (it holds the process group).  Run as a target of the flowvm command (a .py file)."""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.nn.functional as F

import flowvm
from flowvm import Batches

_REPLICATED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def replicated(model):
    """The model wrapped in DDP when more than one rank runs (made once a process, never saved)."""
    if flowvm.world_size() <= 1:
        return model
    if model not in _REPLICATED:
        _REPLICATED[model] = torch.nn.parallel.DistributedDataParallel(model)
    return _REPLICATED[model]


@flowvm.program
def fit(batches, model, opt, epochs):
    losses = []
    for epoch in range(epochs):
        for x, y in batches:
            opt.zero_grad()
            loss = F.mse_loss(replicated(model)(x).squeeze(1), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    flowvm.rank0(print)("weights", " ".join(float(v).hex() for p in model.parameters() for v in p.flatten()))
    return losses


def build(epochs: int = 3, samples: int = 96, seed: int = 0):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, 4)).astype(np.float32)
    y = (x @ np.arange(1, 5, dtype=np.float32)).astype(np.float32)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = Batches((torch.from_numpy(x), torch.from_numpy(y)), batch_size=8, seed=seed)
    return fit(batches, model, opt, epochs)
