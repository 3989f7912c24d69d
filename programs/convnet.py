"""A small convolutional classifier (conv-relu-pool, conv-relu, linear) trained with Adam or SGD on images.

The default data are scikit-learn's handwritten digits, 1797 grey 8x8 images of
the digits 0-9 (they ship with scikit-learn: nothing is downloaded), a seeded
quarter of them held out for the accuracy.  Training is a REPEAT over epochs
of minibatch updates drawn from a resumable ``flowvm.Batches`` source, one
CALL per update, so any step boundary is a safe place to stop, save and
resume; the held-out accuracy is measured after every epoch.  With the
defaults it reaches about 98% held-out accuracy in a few seconds, as good as
or better than a logistic regression on the same pixels.

With ``flowvm run convnet --nproc N`` (or any launch of torch.distributed) it trains data-parallel: every
rank builds the same network, ``Batches`` gives each rank its share of every epoch, and the updates go
through DistributedDataParallel, which averages the ranks' gradients (see docs/distributed.md).

``data=`` (``--data``) takes the user's own labelled images: an ``(x, y)`` pair
or an .npz with ``x`` and ``y``, ``x`` of shape N x H x W (one channel) or
N x C x H x W, or rows of H*H values (a square one-channel image each, as a
.csv gives them); labels are the classes 0..C-1.  ``model(registers)`` gives the
trained network, a ``torch.nn.Module`` with ``predict(X)`` and ``predict_proba(X)``.

    flowvm run convnet --set epochs=5 --set optimizer=sgd
    flowvm run convnet --nproc 2 --checkpoint run/
    flowvm run convnet --data images.npz --output convnet.pt
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from flowvm import CALL, REPEAT, SEQ, Batches, DataError, Registers, load_data
from flowvm.base.dataset import Data
from flowvm.programs import _training, batch_options, check_options

SHOW = ["epoch", "loss", "accuracy"]
THREADS = 1  # a small network's step runs fastest on one torch thread; build() declares it


class ConvNet(torch.nn.Module):
    """conv 3x3 (``channels``) - ReLU - max-pool 2 - conv 3x3 (2 x ``channels``) - ReLU - linear to the classes'
    logits, on images of ``shape`` (C, H, W).  ``predict(X)`` and ``predict_proba(X)`` take numpy arrays or
    tensors of images (N x C x H x W, N x H x W or N flat rows) and return numpy arrays."""

    def __init__(self, shape, channels: int, classes: int):
        super().__init__()
        self.shape = tuple(int(n) for n in shape)
        self.channels, self.classes = int(channels), int(classes)
        c, h, w = self.shape
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(c, self.channels, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(self.channels, 2 * self.channels, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten())
        self.head = torch.nn.Linear(2 * self.channels * (h // 2) * (w // 2), self.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.reshape(len(x), *self.shape)))

    # the shape and weights under names as scikit-learn's would be (what --output writes beside the state_dict)
    @property
    def shape_(self) -> list[int]:
        return list(self.shape)

    @property
    def channels_(self) -> int:
        return self.channels

    @property
    def n_classes_(self) -> int:
        return self.classes

    def _layers(self) -> list[torch.nn.Module]:
        return [self.features[0], self.features[3], self.head]

    @property
    def coefs_(self) -> list[np.ndarray]:
        """Each layer's weights: the two convolutions' kernels (out x in x 3 x 3), the linear layer's matrix
        (classes x inputs)."""
        return [m.weight.detach().cpu().numpy().copy() for m in self._layers()]

    @property
    def intercepts_(self) -> list[np.ndarray]:
        """Each layer's biases."""
        return [m.bias.detach().cpu().numpy().copy() for m in self._layers()]

    def _inputs(self, X) -> torch.Tensor:
        x = X.detach() if isinstance(X, torch.Tensor) else torch.from_numpy(np.asarray(X))
        if x.ndim < 2 or math.prod(x.shape[1:]) != math.prod(self.shape):
            raise ValueError(f"convnet: the network takes images of shape {self.shape}; got an array of shape "
                             f"{tuple(x.shape)}")
        return x.to(dtype=self.head.weight.dtype)

    @torch.no_grad()
    def predict_proba(self, X) -> np.ndarray:
        """The probability of each class for each image of X (rows sum to 1)."""
        was = self.training
        self.eval()
        try:
            return torch.softmax(self(self._inputs(X)), dim=1).numpy()
        finally:
            self.train(was)

    def predict(self, X) -> np.ndarray:
        """The most probable class (0..C-1) of each image of X."""
        return self.predict_proba(X).argmax(axis=1)


class TrainedConvNet:
    """A trained network's shape and weights, as plain data (what the program keeps in its ``model`` register;
    ``module()`` makes the ``ConvNet`` again)."""

    def __init__(self, network: torch.nn.Module):
        self.shape_ = list(network.shape)
        self.channels_ = network.channels
        self.n_classes_ = network.classes
        self.weights_ = {k: v.detach().cpu().numpy().copy() for k, v in network.state_dict().items()}

    def module(self) -> ConvNet:
        """A ConvNet holding these weights (in eval mode)."""
        network = ConvNet(self.shape_, self.channels_, self.n_classes_)
        network.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in self.weights_.items()})
        return network.eval()


class Trainer(_training.Trainer):
    """The network and its optimizer (see flowvm/programs/_training.py), with one log entry per epoch."""

    def log(self, history: list, epoch: int, loss: float, accuracy: float) -> list:
        """history with one more entry for the epoch just finished."""
        return history + [{"epoch": epoch + 1, "updates": self.updates, "loss": loss, "accuracy": accuracy}]


def digits() -> Data:
    """scikit-learn's digits: 1797 images of 8x8 pixels scaled to [0, 1], labels 0-9."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("convnet: its default data, the digits, ship with scikit-learn: pip install scikit-learn "
                          "(or give your own images as data=)") from None
    d = load_digits()
    return Data((d.images / 16.0).reshape(len(d.images), -1), d.target.astype(np.int64), "digits")


def image_shape(data, width: int) -> tuple[int, int, int]:
    """(C, H, W) of the user's images: from the array's own shape (N x H x W or N x C x H x W), else a square
    one-channel image of the rows' `width` values."""
    shape = None
    if isinstance(data, tuple) and len(data) == 2:
        shape = np.shape(data[0])
    elif isinstance(data, (str, os.PathLike)) and str(data).lower().endswith(".npz"):
        with np.load(data) as z:
            shape = z["x"].shape if "x" in z else None
    if shape is not None and len(shape) in (3, 4):
        return (1, *shape[1:]) if len(shape) == 3 else tuple(shape[1:])
    side = math.isqrt(width)
    if side * side != width:
        raise DataError(f"convnet: rows of {width} values are no square image; give images as an array of shape "
                        "N x H x W or N x C x H x W (an (x, y) pair or an .npz with x and y)")
    return 1, side, side


def images(data, val_fraction: float, seed: int):
    """(training, held out, (C, H, W), classes) of the digits or of the user's data."""
    given = digits() if data is None else load_data(data, supervised=True, name="convnet data")
    shape = (1, 8, 8) if data is None else image_shape(data, given.x.shape[1])
    if min(shape[1:]) < 2:
        raise DataError(f"{given.source}: images of {shape[1]} x {shape[2]} pixels are too small for the "
                        "network's 2 x 2 pooling")
    if given.classes < 2:
        raise DataError(f"{given.source}: every label is 0: a classifier needs at least 2 classes (labels 0..C-1)")
    train, val = given.split(val_fraction, seed)
    return train, val, shape, given.classes


def tensors(data: Data, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """A Data's images (float32, N x C x H x W) and labels (int64)."""
    x = torch.from_numpy(np.asarray(data.x, dtype=np.float32).reshape(len(data.x), *shape))
    return x, torch.from_numpy(np.asarray(data.y, dtype=np.int64))


def build(channels: int = 16, epochs: int = 10, batch_size: int = 32, optimizer: str = "adam",
          lr: float | None = None, val_fraction: float = 0.25, seed: int = 0, data=None, workers: int = 0,
          prefetch: int = 2):
    """Train the network on the digits (or on data) for `epochs` epochs; the accuracy on the held-out fraction
    `val_fraction` (on the training images when it is 0) after each.  `workers` worker processes make the
    minibatches ahead, `prefetch` each (the same batches, in the same order, as 0)."""
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"convnet: optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    check_options("convnet", counts=dict(channels=channels, epochs=epochs, batch_size=batch_size),
                  positive=dict(lr=lr))
    loading = batch_options("convnet", workers, prefetch)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ValueError(f"convnet: val_fraction must be a number in [0, 1), got {val_fraction!r}")
    train, val, shape, classes = images(data, val_fraction, seed)
    x_train, y_train = tensors(train, shape)
    x_test, y_test = (x_train, y_train) if val is None else tensors(val, shape)
    torch.manual_seed(seed)
    network = ConvNet(shape, channels, classes)
    if optimizer == "adam":
        opt = torch.optim.Adam(network.parameters(), lr=0.005 if lr is None else lr)
    else:
        opt = torch.optim.SGD(network.parameters(), lr=0.05 if lr is None else lr, momentum=0.9)
    trainer = Trainer(network, opt)
    batches = Batches((x_train, y_train), batch_size=batch_size, seed=seed, **loading)
    reg = Registers(x_test=x_test, y_test=y_test, accuracy=None, history=[], source=train.source.split(" (")[0],
                    held_out=0 if val is None else len(y_test))
    return SEQ([
        REPEAT(epochs, SEQ([
            REPEAT(len(batches), SEQ([
                CALL(batches.next_batch, store_to=reg("batch")),
                CALL(trainer.train_step, reg("batch"), store_to=reg("loss")),
            ])),
            CALL(trainer.evaluate, reg("x_test"), reg("y_test"), store_to=reg("accuracy")),
            CALL(trainer.log, reg("history"), reg("epoch"), reg("loss"), reg("accuracy"), store_to=reg("history")),
        ]), counter=reg("epoch")),
        CALL(TrainedConvNet, network, store_to=reg("model")),
    ]).with_process_settings({"torch.threads": THREADS})


def model(registers) -> ConvNet:
    """The trained network of a finished run: a ``torch.nn.Module`` (a ``ConvNet``, in eval mode) with
    ``predict(X)`` and ``predict_proba(X)``; each call makes a new one from the weights the run kept."""
    return registers["model"].module()


def report(registers) -> str:
    which = "held-out" if registers.get("held_out", 1) else "training"
    lines = [f"convnet on {registers['source']}: {which} accuracy {registers['accuracy']:.4f} after "
             f"{len(registers['history'])} epochs",
             f"{'epoch':>6} {'updates':>8} {'loss':>10} {'accuracy':>9}"]
    for entry in registers["history"]:
        lines.append(f"{entry['epoch']:>6} {entry['updates']:>8} {entry['loss']:>10.5f} {entry['accuracy']:>9.4f}")
    return "\n".join(lines)
