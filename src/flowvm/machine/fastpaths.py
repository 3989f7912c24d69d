"""The driver's fast paths: tight loops for the common shapes outside WEAVEs, which skip settling but
leave exactly the frames settling would (tests/machine/test_driver.py and the property tests compare them).

- ``repeat_leaf``: a simple leaf repeated by its REPEAT parent, up to (not including) its last iteration.
- ``repeat_seq``: a SEQ of simple leaves repeated by a REPEAT (``run()`` only).

The driver's ``step()`` has a one-step form of ``repeat_leaf`` inline, and ``_after_leaf`` moves to a simple
next sibling in a SEQ directly.  Both loops stop at the step limit and, with a deadline, after the step
that ends past it; a leaf that raises leaves the frames written back as the general path would, so that
the next step retries it.
"""

from __future__ import annotations

from time import monotonic

from .compile import leaf_function
from .frames import REPEAT_I, REPEAT_LAST, REPEAT_N, SEQ_POS


def repeat_leaf(drv, parent: list, limit, deadline: float | None = None) -> None:
    """Run a leaf repeated by a REPEAT frame in a tight loop, up to (not including) its last iteration
    (and, with a deadline, until the step that ends past it)."""
    leaf = drv._leaf
    i = start = parent[REPEAT_I]
    stop = parent[REPEAT_N] - 1
    if limit - drv.steps < stop - i:
        stop = i + int(limit - drv.steps)
    if stop <= i:
        return
    counter = parent[0].counter
    value = parent[REPEAT_LAST]
    regs = drv.registers
    try:
        if deadline is not None:
            name = counter.name if counter is not None else None
            while i < stop:
                value = leaf()
                i += 1
                if name is not None:
                    regs[name] = i
                if monotonic() >= deadline:
                    break
        elif counter is None:
            while i < stop:
                value = leaf()
                i += 1
        else:
            name = counter.name
            while i < stop:
                value = leaf()
                i += 1
                regs[name] = i
    finally:
        parent[REPEAT_I] = i
        parent[REPEAT_LAST] = value
        drv.steps += i - start
        if i > start:
            drv._fresh = None

def repeat_seq(drv, fs: tuple, limit, deadline: float | None = None) -> int:
    """Run a SEQ of plain leaves repeated by a REPEAT in a tight loop, up to (not including) the last
    leaf of the last iteration; return the steps taken.  The frames are written back as the general
    path would leave them, also when a leaf raises (the next step retries it)."""
    rep, seq = fs
    children = seq[0].elements
    regs = drv.registers
    leaves = [leaf_function(c, regs) for c in children]
    last = len(leaves) - 1
    i, n, pos, value = rep[REPEAT_I], rep[REPEAT_N], seq[SEQ_POS], rep[REPEAT_LAST]
    counter = rep[0].counter
    name = counter.name if counter is not None else None
    budget = limit - drv.steps
    ran = 0
    timed = deadline is not None
    try:
        while ran < budget and (pos != last or i != n - 1):
            if timed and ran and monotonic() >= deadline:
                break
            v = leaves[pos]()
            ran += 1
            if pos == last:  # the SEQ finished: its value is the iteration's
                i += 1
                value = v
                if name is not None:
                    regs[name] = i
                pos = 0
            else:
                pos += 1
    finally:
        rep[REPEAT_I], rep[REPEAT_LAST], seq[SEQ_POS] = i, value, pos
        drv.steps += ran
        if ran:
            drv._stack[-1] = [children[pos]]
            drv._leaf = leaves[pos]
            # as settling would leave it: a SEQ just begun again counts as entered afresh
            drv._fresh = len(drv._stack) - 2 if pos == 0 else None
    return ran
