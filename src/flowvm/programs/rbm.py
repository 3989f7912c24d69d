"""A restricted Boltzmann machine trained with CD-1, one CALL per contrastive-divergence update.

The data are "bars and stripes": binary images of `side` x `side` pixels in
which every row (or every column) is all on or all off, with a few pixels
flipped.  After each epoch the program measures the mean-field
reconstruction error on all the data, which falls as the machine learns.
Minibatches come from a resumable ``flowvm.Batches`` source and the
Gibbs samples from the machine's own generator, so a run stopped between
any two updates resumes exactly.

    flowvm run rbm --set hidden=32 --set epochs=30
"""

from __future__ import annotations

import numpy as np

from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.programs import check_options
from flowvm import Batches

SHOW = ["epoch", "batch_error", "error"]


def bars_and_stripes(samples: int = 2000, side: int = 5, flip: float = 0.02, seed: int = 0) -> np.ndarray:
    """samples x side*side binary images (float64 0/1): random bars or stripes, a fraction `flip` of pixels flipped."""
    rng = np.random.default_rng(seed)
    lines = rng.random((samples, side)) < 0.5
    images = np.repeat(lines[:, :, None], side, axis=2)          # rows all on or all off: stripes
    vertical = rng.random(samples) < 0.5
    images[vertical] = images[vertical].transpose(0, 2, 1)       # columns: bars
    images ^= rng.random(images.shape) < flip
    return images.reshape(samples, side * side).astype(np.float64)


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


class RBM:
    """Bernoulli-Bernoulli RBM: weights w (visible x hidden), visible bias b, hidden bias c."""

    def __init__(self, visible: int, hidden: int, lr: float = 0.1, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.w = 0.01 * self.rng.standard_normal((visible, hidden))
        self.b = np.zeros(visible)
        self.c = np.zeros(hidden)
        self.lr = lr
        self.updates = 0

    def hidden_probs(self, v: np.ndarray) -> np.ndarray:
        return sigmoid(v @ self.w + self.c)

    def visible_probs(self, h: np.ndarray) -> np.ndarray:
        return sigmoid(h @ self.w.T + self.b)

    def cd1(self, v0: np.ndarray) -> float:
        """One CD-1 update on a batch; returns the batch's reconstruction error before the update.

        Positive phase on the data, one Gibbs step down with sampled hidden
        units, negative phase on the visible probabilities (Hinton's guide,
        section 3).
        """
        ph0 = self.hidden_probs(v0)
        h0 = (self.rng.random(ph0.shape) < ph0).astype(np.float64)
        pv1 = self.visible_probs(h0)
        ph1 = self.hidden_probs(pv1)
        n = len(v0)
        self.w += self.lr * (v0.T @ ph0 - pv1.T @ ph1) / n
        self.b += self.lr * (v0 - pv1).mean(axis=0)
        self.c += self.lr * (ph0 - ph1).mean(axis=0)
        self.updates += 1
        return float(((v0 - pv1) ** 2).mean())

    def reconstruction_error(self, v: np.ndarray) -> float:
        """Mean squared error of the mean-field reconstruction v -> p(h|v) -> p(v|h)."""
        return float(((v - self.visible_probs(self.hidden_probs(v))) ** 2).mean())

    def parameters(self) -> dict:
        return {"w": self.w.copy(), "b": self.b.copy(), "c": self.c.copy()}

    def state_dict(self) -> dict:
        """The weights and biases (copies), the generator's state and the update count (lr is a setting)."""
        return {**self.parameters(), "rng": self.rng.bit_generator.state, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.w, self.b, self.c = (np.array(state[k], dtype=np.float64) for k in ("w", "b", "c"))
        self.rng.bit_generator.state = state["rng"]
        self.updates = int(state["updates"])


def append(items: list, item) -> list:
    return items + [item]


def build(samples: int = 2000, side: int = 5, hidden: int = 24, epochs: int = 15, batch_size: int = 20,
          lr: float = 0.1, seed: int = 0):
    """CD-1 training of an RBM with `hidden` units on bars and stripes of side x side pixels."""
    check_options("rbm", counts=dict(samples=samples, side=side, hidden=hidden, epochs=epochs,
                                     batch_size=batch_size), positive=dict(lr=lr))
    x = bars_and_stripes(samples, side, seed=seed)
    machine = RBM(side * side, hidden, lr, seed + 1)
    data = Batches(x, batch_size=batch_size, seed=seed)
    reg = Registers(x=x, errors=[])
    return SEQ([
        CALL(machine.reconstruction_error, reg("x"), store_to=reg("error")),
        CALL(append, reg("errors"), reg("error"), store_to=reg("errors")),
        REPEAT(epochs, SEQ([
            REPEAT(len(data), SEQ([
                CALL(data.next_batch, store_to=reg("v")),
                CALL(machine.cd1, reg("v"), store_to=reg("batch_error")),
            ])),
            CALL(machine.reconstruction_error, reg("x"), store_to=reg("error")),
            CALL(append, reg("errors"), reg("error"), store_to=reg("errors")),
        ]), counter=reg("epoch")),
        CALL(machine.parameters, store_to=reg("parameters")),
    ])


def report(registers) -> str:
    errors = registers["errors"]
    return "\n".join([
        f"RBM ({registers['parameters']['w'].shape[1]} hidden units) after {registers['epoch']} epochs of CD-1",
        f"reconstruction error: {errors[0]:.4f} before training, {errors[-1]:.4f} after",
        "by epoch: " + " ".join(f"{e:.4f}" for e in errors),
    ])
