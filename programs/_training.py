"""What the torch classifiers (mlp, convnet) share: a model and its optimizer making one update per call."""

from __future__ import annotations

import torch


class Trainer:
    """A model and its optimizer: one update per call, and the held-out accuracy.  When torch.distributed runs
    more than one rank (``flowvm run mlp --nproc 2``), the updates go through the model wrapped in
    DistributedDataParallel, which averages the ranks' gradients; the wrapper holds the process group, so it
    is a cache: made on first use, never saved (a run saved on some ranks resumes on any number).  Each
    program subclasses it with the log entry it keeps."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self.updates = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_ddp", None)
        return state

    def network(self) -> torch.nn.Module:
        """The model, or its DistributedDataParallel wrapper when more than one rank runs."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.model
        if self.__dict__.get("_ddp") is None:
            self._ddp = torch.nn.parallel.DistributedDataParallel(self.model)
        return self._ddp

    def train_step(self, batch) -> float:
        """One update on an (inputs, labels) batch; returns the batch loss (this rank's)."""
        x, y = batch
        network = self.network()
        network.train()
        self.optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(network(x), y)
        loss.backward()
        self.optimizer.step()
        self.updates += 1
        return loss.item()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The fraction of inputs classified correctly (on every rank alike: no collective)."""
        self.model.eval()
        return (self.model(x).argmax(dim=1) == y).float().mean().item()
