"""A small data-parallel program the distributed tests run on two ranks: a regression trained by SGD on
sharded batches, its module wrapped in DDP on several ranks, with a fault it can be told to cause on one rank
at one update (on the first start of the group only).  Run as a target of the flowvm command (a .py file)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import torch

import flowvm
from flowvm import CALL, REPEAT, SEQ, Batches, Registers


class Linear:
    """The model, its optimizer and its batches; ``log`` (a folder): each rank appends the sample ids of
    every batch it trains on to ``rank-R.txt`` there."""

    def __init__(self, seed: int, samples: int, batch_size: int, fault: str | None, at: int, log: str | None,
                 who: int = 1):
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((samples, 4)).astype(np.float32)
        y = (x @ np.arange(1, 5, dtype=np.float32) + 0.1 * rng.standard_normal(samples)).astype(np.float32)
        ids = torch.arange(samples)
        self.batches = Batches((torch.from_numpy(x), torch.from_numpy(y), ids), batch_size=batch_size, seed=seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.updates = 0
        self.fault, self.at, self.log, self.who = fault, at, log, who

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_ddp", None)  # holds the process group: made again on first use
        return state

    def ddp(self):
        if flowvm.world_size() <= 1:
            return self.model
        if "_ddp" not in self.__dict__:
            self._ddp = torch.nn.parallel.DistributedDataParallel(self.model)
        return self._ddp

    def step(self, batch):
        x, y, ids = batch
        if self.log is not None:
            with open(Path(self.log) / f"rank-{flowvm.rank()}.txt", "a") as f:
                f.write(f"{self.batches.epoch if self.batches.position else self.batches.epoch - 1} "
                        f"{' '.join(map(str, ids.tolist()))}\n")
        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.ddp()(x).squeeze(1), y)
        loss.backward()
        self.opt.step()
        self.updates += 1
        return loss.item()

    def maybe_fail(self):
        """The fault asked for, on rank `who` at update `at`, on the group's first start."""
        if self.fault is None or flowvm.rank() != self.who or self.updates != self.at \
                or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return None
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.fault == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.fault == "raise":
            raise ValueError(f"boom at update {self.updates}")
        elif self.fault == "hang":  # never joins the next collective (and ends when the agent stops the group)
            signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
            time.sleep(600)
        return None

    def weights(self):
        return [p.detach().clone() for p in self.model.parameters()]


def build(epochs: int = 3, seed: int = 0, samples: int = 96, batch_size: int = 8, fault=None, at: int = 5,
          log=None, who: int = 1, uneven: int = 0):
    """``uneven``: batches rank 1 takes more per epoch than the others (a program the ranks must refuse)."""
    t = Linear(seed, samples, batch_size, fault, at, log, who)
    reg = Registers(loss=None)
    per_epoch = len(t.batches) + (uneven if flowvm.rank() == 1 else 0)
    return SEQ([
        REPEAT(epochs, REPEAT(per_epoch, SEQ([
            CALL(t.batches.next_batch, store_to=reg("batch")),
            CALL(t.step, reg("batch"), store_to=reg("loss")),
            CALL(t.maybe_fail),
        ]))),
        CALL(t.weights, store_to=reg("weights")),
    ])


def report(registers) -> str:
    """The final weights, exactly (hex floats), for the tests to compare."""
    return "weights " + " ".join(float(v).hex() for w in registers["weights"] for v in w.flatten().tolist())
