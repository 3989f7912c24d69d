"""An MLP classifier trained with Adam or SGD, with evaluation and logging woven in.

Training is a REPEAT over epochs of minibatch updates drawn from a resumable
``flowvm.Batches`` source.  A WEAVE runs it side by side with two LOOPs,
one evaluating on held-out data and one appending to the log, at relative
rates set by the WEAVE's weights; it ends when training does.  Every update
(forward, backward, optimizer step) is one CALL, so any step boundary is a
safe place to stop, save and resume.

The default data are three interleaved spirals (3000 points, a third held
out).  With the defaults, both ``optimizer='adam'`` and ``optimizer='sgd'``
reach at least 95% held-out accuracy in a few seconds.  ``data=`` (``--data``
on the command line) takes the user's own labelled data instead: an ``(x, y)``
pair, a Dataset of ``(x, y)`` items, an .npz with ``x`` and ``y``, or a .csv
whose label column ``label`` names (by default the last); labels are the
classes 0..C-1.  The input width and the number of classes come from the data,
and a seeded ``val_fraction`` of it (0.2 unless given) is held out for the
accuracy.  ``model(registers)`` gives the trained network, a
``torch.nn.Module`` with ``predict(X)`` (class indices) and
``predict_proba(X)`` (class probabilities).

    flowvm run mlp --set optimizer=sgd --set epochs=10
    flowvm run mlp --data iris.csv --set label=species --set val_fraction=0.25 --output mlp.pt
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from flowvm import CALL, LOOP, REPEAT, SEQ, WEAVE, Batches, DataError, Registers, load_data
from flowvm.base.dataset import Data
from flowvm.programs import _training, batch_options, check_options

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


class Classifier(torch.nn.Sequential):
    """The MLP: Linear layers of the given sizes (inputs, hidden..., classes) with ReLUs between them; its output
    is the classes' logits.  ``predict(X)`` and ``predict_proba(X)`` take numpy arrays or tensors (one row per
    sample) and return numpy arrays, as scikit-learn's classifiers do."""

    def __init__(self, sizes):
        sizes = [int(n) for n in sizes]
        parts: list[torch.nn.Module] = []
        for a, b in zip(sizes[:-2], sizes[1:-1]):
            parts += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        super().__init__(*parts, torch.nn.Linear(sizes[-2], sizes[-1]))
        self.sizes = sizes

    def _inputs(self, X) -> torch.Tensor:
        x = X.detach() if isinstance(X, torch.Tensor) else torch.from_numpy(np.asarray(X))
        x = x.to(dtype=self[0].weight.dtype)
        if x.ndim != 2 or x.shape[1] != self.sizes[0]:
            raise ValueError(f"mlp: the network takes rows of {self.sizes[0]} values; got an array of shape "
                             f"{tuple(x.shape)}")
        return x

    # the fitted network's sizes and weights as scikit-learn's MLPClassifier names them (what --output writes)
    @property
    def layer_sizes_(self) -> list[int]:
        return list(self.sizes)

    @property
    def coefs_(self) -> list[np.ndarray]:
        """Layer i's weight matrix (inputs x outputs), for each layer."""
        return [m.weight.detach().cpu().numpy().T.copy() for m in self if isinstance(m, torch.nn.Linear)]

    @property
    def intercepts_(self) -> list[np.ndarray]:
        """Layer i's biases, for each layer."""
        return [m.bias.detach().cpu().numpy().copy() for m in self if isinstance(m, torch.nn.Linear)]

    @property
    def n_features_in_(self) -> int:
        return self.sizes[0]

    @property
    def n_classes_(self) -> int:
        return self.sizes[-1]

    @torch.no_grad()
    def predict_proba(self, X) -> np.ndarray:
        """The probability of each class for each row of X (rows sum to 1)."""
        was = self.training
        self.eval()
        try:
            return torch.softmax(self(self._inputs(X)), dim=1).numpy()
        finally:
            self.train(was)

    @torch.no_grad()
    def predict(self, X) -> np.ndarray:
        """The most probable class (0..C-1) of each row of X."""
        was = self.training
        self.eval()
        try:
            return self(self._inputs(X)).argmax(dim=1).numpy()
        finally:
            self.train(was)


def make_model(inputs: int, hidden: int, layers: int, classes: int) -> Classifier:
    return Classifier([inputs] + [hidden] * layers + [classes])


class TrainedMLP:
    """A trained network's sizes and weights, as plain data (what the program keeps in its ``model`` register;
    ``module()`` makes the ``Classifier`` again).  Names as scikit-learn's ``MLPClassifier``: ``coefs_[i]``
    is layer i's weight matrix (inputs x outputs), ``intercepts_[i]`` its biases."""

    def __init__(self, network: Classifier, classes: list | None = None):
        linear = [m for m in network if isinstance(m, torch.nn.Linear)]
        self.layer_sizes_ = list(network.sizes)
        self.coefs_ = [m.weight.detach().numpy().T.copy() for m in linear]
        self.intercepts_ = [m.bias.detach().numpy().copy() for m in linear]
        self.n_features_in_ = self.layer_sizes_[0]
        self.n_classes_ = self.layer_sizes_[-1]
        if classes is not None:  # the labels were text: class i is classes_[i]
            self.classes_ = np.asarray(classes)

    def module(self) -> Classifier:
        """A Classifier holding these weights (in eval mode)."""
        network = Classifier(self.layer_sizes_)
        with torch.no_grad():
            for m, w, b in zip([m for m in network if isinstance(m, torch.nn.Linear)], self.coefs_, self.intercepts_):
                m.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
                m.bias.copy_(torch.from_numpy(b))
        if "classes_" in vars(self):
            network.classes_ = self.classes_
        return network.eval()


class Trainer(_training.Trainer):
    """The model and its optimizer (see flowvm/programs/_training.py), with one log entry per evaluation."""

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


def tensors(data: Data) -> tuple[torch.Tensor, torch.Tensor]:
    """A Data's samples and labels as the network takes them (float32, int64)."""
    return (torch.from_numpy(np.asarray(data.x, dtype=np.float32)),
            torch.from_numpy(np.asarray(data.y, dtype=np.int64)))


def labelled(data, label, val_fraction: float | None, seed: int, drop=None):
    """(training, held out or None, classes, where the data came from) from the user's data (class names, when
    the labels are text, in ``classes_`` of both parts)."""
    if label is not None and not (isinstance(data, (str, os.PathLike)) and str(data).lower().endswith(".csv")):
        raise ValueError(f"mlp: label= names the label column of a .csv file; the data given is "
                         f"{type(data).__name__} {str(data)!r:.60} (give an (x, y) pair, or an .npz with x and y)")
    given = load_data(data, supervised=True, label=label, name="mlp data", drop=drop)
    if given.classes < 2:
        raise DataError(f"{given.source}: every label is 0: a classifier needs at least 2 classes (labels 0..C-1)")
    train, val = given.split(0.2 if val_fraction is None else val_fraction, seed)
    return train, val, given.classes, given.source


def training_data(samples: int, seed: int, data, label, val_fraction, drop):
    """(training part, held-out part or None, classes, source name): of data, else of the spirals."""
    if val_fraction is not None and (isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float))
                                     or not 0 <= val_fraction < 1):
        raise ValueError(f"mlp: val_fraction must be a number in [0, 1), got {val_fraction!r}")
    if data is not None:
        return labelled(data, label, val_fraction, seed, drop)
    if label is not None:
        raise ValueError("mlp: label= names the label column of a .csv file given as data=")
    x, y = spirals(samples, seed=seed)
    if val_fraction is None:  # the spirals' first third is held out
        held_out = samples // 3
        return Data(x[held_out:], y[held_out:], "spirals"), Data(x[:held_out], y[:held_out], "spirals"), 3, "spirals"
    train, val = Data(x.numpy(), y.numpy(), "spirals").split(val_fraction, seed)
    return train, val, 3, "spirals"


def build(samples: int = 3000, hidden: int = 64, layers: int = 2, epochs: int = 20, batch_size: int = 64,
          optimizer: str = "adam", lr: float | None = None, eval_every: int = 50, log_every: int = 25,
          seed: int = 0, data=None, label=None, val_fraction=None, drop=None, workers: int = 0, prefetch: int = 2):
    """Train an MLP on spirals, or on data (then samples is not used); evaluate every `eval_every` and log every
    `log_every` updates on the held-out fraction `val_fraction` (on the training data when it is 0).  `workers`
    worker processes make the minibatches ahead, `prefetch` each (the same batches, in the same order, as 0)."""
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"mlp: optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    check_options("mlp", counts=dict(samples=samples, hidden=hidden, layers=layers, epochs=epochs,
                                     batch_size=batch_size, eval_every=eval_every, log_every=log_every),
                  positive=dict(lr=lr))
    loading = batch_options("mlp", workers, prefetch)
    train, val, classes, source = training_data(samples, seed, data, label, val_fraction, drop)
    names = train.classes_  # the classes' names when the labels were text
    x_train, y_train = (train.x, train.y) if isinstance(train.x, torch.Tensor) else tensors(train)
    if val is None:  # nothing held out: the accuracy is on the training data
        x_test, y_test = x_train, y_train
    else:
        x_test, y_test = (val.x, val.y) if isinstance(val.x, torch.Tensor) else tensors(val)
    torch.manual_seed(seed)
    model = make_model(x_train.shape[1], hidden, layers, classes)
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=0.01 if lr is None else lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1 if lr is None else lr, momentum=0.9)
    trainer = Trainer(model, opt)
    batches = Batches((x_train, y_train), batch_size=batch_size, seed=seed, **loading)
    reg = Registers(x_test=x_test, y_test=y_test, accuracy=None, history=[], source=source,
                    held_out=0 if val is None else len(y_test))
    train = REPEAT(epochs, REPEAT(len(batches), SEQ([
        CALL(batches.next_batch, store_to=reg("batch")),
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
        CALL(TrainedMLP if names is None else functools.partial(TrainedMLP, classes=names.tolist()), model,
             store_to=reg("model")),
    ]).with_process_settings({"torch.threads": THREADS})


def model(registers) -> Classifier:
    """The trained network of a finished run: a ``torch.nn.Module`` (a ``Classifier``, in eval mode) with
    ``predict(X)`` and ``predict_proba(X)``; each call makes a new one from the weights the run kept."""
    return registers["model"].module()


def report(registers) -> str:
    history = registers["history"]
    source = registers.get("source", "spirals")
    which = "held-out" if registers.get("held_out", 1) else "training"
    target = f" (target {TARGET_ACCURACY})" if source == "spirals" else ""
    lines = [f"MLP on {source}: {which} accuracy {registers['accuracy']:.4f} after {registers['epoch']} epochs"
             f"{target}",
             f"{'update':>8} {'epoch':>6} {'loss':>10} {'accuracy':>9}"]
    for entry in history:
        acc = "" if entry["accuracy"] is None else f"{entry['accuracy']:.4f}"
        lines.append(f"{entry['update']:>8} {entry['epoch']:>6} {entry['loss']:>10.5f} {acc:>9}")
    return "\n".join(lines)
