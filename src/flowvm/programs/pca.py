"""Principal component analysis over a stream of samples.

The classic flowvm example: gather a batch of samples with BUFFER, fold it
into running moments, and recompute the principal components after each
batch.  The data come from a seeded Gaussian stream whose covariance has a
known spectrum, so the result can be checked against numpy's SVD.

    flowvm run pca --set batches=20 --set components=4
"""

from __future__ import annotations

import numpy as np

from flowvm import BUFFER, CALL, REPEAT, SEQ, Registers

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

    def explained(self) -> list[float]:
        values = np.sort(np.linalg.eigvalsh(self.covariance()))[::-1]
        return [round(float(v), 6) for v in values[: self.n_components] / values.sum()]


def build(samples: int = 1000, batches: int = 5, dim: int = 13, components: int = 3, seed: int = 123):
    """PCA of batches x samples points of a dim-dimensional Gaussian stream."""
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
    ])


def report(registers) -> str:
    comps = registers["components"]
    lines = [f"{len(comps)} principal components of {registers['x'].shape[1]}-dimensional data "
             f"({registers['batch']} batches of {registers['x'].shape[0]} samples)",
             f"explained variance ratio: {registers['explained']}"]
    lines += [f"  pc{i + 1}: " + " ".join(f"{v:+.3f}" for v in c) for i, c in enumerate(comps)]
    return "\n".join(lines)
