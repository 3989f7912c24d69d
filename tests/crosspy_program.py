"""A numpy-only flowvm program and the child side of tests/persist/test_cross_python.py.

The program is saved half-run by one CPython and finished by another, so everything it calls lives in
this importable module (it pickles by reference, never as code objects, whose bytecode is private to
one Python version).  The child process gets this directory on PYTHONPATH and runs
``resume_main``; it imports neither torch nor the flowvm source tree.

What the program draws from, so that a resume in another interpreter has to restore all of it:

- numpy's legacy global generator (``np.random.randn``/``rand``/``permutation``), set from the
  checkpoint's saved states;
- a seeded ``np.random.default_rng`` held by a ``Walker`` object that CALLs use as bound methods,
  carried inside the pickled program;
- python's global ``random`` (``random``, ``gauss``, ``randrange``, ``shuffle``, ``getrandbits``).

Registers hold numpy arrays, numpy integer arrays, floats, ints (one wider than 64 bits), dicts and
lists.  Float results are computed by numpy or by single Python operations: the builtin ``sum()`` of
floats is avoided on purpose, since CPython 3.12 changed it to compensated (Neumaier) summation, so
``sum([0.1] * 10)`` is ``0.9999999999999999`` on 3.11 and ``1.0`` on 3.12 and 3.13; a program that
used it would differ between interpreters even without a checkpoint.
"""

from __future__ import annotations

import pickle
import random
import sys

import numpy as np

from flowvm import CALL, REPEAT, SEQ, Registers


class Walker:
    """A random walk in ``dim`` dimensions whose steps come from its own seeded generator."""

    def __init__(self, dim: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.position = np.zeros(dim)
        self.moves = 0

    def step(self, scale: float) -> np.ndarray:
        """Move by a Gaussian step of the given scale; return the new position."""
        self.position = self.position + scale * self.rng.standard_normal(self.position.shape)
        self.moves += 1
        return self.position.copy()

    def generator_state(self) -> dict:
        """The walker's generator state (plain ints and strings): equal only if it drew the same numbers."""
        return {"moves": self.moves, "bit_generator": self.rng.bit_generator.state}


def sample_points(n: int, dim: int, clusters: int) -> np.ndarray:
    """n points around `clusters` centers, all drawn from numpy's global generator."""
    centers = 4.0 * np.random.randn(clusters, dim)
    which = np.random.randint(clusters, size=n)
    return centers[which] + np.random.randn(n, dim)


def initial_centers(x: np.ndarray, clusters: int) -> np.ndarray:
    """`clusters` distinct points chosen with python's global generator."""
    order = list(range(len(x)))
    random.shuffle(order)
    return x[order[:clusters]].copy()


def jitter(x: np.ndarray, drift: np.ndarray) -> np.ndarray:
    """Shift every point by the walk's drift plus small noise from numpy's global generator; the
    points are visited in a random order (np.random.permutation), which changes nothing but draws."""
    noise = 0.01 * np.random.rand(*x.shape)
    order = np.random.permutation(len(x))
    moved = x + drift + noise
    out = np.empty_like(moved)
    out[order] = moved[order]
    return out


def assign(x: np.ndarray, centers: np.ndarray) -> np.ndarray:
    """The index of the nearest center of each point."""
    return ((x[:, None, :] - centers[None, :, :]) ** 2).sum(axis=2).argmin(axis=1)


def update(x: np.ndarray, labels: np.ndarray, centers: np.ndarray) -> np.ndarray:
    """Each center moves to the mean of its points (an empty cluster keeps its center)."""
    counts = np.bincount(labels, minlength=len(centers))
    sums = np.zeros_like(centers)
    np.add.at(sums, labels, x)
    return np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], centers)


def inertia(x: np.ndarray, centers: np.ndarray, labels: np.ndarray) -> float:
    """The sum of squared distances of the points to their centers, as a Python float."""
    return float(((x - centers[labels]) ** 2).sum())


def record(stats: dict, score: float, round_no: int) -> dict:
    """A new dict of statistics: the history of scores, and draws from python's global generator."""
    picks = stats["picks"] + [random.randrange(1000)]
    return {
        "rounds": round_no + 1,
        "scores": stats["scores"] + [score],
        "best": min(stats["best"], score),
        "noise": stats["noise"] * 0.5 + random.gauss(0.0, 1.0),
        "picks": picks,
        "token": random.getrandbits(96),
        "mean_pick": float(np.mean(picks)),
    }


def build(seed: int = 7, points: int = 120, dim: int = 2, clusters: int = 3, rounds: int = 6):
    """Seeds the global generators, then returns a k-means loop over points that drift along a random walk.

    Steps: 2 before the loop, 6 per round, 1 after it (39 with the defaults).
    """
    random.seed(seed)
    np.random.seed(seed)
    walker = Walker(dim, seed + 1)
    reg = Registers(stats={"rounds": 0, "scores": [], "best": float("inf"), "noise": 0.0, "picks": []})
    return SEQ([
        CALL(sample_points, points, dim, clusters, store_to=reg("x")),
        CALL(initial_centers, reg("x"), clusters, store_to=reg("centers")),
        REPEAT(rounds, SEQ([
            CALL(walker.step, 0.25, store_to=reg("drift")),
            CALL(jitter, reg("x"), reg("drift"), store_to=reg("x")),
            CALL(assign, reg("x"), reg("centers"), store_to=reg("labels")),
            CALL(update, reg("x"), reg("labels"), reg("centers"), store_to=reg("centers")),
            CALL(inertia, reg("x"), reg("centers"), reg("labels"), store_to=reg("inertia")),
            CALL(record, reg("stats"), reg("inertia"), reg("round"), store_to=reg("stats")),
        ]), counter=reg("round")),
        CALL(walker.generator_state, store_to=reg("walker")),
    ])


def build_with_lambda(seed: int = 3):
    """A short run whose CALL is a lambda over a local: cloudpickle cannot name it, so it is written by
    value, as the code object (bytecode) of the Python that saved it."""
    np.random.seed(seed)
    reg = Registers(x=np.zeros(3))
    scale = 0.5
    return REPEAT(4, CALL(lambda v: v * scale + np.random.rand(3), reg("x"), store_to=reg("x")))


def after_draws() -> tuple:
    """Draws from python's and numpy's global generators: equal only if both are in the same state."""
    return random.random(), random.getrandbits(64), np.random.rand(3), np.random.randint(1 << 30, size=2)


def scramble_globals() -> None:
    """Move both global generators to states unrelated to any saved run."""
    random.seed(0x5EED)
    np.random.seed(0x5EED)


# ------------------------------------------------------------------ child entry
def resume_main(argv: list[str]) -> None:
    """argv: output file, then checkpoint files.  Each is loaded (after scrambling the global
    generators, so only the checkpoint's states can put them right) and finished; the output gets
    the interpreter's version, where flowvm and numpy came from, and per file the step count at
    load, the outcome (result, steps, registers) and draws from the global generators afterwards.
    A file named ``*.norandom.ckpt`` is loaded with ``restore_random=False``: the same run without
    the saved global states, which must come out different."""
    import flowvm
    from flowvm.testing import outcome

    out, *paths = argv
    results = {}
    for path in paths:
        scramble_globals()
        drv = flowvm.load(path, restore_random=not path.endswith(".norandom.ckpt"))
        loaded = {"steps": drv.steps, "done": drv.done}
        drv.run()
        results[path] = {"loaded": loaded, "outcome": outcome(drv), "after": after_draws()}
    report = {
        "version_info": tuple(sys.version_info),
        "executable": sys.executable,
        "flowvm_file": flowvm.__file__,
        "numpy": np.__version__,
        "torch_imported": "torch" in sys.modules,
        "results": results,
    }
    with open(out, "wb") as f:
        pickle.dump(report, f, protocol=pickle.HIGHEST_PROTOCOL)


def resume_or_refuse(argv: list[str]) -> None:
    """argv: output file, checkpoint file.  Load and finish it; the output gets the outcome, or the
    CheckpointError's message if flowvm refuses the file (at load or at the first step)."""
    import flowvm
    from flowvm.testing import outcome

    out, path = argv
    try:
        drv = flowvm.load(path)
        drv.run()
        report = {"outcome": outcome(drv)}
    except flowvm.CheckpointError as err:
        report = {"refused": str(err)}
    report["version_info"] = tuple(sys.version_info)
    with open(out, "wb") as f:
        pickle.dump(report, f, protocol=pickle.HIGHEST_PROTOCOL)
