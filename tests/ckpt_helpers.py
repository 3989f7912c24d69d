"""Importable helpers for tests/test_checkpoint.py.

Programs whose checkpoints are resumed in a subprocess must call functions
that the subprocess can import by name; they live here (the subprocess gets
this directory and the repository root on PYTHONPATH).
"""

from __future__ import annotations

import pickle
import random
import sys
from pathlib import Path

import numpy as np
import torch

P = 1_000_003


# ------------------------------------------------------------ program functions
def add(a, b):
    return (a + b) % P


def inc(a):
    return (a + 1) % P


def mix(a, b, k=3):
    return (a * k + b + 1) % P


def mod3(a):
    return a % 3


def below(counter, limit):
    """WHILE condition: counts up to limit, then returns 0 (stop)."""
    return counter + 1 if counter + 1 <= limit else 0


def record(log, value):
    log.append(value)
    return value


def append(log, *values):
    """Append a tuple of values to log (in place) and return the log."""
    log.append(values)
    return log


def total(xs):
    return sum(int(x) if not isinstance(x, tuple) else len(x) for x in xs) % P


def draw_globals():
    """Draw from the global random, numpy.random and torch generators (inside a function body)."""
    return random.random(), np.random.rand(2), torch.randn(2)


def draw_global_random():
    return random.random()


def draw_global_numpy(n):
    return np.random.rand(n)


def call(fn, *args):
    return fn(*args)


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def post_draws():
    """A few draws from every global generator: equal only if the generators are in the same state."""
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
