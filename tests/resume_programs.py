"""Programs whose copies are resumed in other processes (the child imports them by name from this folder).

``numpy_walk`` draws from numpy's global generator and Python's ``random`` only and never imports torch;
``digits_mlp`` trains a small MLP on scikit-learn's digits with torch's global generator shuffling.
"""

from __future__ import annotations

import random

import numpy as np

from flowvm import CALL, REPEAT, SEQ, Registers


def step_walk(position: int, history: list) -> int:
    """One step of a walk driven by numpy's and Python's global generators."""
    move = int(np.random.randint(-5, 6)) + (1 if random.random() < 0.5 else -1)
    history.append(move)
    return position + move


def summary(history: list) -> dict:
    return {"sum": int(np.sum(history)), "squares": float(np.mean(np.square(history))), "n": len(history)}


def numpy_walk(steps: int = 1000):
    """A numpy-only program: the copy must carry numpy's and random's global states to resume exactly."""
    np.random.seed(0)
    random.seed(0)
    reg = Registers(position=0, history=[])
    return SEQ([
        REPEAT(steps, CALL(step_walk, reg("position"), reg("history"), store_to=reg("position"))),
        CALL(summary, reg("history"), store_to=reg("summary")),
    ])


class DigitsTrainer:
    """A 64-64-10 MLP trained with Adam on random minibatches of scikit-learn's digits (large enough that
    torch splits its matmuls over threads: one thread and two give different last digits)."""

    def __init__(self, batch_size: int = 128, hidden: int = 64):
        import torch
        from sklearn.datasets import load_digits

        digits = load_digits()
        self.x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
        self.y = torch.tensor(digits.target)
        self.batch_size = batch_size
        self.model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.Tanh(),
                                         torch.nn.Linear(hidden, 10))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def train_step(self) -> float:
        import torch

        idx = torch.randint(0, len(self.x), (self.batch_size,))  # torch's global generator
        loss = torch.nn.functional.cross_entropy(self.model(self.x[idx]), self.y[idx])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def full_loss(self) -> float:
        import torch

        with torch.no_grad():
            return torch.nn.functional.cross_entropy(self.model(self.x), self.y).item()


def digits_mlp(steps: int = 100):
    import torch

    torch.manual_seed(0)
    trainer = DigitsTrainer()
    reg = Registers()
    return SEQ([
        REPEAT(steps, CALL(trainer.train_step, store_to=reg("loss"))),
        CALL(trainer.full_loss, store_to=reg("full_loss")),
    ])
