"""k-means clustering (Lloyd's algorithm) with k-means++ starts, keeping the best of several restarts.

Each Lloyd iteration is two steps, an assignment and an update, inside a
WHILE that stops when no center moves by more than ``tol`` (or after
``max_iter`` iterations); a REPEAT runs ``restarts`` of them and keeps the
one with the lowest inertia.  By default the data are Gaussian blobs around
known centers, generated from a seed; ``data=`` (``--data`` on the command
line) takes the user's own (an array, a tensor, a Dataset or a .npy/.npz/.csv
file).  ``model(registers)`` gives the fit with scikit-learn's names
(``cluster_centers_``, ``labels_``, ``inertia_``, ``n_iter_``, ``predict(X)``).

    flowvm run kmeans --set clusters=5 --set restarts=4
    flowvm run kmeans --data points.csv --set clusters=8 --output kmeans.npz
"""

from __future__ import annotations

import numpy as np

from flowvm import CALL, REPEAT, SEQ, WHILE, DataError, Registers, load_data
from flowvm.programs import check_options

SHOW = ["restart", "inertia"]


def make_blobs(samples: int = 5000, clusters: int = 6, dim: int = 2, spread: float = 1.0, seed: int = 0):
    """(points, true centers): samples points around `clusters` random centers in [-8, 8]^dim."""
    rng = np.random.default_rng(seed)
    centers = rng.uniform(-8.0, 8.0, size=(clusters, dim))
    which = rng.integers(clusters, size=samples)
    return centers[which] + spread * rng.standard_normal((samples, dim)), centers


def assign(x: np.ndarray, centers: np.ndarray) -> np.ndarray:
    """The index of the nearest center of each point."""
    d2 = ((x[:, None, :] - centers[None, :, :]) ** 2).sum(axis=2)
    return d2.argmin(axis=1)


def inertia(x: np.ndarray, centers: np.ndarray, labels: np.ndarray) -> float:
    """The sum of squared distances of the points to their centers."""
    return float(((x - centers[labels]) ** 2).sum())


class Lloyd:
    """The state of one k-means run: a generator for the starts, the iteration count and the last shift."""

    def __init__(self, clusters: int, tol: float = 1e-6, max_iter: int = 100, seed: int = 0):
        if clusters < 1:
            raise ValueError(f"kmeans: clusters must be >= 1, got {clusters}")
        self.clusters = clusters
        self.tol = tol
        self.max_iter = max_iter
        self.rng = np.random.default_rng(seed)
        self.iteration = 0
        self.shift = float("inf")

    def init_centers(self, x: np.ndarray) -> np.ndarray:
        """k-means++ starting centers (distinct data points, spread out); resets the iteration count."""
        if len(x) < self.clusters:
            raise ValueError(f"kmeans: {self.clusters} clusters but only {len(x)} points")
        self.iteration, self.shift = 0, float("inf")
        chosen = [int(self.rng.integers(len(x)))]
        d2 = ((x - x[chosen[0]]) ** 2).sum(axis=1)
        for _ in range(1, self.clusters):
            nxt = int(self.rng.choice(len(x), p=d2 / d2.sum()))
            chosen.append(nxt)
            d2 = np.minimum(d2, ((x - x[nxt]) ** 2).sum(axis=1))
        return x[chosen].copy()

    def running(self) -> bool:
        """Another iteration is due: the centers still moved and the iteration budget is not spent."""
        return self.shift > self.tol and self.iteration < self.max_iter

    def update(self, x: np.ndarray, labels: np.ndarray, centers: np.ndarray) -> np.ndarray:
        """Each center moves to the mean of its points (an empty cluster keeps its center)."""
        counts = np.bincount(labels, minlength=len(centers))
        sums = np.zeros_like(centers)
        np.add.at(sums, labels, x)
        new = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], centers)
        self.shift = float(np.sqrt(((new - centers) ** 2).sum(axis=1)).max())
        self.iteration += 1
        return new

    def keep_best(self, best: dict | None, centers: np.ndarray, labels: np.ndarray, score: float) -> dict:
        """The better (lower inertia) of the best run so far and this one."""
        if best is not None and best["inertia"] <= score:
            return best
        return {"centers": centers, "labels": labels, "inertia": score, "iterations": self.iteration}

    def state_dict(self) -> dict:
        """The generator's state, the iteration count and the last shift (clusters, tol and max_iter are
        settings)."""
        return {"rng": self.rng.bit_generator.state, "iteration": self.iteration, "shift": self.shift}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.iteration, self.shift = int(state["iteration"]), float(state["shift"])


class KMeansModel:
    """A fitted k-means, as scikit-learn's ``KMeans`` names it."""

    def __init__(self, best: dict):
        self.cluster_centers_ = np.asarray(best["centers"], dtype=np.float64)
        self.labels_ = np.asarray(best["labels"])
        self.inertia_ = float(best["inertia"])
        self.n_iter_ = int(best["iterations"])
        self.n_clusters = len(self.cluster_centers_)

    def predict(self, X) -> np.ndarray:
        """The index of the nearest center of each row of X."""
        return assign(np.asarray(X, dtype=np.float64), self.cluster_centers_)

    def transform(self, X) -> np.ndarray:
        """Distances of each row of X to each center."""
        X = np.asarray(X, dtype=np.float64)
        return np.sqrt(((X[:, None, :] - self.cluster_centers_[None, :, :]) ** 2).sum(axis=2))


def build(samples: int = 5000, clusters: int = 6, dim: int = 2, spread: float = 1.0, restarts: int = 3,
          tol: float = 1e-6, max_iter: int = 100, seed: int = 0, data=None, drop=None):
    """k-means with `restarts` k-means++ starts on `samples` points in `clusters` Gaussian blobs, or on data
    (then samples, dim and spread are not used)."""
    check_options("kmeans", counts=dict(samples=samples, clusters=clusters, dim=dim, restarts=restarts,
                                        max_iter=max_iter), positive=dict(spread=spread))
    if data is not None:
        given = load_data(data, name="kmeans data", drop=drop)
        x, true_centers = np.asarray(given.x, dtype=np.float64), None
        distinct = len(np.unique(x, axis=0))
        if distinct < clusters:
            raise DataError(f"{given.source}: {clusters} clusters need at least {clusters} distinct points; "
                            f"the data has {distinct}")
    else:
        if samples < clusters:
            raise ValueError(f"kmeans: {clusters} clusters need at least as many samples, got samples={samples}")
        x, true_centers = make_blobs(samples, clusters, dim, spread, seed)
    reg = Registers(x=x, true_centers=true_centers, best=None)
    run = Lloyd(clusters, tol, max_iter, seed + 1)
    return SEQ([REPEAT(restarts, SEQ([
        CALL(run.init_centers, reg("x"), store_to=reg("centers")),
        WHILE(CALL(run.running), SEQ([
            CALL(assign, reg("x"), reg("centers"), store_to=reg("labels")),
            CALL(run.update, reg("x"), reg("labels"), reg("centers"), store_to=reg("centers")),
        ])),
        CALL(assign, reg("x"), reg("centers"), store_to=reg("labels")),
        CALL(inertia, reg("x"), reg("centers"), reg("labels"), store_to=reg("inertia")),
        CALL(run.keep_best, reg("best"), reg("centers"), reg("labels"), reg("inertia"), store_to=reg("best")),
    ]), counter=reg("restart")), CALL(KMeansModel, reg("best"), store_to=reg("model"))])


def model(registers) -> KMeansModel:
    """The fitted k-means of a finished run: the best of its restarts."""
    return registers["model"]


def report(registers) -> str:
    best, truth = registers["best"], registers["true_centers"]
    found = best["centers"]
    lines = [f"k-means: {len(found)} clusters of {len(registers['x'])} points, best of {registers['restart']} "
             f"restarts: inertia {best['inertia']:.4f} after {best['iterations']} iterations"]
    if truth is not None:  # the built-in blobs: how near the found centers are to the true ones
        miss = np.sqrt(((truth[:, None, :] - found[None, :, :]) ** 2).sum(axis=2)).min(axis=1)
        lines.append(f"largest distance from a true center to its nearest found center: {miss.max():.4f}")
    lines += [f"  center {i}: " + " ".join(f"{v:+.3f}" for v in c) for i, c in enumerate(found)]
    return "\n".join(lines)
