"""The tests' shared helpers: deterministic toy functions for generated and hand-written programs, functions
that draw from the global random generators, a booby trap for "never unpickled", and the entry point a
subprocess runs to resume checkpoints.  Everything is importable by name (the tests put this folder on
sys.path, and subprocesses on PYTHONPATH), so programs using them pickle by reference.
"""

from __future__ import annotations

import pickle
import random
import sys
from pathlib import Path

import numpy as np

P = 1_000_003


def const(v):
    return v


def add(a, b):
    return (a + b) % P


def mix(a, b, k=3):
    return (a * k + b + 1) % P


def inc(a):
    return (a + 1) % P


def pair(a, b):
    return [a, b]


def total(xs):
    """A number from a list of ints and tuples (a tuple counts its length), or from one value."""
    if not isinstance(xs, list):
        return int(xs)
    return sum(int(x) if not isinstance(x, tuple) else len(x) for x in xs) % P


def below(counter, limit):
    """WHILE condition: counts up to limit, then returns 0 (stop) which also resets the counter."""
    return counter + 1 if counter + 1 <= limit else 0


def mod3(a):
    return a % 3


def record(log, value):
    log.append(value)
    return value


def append(log, *values):
    """Append a tuple of values to log (in place) and return the log."""
    log.append(values)
    return log


def draw_globals():
    """Draw from the global random, numpy.random and torch generators (inside a function body)."""
    import torch

    return random.random(), np.random.rand(2), torch.randn(2)


def draw_global_random():
    return random.random()


def draw_global_numpy(n):
    return np.random.rand(n)


def call(fn, *args):
    return fn(*args)


def seed_all(seed):
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def post_draws():
    """A few draws from every global generator: equal only if the generators are in the same state."""
    import torch

    return random.random(), np.random.rand(3), torch.rand(3)


# --------------------------------------------------- booby trap for "never unpickled"
def touch(path):
    Path(path).write_text("unpickled\n")
    return "trapped"


class Trap:
    """Unpickling this object creates the file at path."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (touch, (self.path,))


# ----------------------------------------------------------- subprocess entry
def resume_main(argv):
    """argv: checkpoint files..., output file.  Load each, finish it, pickle what it produced."""
    import flowvm

    *paths, out = argv
    results = {}
    for path in paths:
        drv = flowvm.load(path)
        loaded = {"steps": drv.steps, "done": drv.done}
        drv.run()
        results[Path(path).name] = {
            "loaded": loaded,
            "result": drv.result,
            "steps": drv.steps,
            "done": drv.done,
            "registers": dict(drv.registers),
            "after": post_draws(),
        }
    with open(out, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":  # pragma: no cover
    resume_main(sys.argv[1:])
