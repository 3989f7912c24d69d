"""The driver's fast paths: tight loops for the common shapes of programs, which skip settling but
leave exactly the frames settling would (tests/machine/test_driver.py and the property tests compare them).

- ``repeat_leaf``: a simple leaf repeated by its REPEAT parent, up to (not including) its last iteration.
- ``repeat_seq``: a SEQ of simple leaves repeated by a REPEAT (``run()`` only).
- ``repeat_woven``: either shape inside WEAVEs (``run()`` only), counting each step of the WEAVEs' turns.

``repeat_seq`` and ``repeat_woven`` inside several WEAVEs share one loop (``_loop``); ``repeat_woven`` inside
one WEAVE has its own (``_one_weave_loop``), which counts the WEAVE's credits in a local copy, and
``repeat_leaf`` its own, the tightest.

The driver's ``step()`` has a one-step form of ``repeat_leaf`` inline, and ``_after_leaf`` moves to a simple
next sibling in a SEQ directly.  Both loops stop at the step limit and, with a deadline, after the step
that ends past it; a leaf that raises leaves the frames written back as the general path would, so that
the next step retries it.
"""

from __future__ import annotations

from time import monotonic

from .leafcode import leaf_function
from .frames import (ELEMENT, REPEAT_I, REPEAT_LAST, REPEAT_N, SEQ_POS, WEAVE_ACTIVE, WEAVE_CREDITS, WEAVE_FINISHED,
                     pass_turn, repeat_counted, repeat_seq_counted, rotate_weaves, seq_finished, seq_restarted,
                     seq_moved, set_credits, turn_passed_in_repeat, turn_used)


# False: the driver takes none of these paths (nor the move to a next sibling); for the tests that compare
# them with the general path, and for profiling
ENABLED = True

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
        if i > start:
            repeat_counted(drv, parent, i, value)
        drv.steps += i - start
        if i > start:
            drv._fresh = None

def repeat_seq(drv, fs: tuple, limit, deadline: float | None = None) -> int:
    """Run a SEQ of plain leaves repeated by a REPEAT in a tight loop, up to (not including) the last
    leaf of the last iteration; return the steps taken.  The frames are written back as the general
    path would leave them, also when a leaf raises (the next step retries it)."""
    rep, seq = fs
    leaves = [leaf_function(c, drv.registers) for c in seq[ELEMENT].elements]
    return _loop(drv, None, rep, seq, leaves, seq[SEQ_POS], limit - drv.steps, deadline)[0]


def repeat_woven(drv, woven: tuple, limit, deadline: float | None = None) -> int:
    """``repeat_leaf`` and ``repeat_seq`` inside WEAVEs: after each leaf the WEAVEs around it count the step
    of their active child's turn and pick the next child when it is used up (``frames.end_turn``,
    ``frames.turn_used``), as settling would.  The loop goes on while each WEAVE picks its active child
    again, and stops when a turn passes to another child, after settling the driver into it (or at the step
    limit, the deadline, or one step before the REPEAT's last iteration).  Returns the steps taken."""
    weaves, rep, seq = woven
    if seq is None:
        leaves, pos = [drv._leaf], 0
    else:
        leaves, pos = [leaf_function(c, drv.registers) for c in seq[ELEMENT].elements], seq[SEQ_POS]
    if len(weaves) == 1:
        ran, passed = _one_weave_loop(drv, weaves[0], rep, seq, leaves, pos, limit - drv.steps, deadline)
    else:
        ran, passed = _loop(drv, weaves, rep, seq, leaves, pos, limit - drv.steps, deadline)
    if passed:  # settle into the child whose turn it is, as the step that ended the turn would
        drv._fresh = None
        drv.settle_after_turn()
    return ran


def _loop(drv, weaves: list | None, rep: list, seq: list | None, leaves: list, pos: int, budget, deadline):
    """The loop of repeat_seq and repeat_woven: the leaves (a SEQ's, or the REPEAT's one leaf) from pos on,
    iteration after iteration of the REPEAT, inside no WEAVE (weaves None) or several.  Returns (steps taken,
    whether a WEAVE's turn passed to another child: the frames are then settled before that turn)."""
    regs, last = drv.registers, len(leaves) - 1
    i, n, value = rep[REPEAT_I], rep[REPEAT_N], rep[REPEAT_LAST]
    counter = rep[ELEMENT].counter
    name = None if counter is None else counter.name
    ran, passed, timed = 0, False, deadline is not None
    try:
        while ran < budget and (pos != last or i != n - 1):
            if timed and ran and monotonic() >= deadline:
                break
            v = leaves[pos]()
            ran += 1
            if pos == last:  # the leaf, or the SEQ, finished an iteration of the REPEAT
                i += 1
                value = v
                if name is not None:
                    regs[name] = i
                pos = 0
            else:
                pos += 1
            if weaves is None:
                continue
            if turn_used(weaves) and _turn_of_several(drv, weaves, rep, seq, i, value, pos):
                passed = True
                break
    finally:
        if ran and not passed:
            _commit(drv, rep, seq, leaves, i, value, pos)
        drv.steps += ran
    return ran, passed


def _one_weave_loop(drv, weave: list, rep: list, seq: list | None, leaves: list, pos: int, budget, deadline):
    """_loop inside exactly one WEAVE (a training loop woven with a logger, say): the WEAVE's credits are
    counted in a local copy, its next child picked as ``frames.weave_pick`` picks it, and the credits
    committed (``set_credits``) when the loop ends or the turn passes.  The pick is written out: through a
    function, a step of a woven nest of tight loops took a fifth longer (bench_shapes)."""
    regs, last = drv.registers, len(leaves) - 1
    i, n, value = rep[REPEAT_I], rep[REPEAT_N], rep[REPEAT_LAST]
    counter = rep[ELEMENT].counter
    name = None if counter is None else counter.name
    credits, active, finished = list(weave[WEAVE_CREDITS]), weave[WEAVE_ACTIVE], weave[WEAVE_FINISHED]
    weights, width = weave[ELEMENT].weights, len(finished)
    ran, j, timed = 0, active, deadline is not None
    try:
        while ran < budget and (pos != last or i != n - 1):
            if timed and ran and monotonic() >= deadline:
                break
            v = leaves[pos]()
            ran += 1
            if pos == last:  # the leaf, or the SEQ, finished an iteration of the REPEAT
                i += 1
                value = v
                if name is not None:
                    regs[name] = i
                pos = 0
            else:
                pos += 1
            c = credits[active] - 1
            credits[active] = c
            if c >= 1:
                continue
            j = active + 1  # the turn is used up: the next child, as frames.weave_pick picks it
            while True:
                if j == width:
                    j = 0
                if not finished[j]:
                    c = credits[j] + (weights[j] if weights is not None else 1)
                    credits[j] = c
                    if c >= 1:
                        break
                j += 1
            if j != active:
                break
    finally:  # the credits, and the turn if it passed (one function of frames.py: it may pass at every step)
        if j != active:
            turn_passed_in_repeat(drv, weave, credits, j, rep, i, value, seq, pos)
        else:
            set_credits(weave, credits)
            if ran:
                _commit(drv, rep, seq, leaves, i, value, pos)
        drv.steps += ran
    return ran, j != active


def _turn_of_several(drv, weaves: list, rep: list, seq: list | None, i: int, value, pos: int) -> bool:
    """Several WEAVEs around, a turn used up: the frames as settling leaves them before the turn, then the
    turn.  Whether it passed to another child."""
    repeat_counted(drv, rep, i, value)
    _settled_before_turn(drv._stack, seq, pos)
    if rotate_weaves(drv, weaves):
        return True
    _turn_kept(drv._stack, seq, pos)
    return False


def _commit(drv, rep: list, seq: list | None, leaves: list, i: int, value, pos: int) -> None:
    """The frames as the general path leaves them after the loop's last step (the turn still the child's)."""
    if seq is not None:
        repeat_seq_counted(drv._stack, rep, seq, i, value, pos)
        drv._leaf = leaves[pos]
        drv._fresh = len(drv._stack) - 2 if pos == 0 else None  # a SEQ just begun again counts as entered afresh
    else:
        repeat_counted(drv, rep, i, value)
        drv._fresh = None


def _turn_kept(stack: list, seq: list | None, pos: int) -> None:
    """Every WEAVE picked its active child again: a SEQ that finished enters its first child again."""
    if seq is not None and not pos:
        seq_restarted(stack, seq)


def _settled_before_turn(stack: list, seq: list | None, pos: int) -> None:
    """The frames as settling leaves them after a leaf, before a WEAVE's turn passes."""
    if seq is None:
        return
    if pos:
        seq_moved(stack, seq, pos)
    else:  # the SEQ finished: the REPEAT holds it again, not yet started
        seq_finished(stack, seq)
