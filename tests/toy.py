"""The tests' shared helpers: deterministic toy functions for generated and hand-written programs, functions
that draw from the global random generators, a booby trap for "never unpickled", and the entry point a
subprocess runs to resume checkpoints.  Everything is importable by name (the tests put this folder on
sys.path, and subprocesses on PYTHONPATH), so programs using them pickle by reference.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

import flowvm
from flowvm import PENDING, Element
from flowvm.testing import outcome

TESTS = Path(__file__).resolve().parent  # the tests folder: helpers, fixtures, child scripts
REPO = TESTS.parent

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




# ------------------------------------------------------------------ the flowvm command, as a subprocess
ROOT = REPO
FLOWVM = shutil.which("flowvm", path=os.path.dirname(sys.executable))

COMMAND = [FLOWVM] if FLOWVM else [sys.executable, "-m", "flowvm"]


def flowvm_cmd(*args, cwd=None, env=None, check=True, timeout=120) -> subprocess.CompletedProcess:
    done = subprocess.run(COMMAND + [str(a) for a in args], capture_output=True, text=True, cwd=cwd or ROOT,
                          env=env, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"flowvm {' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr}")
    return done


def saved(path) -> dict:
    drv = flowvm.load(path, restore_random=False)
    assert drv.done
    return outcome(drv)


# ------------------------------------------------------------------ leaf kinds of the tests' own
class Countdown(Element):
    """Polls `polls` times (PENDING) before finishing with the number of times it was started."""

    kind = "COUNTDOWN"
    is_leaf = True

    def __init__(self, polls, log):
        self._init(polls=polls, log=log)

    def bind(self, drv, frame):
        def leaf():
            state = drv.live.get(id(frame))
            if state is None:  # first poll of this activation, or after loading: start again
                state = drv.live[id(frame)] = [self.polls]
                self.log.append("start")
            if state[0] > 0:
                state[0] -= 1
                return PENDING
            del drv.live[id(frame)]
            return self.log.count("start")
        return leaf

    def abandon(self, drv, frame):
        drv.live.pop(id(frame), None)
        self.log.append("abandoned")


class Scaled(flowvm.Element):
    """Another leaf kind with its own register and a child, rebuilt from its constructor form."""

    kind = "SCALED"
    is_leaf = True

    def __init__(self, body, factor, store_to):
        self._init(body=body, factor=factor, store_to=store_to)

    @property
    def children(self):
        return (self.body,)

    def with_children(self, children):
        return Scaled(children[0], self.factor, self.store_to)

    def own_writes(self):
        return [self.store_to]

    def __flowvm_source__(self):
        return Scaled, (self.body, self.factor), {"store_to": self.store_to}


class Opaque(flowvm.Element):
    kind = "OPAQUE"
    is_leaf = True

    def __init__(self, target):
        self._init(target=target)

    def own_writes(self):
        return [self.target]


class Pick(flowvm.Element):
    """A kind whose constructor takes a list of elements: they are renamed too."""

    kind = "PICK"
    is_leaf = True

    def __init__(self, options, store_to):
        self._init(options=tuple(options), store_to=store_to)

    @property
    def children(self):
        return self.options

    def with_children(self, children):
        return Pick(children, self.store_to)

    def own_writes(self):
        return [self.store_to]

    def __flowvm_source__(self):
        return Pick, (list(self.options),), {"store_to": self.store_to}


if __name__ == "__main__":  # pragma: no cover
    resume_main(sys.argv[1:])
