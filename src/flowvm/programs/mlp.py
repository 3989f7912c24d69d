"""An MLP classifier trained with Adam or SGD, with evaluation and logging woven in.

Training is a REPEAT over epochs of minibatch updates drawn from a resumable
``flowvm.Batches`` source.  A WEAVE runs it side by side with two LOOPs,
one evaluating on held-out data and one appending to the log, at relative
rates set by the WEAVE's weights; it ends when training does.  Every update
(forward, backward, optimizer step) is one CALL, so any step boundary is a
safe place to stop, save and resume.

The default data are three interleaved spirals (3000 points, a third held
out).  With the defaults, both ``optimizer='adam'`` and ``optimizer='sgd'``
reach at least 95% held-out accuracy in a few seconds.

    flowvm run mlp --set optimizer=sgd --set epochs=10
"""

from __future__ import annotations

import numpy as np
import torch

from flowvm import CALL, LOOP, REPEAT, SEQ, WEAVE, Registers
from flowvm.programs import check_options
from flowvm import Batches

SHOW = ["epoch", "loss", "accuracy"]
THREADS = 1  # this small model runs far faster on one torch thread than on several; build() declares it
TARGET_ACCURACY = 0.95


def spirals(samples: int = 3000, classes: int = 3, noise: float = 0.2, seed: int = 0):
    """(points, labels): `classes` spiral arms in the plane, each winding about one turn."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(classes, size=samples)
    radius = rng.uniform(0.1, 1.0, size=samples)
    angle = labels * 2 * np.pi / classes + 6.0 * radius + noise * rng.standard_normal(samples)
    points = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    return torch.from_numpy(points.astype(np.float32)), torch.from_numpy(labels)


def make_model(inputs: int, hidden: int, layers: int, classes: int) -> torch.nn.Sequential:
    sizes = [inputs] + [hidden] * layers
    parts: list[torch.nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        parts += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*parts, torch.nn.Linear(sizes[-1], classes))


class Trainer:
    """A model and its optimizer: one fused update per call, evaluation and a log entry."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self.updates = 0

    def train_step(self, batch) -> float:
        """One update on a (inputs, labels) batch; returns the batch loss."""
        x, y = batch
        self.model.train()
        self.optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.updates += 1
        return loss.item()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The fraction of points classified correctly."""
        self.model.eval()
        return (self.model(x).argmax(dim=1) == y).float().mean().item()

    def log(self, history: list, epoch: int, loss: float, accuracy: float | None) -> list:
        """history with one more entry for the current update."""
        return history + [{"update": self.updates, "epoch": epoch, "loss": loss, "accuracy": accuracy}]

    def state_dict(self) -> dict:
        """The model's and the optimizer's state dicts and the update count."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def build(samples: int = 3000, hidden: int = 64, layers: int = 2, epochs: int = 20, batch_size: int = 64,
          optimizer: str = "adam", lr: float | None = None, eval_every: int = 50, log_every: int = 25,
          seed: int = 0):
    """Train an MLP on spirals; evaluate every `eval_every` and log every `log_every` updates."""
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"mlp: optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    check_options("mlp", counts=dict(samples=samples, hidden=hidden, layers=layers, epochs=epochs,
                                     batch_size=batch_size, eval_every=eval_every, log_every=log_every),
                  positive=dict(lr=lr))
    x, y = spirals(samples, seed=seed)
    held_out = samples // 3
    torch.manual_seed(seed)
    model = make_model(2, hidden, layers, 3)
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=0.01 if lr is None else lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1 if lr is None else lr, momentum=0.9)
    trainer = Trainer(model, opt)
    data = Batches((x[held_out:], y[held_out:]), batch_size=batch_size, seed=seed)
    reg = Registers(x_test=x[:held_out], y_test=y[:held_out], accuracy=None, history=[])
    train = REPEAT(epochs, REPEAT(len(data), SEQ([
        CALL(data.next_batch, store_to=reg("batch")),
        CALL(trainer.train_step, reg("batch"), store_to=reg("loss")),
    ])), counter=reg("epoch"))
    evaluate = CALL(trainer.evaluate, reg("x_test"), reg("y_test"), store_to=reg("accuracy"))
    log = CALL(trainer.log, reg("history"), reg("epoch"), reg("loss"), reg("accuracy"), store_to=reg("history"))
    return SEQ([
        # an update is two training steps, so these weights give one evaluation every eval_every updates
        WEAVE(1, [train, LOOP(evaluate), LOOP(log)], weights=[1, 1 / (2 * eval_every), 1 / (2 * log_every)]),
        evaluate,
        log,
        CALL(weights, model, store_to=reg("weights")),
    ]).with_process_settings({"torch.threads": THREADS})


def report(registers) -> str:
    history = registers["history"]
    lines = [f"MLP on spirals: held-out accuracy {registers['accuracy']:.4f} after {registers['epoch']} epochs "
             f"(target {TARGET_ACCURACY})",
             f"{'update':>8} {'epoch':>6} {'loss':>10} {'accuracy':>9}"]
    for entry in history:
        acc = "" if entry["accuracy"] is None else f"{entry['accuracy']:.4f}"
        lines.append(f"{entry['update']:>8} {entry['epoch']:>6} {entry['loss']:>10.5f} {acc:>9}")
    return "\n".join(lines)
