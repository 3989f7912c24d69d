"""Small data-parallel programs the distributed tests run on two ranks (importable by name: the ranks are new
processes)."""

from __future__ import annotations

import numpy as np
import torch

from flowvm import CALL, REPEAT, SEQ, Batches, Registers


class Linear:
    """A linear regression trained by SGD on sharded batches, its module wrapped in DDP on several ranks."""

    def __init__(self, seed: int = 0, samples: int = 96, batch_size: int = 8):
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((samples, 4)).astype(np.float32)
        y = (x @ np.arange(1, 5, dtype=np.float32) + 0.1 * rng.standard_normal(samples)).astype(np.float32)
        self.batches = Batches((torch.from_numpy(x), torch.from_numpy(y)), batch_size=batch_size, seed=seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.seen: list[int] = []

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_ddp", None)  # holds the process group: made again on first use
        return state

    def ddp(self):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.model
        if "_ddp" not in self.__dict__:
            self._ddp = torch.nn.parallel.DistributedDataParallel(self.model)
        return self._ddp

    def step(self, batch):
        x, y = batch
        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.ddp()(x).squeeze(1), y)
        loss.backward()
        self.opt.step()
        return loss.item()

    def weights(self):
        return [p.detach().clone() for p in self.model.parameters()]


def build(epochs: int = 3, seed: int = 0):
    t = Linear(seed)
    reg = Registers(loss=None)
    return SEQ([
        REPEAT(epochs, REPEAT(len(t.batches), SEQ([
            CALL(t.batches.next_batch, store_to=reg("batch")),
            CALL(t.step, reg("batch"), store_to=reg("loss")),
        ]))),
        CALL(t.weights, store_to=reg("weights")),
    ])
