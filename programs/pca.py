"""Principal component analysis over a stream of samples.

The classic flowvm example: gather a batch of samples with BUFFER, fold it
into running moments, and recompute the principal components after each
batch.  By default the data come from a seeded Gaussian stream whose
covariance has a known spectrum, so the result can be checked against
numpy's SVD; ``data=`` (``--data`` on the command line) takes the user's own:
an array, a tensor, a Dataset or a .npy/.npz/.csv file, read in batches of
``samples`` rows, one pass.  ``model(registers)`` gives the fit with
scikit-learn's names (``mean_``, ``components_``, ``explained_variance_``,
``explained_variance_ratio_``, ``transform(X)``).

    flowvm run pca --set batches=20 --set components=4
    flowvm run pca --data points.csv --set components=2 --output pca.npz
"""

from __future__ import annotations

import numpy as np

from flowvm import BUFFER, CALL, REPEAT, SEQ, Registers, load_data
from flowvm.programs import Rows, plural

SHOW = ["batch", "explained"]


class GaussianStream:
    """Samples from N(mean, A A^T) one at a time; its position is its generator state (plain data)."""

    def __init__(self, dim: int = 13, seed: int = 123, decay: float = 0.7):
        setup = np.random.default_rng(seed)
        q, _ = np.linalg.qr(setup.standard_normal((dim, dim)))
        self.scales = decay ** np.arange(dim)          # standard deviations along q's columns
        self.basis = q
        self.mean = setup.standard_normal(dim)
        self.rng = np.random.default_rng(seed + 1)

    def next(self) -> np.ndarray:
        z = self.rng.standard_normal(self.basis.shape[0]) * self.scales
        return self.mean + self.basis @ z

    def next_batch(self, n: int) -> np.ndarray:
        return np.stack([self.next() for _ in range(n)])

    def state_dict(self) -> dict:
        """The stream's position: its generator's state (the distribution is rebuilt from the seed)."""
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]


class StreamingPCA:
    """Principal components from running sums; exact for all the data seen so far."""

    def __init__(self, n_components: int = 3):
        self.n_components = n_components
        self.count = 0
        self.total = None
        self.outer = None

    def analyze(self, x: np.ndarray) -> np.ndarray:
        """Fold a batch (rows are samples) in; return the components (rows, unit norm, sign-fixed)."""
        x = np.asarray(x, dtype=np.float64)
        if self.total is None:
            self.total = np.zeros(x.shape[1])
            self.outer = np.zeros((x.shape[1], x.shape[1]))
        self.count += x.shape[0]
        self.total += x.sum(axis=0)
        self.outer += x.T @ x
        return self.components()

    def covariance(self) -> np.ndarray:
        mean = self.total / self.count
        return (self.outer - self.count * np.outer(mean, mean)) / (self.count - 1)

    def components(self) -> np.ndarray:
        values, vectors = np.linalg.eigh(self.covariance())
        order = np.argsort(values)[::-1][: self.n_components]
        comps = vectors[:, order].T
        return comps * np.sign(comps[np.arange(len(comps)), np.abs(comps).argmax(axis=1)])[:, None]

    def model(self) -> "PCAModel":
        """The fit so far, with scikit-learn's attribute names."""
        values, vectors = np.linalg.eigh(self.covariance())
        order = np.argsort(values)[::-1]
        values = np.maximum(values[order], 0.0)
        comps = self.components()
        return PCAModel(self.total / self.count, comps, values[: self.n_components].copy(),
                        values[: self.n_components] / values.sum(), self.count)

    def explained(self) -> list[float]:
        values = np.sort(np.linalg.eigvalsh(self.covariance()))[::-1]
        return [round(float(v), 6) for v in values[: self.n_components] / values.sum()]

    def state_dict(self) -> dict:
        """The running sums (copies; None before the first batch); n_components is a setting."""
        return {"count": self.count, "total": None if self.total is None else self.total.copy(),
                "outer": None if self.outer is None else self.outer.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])
        self.total = None if state["total"] is None else np.array(state["total"], dtype=np.float64)
        self.outer = None if state["outer"] is None else np.array(state["outer"], dtype=np.float64)


class PCAModel:
    """A fitted PCA, as scikit-learn's ``PCA`` names it (whiten=False)."""

    def __init__(self, mean, components, explained_variance, explained_variance_ratio, n_samples):
        self.mean_ = np.asarray(mean, dtype=np.float64)
        self.components_ = np.asarray(components, dtype=np.float64)
        self.explained_variance_ = np.asarray(explained_variance, dtype=np.float64)
        self.explained_variance_ratio_ = np.asarray(explained_variance_ratio, dtype=np.float64)
        self.n_components_ = len(self.components_)
        self.n_samples_ = int(n_samples)

    def transform(self, X) -> np.ndarray:
        """X (rows are samples) in the components' coordinates."""
        return (np.asarray(X, dtype=np.float64) - self.mean_) @ self.components_.T

    def inverse_transform(self, Z) -> np.ndarray:
        return np.asarray(Z, dtype=np.float64) @ self.components_ + self.mean_


def build(samples: int = 1000, batches: int = 5, dim: int = 13, components: int = 3, seed: int = 123,
          data=None, drop=None):
    """PCA of batches x samples points of a dim-dimensional Gaussian stream, or of data (then samples is
    the batch size, and batches and dim come from the data)."""
    if data is not None:
        return _build_on(load_data(data, name="pca data", drop=drop), samples, components)
    if not 1 <= components <= dim:
        raise ValueError(f"pca: components must be between 1 and dim={dim}, got {components}")
    if samples < 1 or batches < 1 or samples * batches < 2:
        raise ValueError(f"pca: needs at least 2 samples in all (samples={samples}, batches={batches})")
    reg = Registers()
    dataset = GaussianStream(dim, seed)
    pca = StreamingPCA(components)
    return SEQ([
        REPEAT(batches, SEQ([
            BUFFER(samples, CALL(dataset.next), store_to=reg("x")),
            CALL(pca.analyze, reg("x"), store_to=reg("components")),
            CALL(pca.explained, store_to=reg("explained")),
        ]), counter=reg("batch")),
        CALL(pca.components, store_to=reg("components")),
        CALL(pca.model, store_to=reg("model")),
    ])


def _build_on(data, samples: int, components: int):
    n, dim = data.x.shape
    if not 1 <= components <= dim:
        raise ValueError(f"pca: components must be between 1 and the data's {dim} columns, got {components}")
    if n < 2:
        raise ValueError(f"pca: {data.source} has {n} sample; PCA needs at least 2")
    if samples < 1:
        raise ValueError(f"pca: samples (the batch size) must be >= 1, got {samples}")
    reg = Registers()
    rows = Rows(data.x, samples)
    pca = StreamingPCA(components)
    return SEQ([
        REPEAT(rows.batches, SEQ([
            CALL(rows.next, store_to=reg("x")),
            CALL(pca.analyze, reg("x"), store_to=reg("components")),
            CALL(pca.explained, store_to=reg("explained")),
        ]), counter=reg("batch")),
        CALL(pca.components, store_to=reg("components")),
        CALL(pca.model, store_to=reg("model")),
    ])


def model(registers) -> PCAModel:
    """The fitted PCA of a finished run."""
    return registers["model"]


def report(registers) -> str:
    comps = registers["components"]
    lines = [f"{plural(len(comps), 'principal component')} of {registers['x'].shape[1]}-dimensional data "
             f"({plural(registers['batch'], 'batch')} of {plural(registers['x'].shape[0], 'sample')})",
             f"explained variance ratio: {registers['explained']}"]
    lines += [f"  pc{i + 1}: " + " ".join(f"{v:+.3f}" for v in c) for i, c in enumerate(comps)]
    return "\n".join(lines)
