"""Random programs that use every element kind, for property tests.

The generator draws its choices through a small interface so that the same
code serves hypothesis (``draw``) and a seeded ``random.Random`` (for batches
that cross into a subprocess).  Every generated program terminates: LOOPs
appear only as WEAVE children that the WEAVE can abandon, WHILE conditions
count up to a small limit, and counts are small.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from flowvm import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Registers

import toy
from flowvm.program.analysis import can_step

DATA = ("r0", "r1", "r2", "r3")


class RandomChooser:
    def __init__(self, seed):
        self.rng = random.Random(seed)

    def int(self, lo, hi):
        return self.rng.randint(lo, hi)

    def choice(self, options):
        return options[self.rng.randrange(len(options))]


class DrawChooser:
    def __init__(self, draw):
        self.draw = draw

    def int(self, lo, hi):
        return self.draw(st.integers(lo, hi))

    def choice(self, options):
        return options[self.draw(st.integers(0, len(options) - 1))]


class ProgramGenerator:
    def __init__(self, chooser):
        self.c = chooser
        self.reg = Registers(r0=1, r1=2, r2=3, r3=5, n0=2, n1=0, log=[])
        self.uid = 0

    def fresh(self, prefix, initial=None):
        self.uid += 1
        name = f"{prefix}{self.uid}"
        if initial is not None:
            self.reg[name] = initial
        return self.reg(name)

    def data(self):
        return self.reg(self.c.choice(DATA))

    def count(self):
        return self.c.choice([0, 1, 2, 3, self.reg("n0"), self.reg("n1")])

    def leaf(self):
        c, r = self.c, self.reg
        kind = c.int(0, 5)
        if kind == 0:
            return CALL(toy.add, self.data(), self.data(), store_to=self.data())
        if kind == 1:
            return CALL(toy.mix, self.data(), c.int(0, 9), k=c.int(1, 5), store_to=self.data())
        if kind == 2:
            return CALL(toy.inc, self.data(), store_to=self.data())
        if kind == 3:
            return CALL(toy.pair, self.data(), [self.data(), {"k": self.data()}])
        if kind == 4:
            return PRINT("value", self.data())
        return CALL(toy.record, r("log"), self.data())

    def finite(self, depth, force=False):
        """An element that always finishes."""
        c = self.c
        if depth <= 0 or (not force and c.int(0, 3) == 0):
            return self.leaf()
        kind = c.int(0, 5)
        sub = lambda first=False: self.finite(depth - 1, force=force and first)  # noqa: E731
        if kind == 0:
            n = c.int(1 if force else 0, 3)
            return SEQ([sub(i == 0) for i in range(n)])
        if kind == 1:
            counter = self.fresh("c") if c.int(0, 1) else None
            return REPEAT(c.int(1, 3) if force else self.count(), sub(True), counter=counter)
        if kind == 2:
            w = self.fresh("w", 0)
            body = sub(True)
            if not can_step(body):
                body = SEQ([self.leaf(), body])
            return WHILE(CALL(toy.below, w, c.int(0 if not force else 1, 2), store_to=w), body)
        if kind == 3:
            if c.int(0, 1):
                selector = CALL(toy.mod3, self.data())
                cases = {0: sub(True), 1: sub(True), 2: sub(True)}
                return SWITCH(selector, cases)
            return SWITCH(self.data(), {0: sub(True), 1: sub(True)}, default=sub(True))
        if kind == 4:
            return self.weave(depth, force)
        store = self.fresh("b") if c.int(0, 1) else None
        return BUFFER(c.int(1, 3) if force else self.count(), sub(True), store_to=store)

    def weave(self, depth, force=False):
        c = self.c
        n = c.int(1, 3)
        children, finite = [], 0
        for i in range(n):
            if i > 0 and c.int(0, 3) == 0:
                children.append(LOOP(SEQ([self.leaf(), self.finite(depth - 2)])))
            else:
                children.append(self.finite(depth - 1, force=force and i == 0))
                finite += 1
        if finite == n and c.int(0, 1):
            n_required = -1
        else:
            n_required = c.int(1 if force else 0, finite)
        weights = None
        if c.int(0, 2) == 0:
            weights = [c.choice([1, 2, 3, 0.5]) for _ in range(n)]
        return WEAVE(n_required, children, weights)

    def program(self, depth=4):
        return SEQ([self.leaf(), self.finite(depth, force=True), self.finite(depth - 1)])


@st.composite
def programs(draw, depth=4):
    """A hypothesis strategy of programs (with their register file) nested at least depth deep."""
    return ProgramGenerator(DrawChooser(draw)).program(depth)


def random_program(seed, depth=4):
    return ProgramGenerator(RandomChooser(seed)).program(depth)


def nesting(el):
    return 1 + max((nesting(c) for c in el.children), default=0)
