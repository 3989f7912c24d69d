"""A restricted Boltzmann machine trained with CD-1, one CALL per contrastive-divergence update.

By default the data are "bars and stripes": binary images of `side` x `side`
pixels in which every row (or every column) is all on or all off, with a few
pixels flipped.  ``data=`` (``--data`` on the command line) takes the user's
own instead (an array, a tensor, a Dataset or a .npy/.npz/.csv file, every
value in [0, 1]: a Bernoulli RBM's visible units are probabilities); the
number of visible units is the data's width.  After each epoch the program
measures the mean-field reconstruction error on all the data, which falls as
the machine learns.  Minibatches come from a resumable ``flowvm.Batches``
source and the Gibbs samples from the machine's own generator, so a run
stopped between any two updates resumes exactly.  ``model(registers)`` gives
the fit with scikit-learn's ``BernoulliRBM`` names (``components_``,
``intercept_hidden_``, ``intercept_visible_``, ``transform(X)``).

    flowvm run rbm --set hidden=32 --set epochs=30
    flowvm run rbm --data images.npy --set hidden=64 --output rbm.npz
"""

from __future__ import annotations

import numpy as np

from flowvm import CALL, REPEAT, SEQ, Batches, DataError, Registers, load_data
from flowvm.programs import batch_options, check_options

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

    def model(self) -> "RBMModel":
        """The machine as it is now, with scikit-learn's names (copies of its weights and biases)."""
        return RBMModel(self.w.T.copy(), self.c.copy(), self.b.copy())

    def state_dict(self) -> dict:
        """The weights and biases (copies), the generator's state and the update count (lr is a setting)."""
        return {**self.parameters(), "rng": self.rng.bit_generator.state, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.w, self.b, self.c = (np.array(state[k], dtype=np.float64) for k in ("w", "b", "c"))
        self.rng.bit_generator.state = state["rng"]
        self.updates = int(state["updates"])


class RBMModel:
    """A fitted Bernoulli RBM, as scikit-learn's ``BernoulliRBM`` names it: ``components_`` (hidden x visible
    weights), ``intercept_hidden_``, ``intercept_visible_``."""

    def __init__(self, components, intercept_hidden, intercept_visible):
        self.components_ = np.asarray(components, dtype=np.float64)
        self.intercept_hidden_ = np.asarray(intercept_hidden, dtype=np.float64)
        self.intercept_visible_ = np.asarray(intercept_visible, dtype=np.float64)
        self.n_components = len(self.components_)
        self.n_features_in_ = self.components_.shape[1]

    def transform(self, X) -> np.ndarray:
        """The hidden units' probabilities p(h = 1 | v) for each row v of X (the RBM's features)."""
        return sigmoid(np.asarray(X, dtype=np.float64) @ self.components_.T + self.intercept_hidden_)

    def reconstruct(self, X) -> np.ndarray:
        """The mean-field reconstruction of each row of X: v -> p(h | v) -> p(v | h)."""
        return sigmoid(self.transform(X) @ self.components_ + self.intercept_visible_)

    def reconstruction_error(self, X) -> float:
        """Mean squared difference between X and its mean-field reconstruction (what the program reports)."""
        X = np.asarray(X, dtype=np.float64)
        return float(((X - self.reconstruct(X)) ** 2).mean())

    def free_energy(self, X) -> np.ndarray:
        """F(v) = -v.b - sum_j softplus(v.W_j + c_j) of each row v of X."""
        X = np.asarray(X, dtype=np.float64)
        hidden = np.logaddexp(0, X @ self.components_.T + self.intercept_hidden_).sum(axis=1)
        return -X @ self.intercept_visible_ - hidden

    def score_samples(self, X) -> np.ndarray:
        """The pseudo-log-likelihood of each row v of X: sum over the visible units i of log p(v_i | v_-i),
        with v_i flipped to 1 - v_i as scikit-learn's ``score_samples`` does, but over every unit rather than
        one drawn at random (so it is deterministic; scikit-learn's is an unbiased estimate of it)."""
        X = np.asarray(X, dtype=np.float64)
        rows = max(1, (1 << 22) // max(1, self.components_.size))  # a few million floats at a time
        return np.concatenate([self._pseudo_likelihood(X[i:i + rows]) for i in range(0, len(X), rows)] or [[]])

    def _pseudo_likelihood(self, X: np.ndarray) -> np.ndarray:
        act = X @ self.components_.T + self.intercept_hidden_                  # n x hidden
        delta = 1.0 - 2.0 * X                                                   # the change flipping makes
        base = np.logaddexp(0, act).sum(axis=1)                                 # n
        flipped = np.logaddexp(0, act[:, None, :] + delta[:, :, None] * self.components_.T[None, :, :]).sum(axis=2)
        # F(flipped) - F(v), for each unit, and log p(v_i | v_-i) = log sigmoid of it
        gap = -delta * self.intercept_visible_ - flipped + base[:, None]
        return -np.logaddexp(0, -gap).sum(axis=1)


def check_unit_interval(data) -> None:
    """Raise DataError naming the first value outside [0, 1] (a Bernoulli RBM's visible units are
    probabilities)."""
    x = data.x
    bad = (x < 0) | (x > 1)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise DataError(f"{data.source}: row {row + 1}, column {col + 1} holds {float(x[row, col])!r}; a Bernoulli RBM "
                        f"needs every value in [0, 1] (this data runs from {float(x.min())!r} to "
                        f"{float(x.max())!r}: scale it, e.g. divide by its largest value)")


def append(items: list, item) -> list:
    return items + [item]


def build(samples: int = 2000, side: int = 5, hidden: int = 24, epochs: int = 15, batch_size: int = 20,
          lr: float = 0.1, seed: int = 0, data=None, drop=None, workers: int = 0, prefetch: int = 2):
    """CD-1 training of an RBM with `hidden` units on bars and stripes of side x side pixels, or on data (values
    in [0, 1]; then samples and side are not used, and the visible units are the data's columns).  `workers`
    worker processes make the minibatches ahead, `prefetch` each (the same batches, in the same order, as 0)."""
    check_options("rbm", counts=dict(samples=samples, side=side, hidden=hidden, epochs=epochs,
                                     batch_size=batch_size), positive=dict(lr=lr))
    loading = batch_options("rbm", workers, prefetch)
    if data is not None:
        given = load_data(data, name="rbm data", drop=drop)
        check_unit_interval(given)
        x = given.x
    else:
        x = bars_and_stripes(samples, side, seed=seed)
    machine = RBM(x.shape[1], hidden, lr, seed + 1)
    data = Batches(x, batch_size=batch_size, seed=seed, **loading)
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
        CALL(machine.model, store_to=reg("model")),
    ])


def model(registers) -> RBMModel:
    """The fitted RBM of a finished run."""
    return registers["model"]


def report(registers) -> str:
    errors = registers["errors"]
    visible, hidden = registers["parameters"]["w"].shape
    return "\n".join([
        f"RBM ({visible} visible, {hidden} hidden units) after {registers['epoch']} epochs of CD-1",
        f"reconstruction error: {errors[0]:.4f} before training, {errors[-1]:.4f} after",
        "by epoch: " + " ".join(f"{e:.4f}" for e in errors),
    ])
