"""Frames, the run state of each active element: their layouts and named slots, the walk over them, WEAVE
turns, and the writes of the fast paths and of hot patches.  frames.py adds the moves through each element
kind (entering, leaving, settling to the next leaf) and re-exports every name of this module: the two are
the only writers of frames, and other modules import from frames.py.

A frame is a list whose item 0 is the element; the rest are that element's counters.  Lists keep a run
plain data (it pickles, copies and compares as such) and cheap to step.  A frame of length 1 is
*unstarted* for a container and *ready* for a leaf.  A driver's ``_stack`` holds the frames of the active
elements, outermost first; a WEAVE frame holds the frames of its paused children as *segments*, and its
active child's frames sit on the stack above it.  Every other module reads frames through this one:
``walk`` (every frame of a run, paused ones included), ``child_index``, ``comment`` and the named slots.

Each kind's layout (its slots' names, the slot of its running child, the check of a frame from outside a
run) is declared once in flowvm/machine/layouts.py: SEQ ``[el, pos]``, REPEAT ``[el, i, n, last]``, BUFFER
``[el, i, n, values]``, LOOP ``[el, steps_at_iteration_start, iterations]``, WHILE ``[el, phase (0:
condition, 1: body), last, iterations]``, SWITCH ``[el, child_index]``, WEAVE ``[el, active, segments,
finished, values, credits, n_finished, rotate_due]``.

A move that failed twice appends a marker past these slots (see ``frames._failed_again``).

The moves (frames.py) index frames by number, as they run on every step of the general path; every other
module uses the named slots below.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from ..program.elements import BUFFER, LOOP, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Element
from ..program.kinds import KindTable
from .layouts import LAYOUTS, layout_of

# the named slots, numbered as each kind's layout declares them (flowvm/machine/layouts.py)
ELEMENT = 0  # of every frame


def _slot(kind: type, name: str) -> int:
    return LAYOUTS[kind].slots.index(name) + 1


SEQ_POS = _slot(SEQ, "pos")
REPEAT_I, REPEAT_N, REPEAT_LAST = (_slot(REPEAT, name) for name in ("i", "n", "last"))
BUFFER_I, BUFFER_N, BUFFER_VALUES = (_slot(BUFFER, name) for name in ("i", "n", "values"))
LOOP_START_STEPS, LOOP_ITERATIONS = (_slot(LOOP, name) for name in ("steps_at_iteration_start", "iterations"))
WHILE_PHASE, WHILE_LAST, WHILE_ITERATIONS = (_slot(WHILE, name) for name in ("phase", "last", "iterations"))
SWITCH_CHILD = _slot(SWITCH, "child_index")
WEAVE_ACTIVE, WEAVE_SEGMENTS, WEAVE_FINISHED, WEAVE_VALUES, WEAVE_CREDITS, WEAVE_DONE, WEAVE_ROTATE = (
    _slot(WEAVE, name) for name in LAYOUTS[WEAVE].slots)


def walk(chain: list, key: Callable[[Any], list] | None = None, path: tuple[int, ...] = (),
         paused: bool = False) -> Iterator[tuple[tuple[int, ...], list, int, bool]]:
    """(path, chain, index, paused) for every frame of a run: those of chain (a driver's ``_stack``),
    outermost first, each WEAVE's paused children right after the WEAVE (recursively); ``paused`` tells
    the frames of paused children.  ``key(item)`` gives the frame of an item of chain (default: the item
    itself), for working copies that wrap frames."""
    for k, item in enumerate(chain):
        fr = item if key is None else key(item)
        if k:
            prev = chain[k - 1] if key is None else key(chain[k - 1])
            path = path + (child_index(prev),)
        yield path, chain, k, paused
        if fr[0].frame_kind is WEAVE and len(fr) > 1:
            for j, seg in enumerate(fr[WEAVE_SEGMENTS]):
                if seg:
                    yield from walk(seg, key, path + (j,), True)


def comment(fr: list) -> str:
    """The counters of a started frame, in words ("3 of 10 done"), for listings; "" for others."""
    return COMMENT.of(fr[0])(fr) if len(fr) > 1 else ""


def _while_comment(fr: list) -> str:
    return f"{fr[WHILE_ITERATIONS]} iterations done" + (", testing condition" if fr[WHILE_PHASE] == 0 else "")


def _weave_comment(fr: list) -> str:
    return f"{fr[WEAVE_DONE]} of {fr[0].required} required finished, turn of child {fr[WEAVE_ACTIVE]}"


COMMENT = KindTable("frame comment", lambda fr: "", {
    REPEAT: lambda fr: f"{fr[REPEAT_I]} of {fr[REPEAT_N]} done",
    BUFFER: lambda fr: f"{fr[BUFFER_I]} of {fr[BUFFER_N]} done",
    LOOP: lambda fr: f"{fr[LOOP_ITERATIONS]} iterations done",
    WHILE: _while_comment,
    SEQ: lambda fr: f"at child {fr[SEQ_POS]} of {len(fr[0].elements)}",  # counted from 0, as paths are
    WEAVE: _weave_comment,
})
"""A started frame's counters in words, by its element's kind: ``fn(frame)`` (default: none)."""


def marks(stack: list) -> dict:
    """Gutter marks for a listing of a run: '>>' at the next leaf, '..' where paused WEAVE children
    resume, and each started frame's counters as a comment."""
    out: dict = {}
    for path, chain, k, paused in walk(stack):
        fr = chain[k]
        note = comment(fr)
        if k == len(chain) - 1:
            out[path] = (".." if paused else ">>", note or ("not started" if not fr[0].is_leaf else ""))
        elif note and path not in out:
            out[path] = ("", note)
    return out


def child_index(fr: list) -> int:
    """Index (in ``children``) of the child a started container frame is running (its layout's ``child``)."""
    layout = layout_of(fr[0])
    return 0 if layout is None or layout.child is None else fr[layout.child]


def weave_pick(fr: list, start: int) -> int:
    """The child whose turn comes next, from index start on, giving each skipped child its credit."""
    el = fr[0]
    n = len(el.elements)
    finished = fr[WEAVE_FINISHED]
    credits = fr[WEAVE_CREDITS]
    weights = el.weights
    j = start % n
    while True:
        if not finished[j]:
            credits[j] += weights[j] if weights is not None else 1
            if credits[j] >= 1:
                return j
        j = (j + 1) % n


def credit_weaves(drv, weaves: list | None = None) -> None:
    """After a leaf: every WEAVE around it counts one step of its active child's turn.  weaves: the WEAVE
    frames on the stack, when the caller knows them (else the stack is searched)."""
    for fr in drv._stack if weaves is None else weaves:
        if fr[0].frame_kind is WEAVE:
            credits = fr[WEAVE_CREDITS]
            a = fr[WEAVE_ACTIVE]
            credits[a] -= 1
            if credits[a] < 1:
                fr[WEAVE_ROTATE] = True
                drv._rotate = True

def rotate_weaves(drv, weaves: list | None = None) -> bool:
    """Hand the turn to the next child in every WEAVE whose active child used up its turn, innermost first;
    True when some WEAVE's turn passed to another child (the stack changed), False when each picked its
    active child again (its credits counted, its frames left in place).  weaves: the WEAVE frames on the
    stack, outermost first, when the caller knows them (else the stack is searched)."""
    drv._rotate = False
    stack = drv._stack
    if weaves is None:
        weaves = [fr for fr in stack if fr[0].frame_kind is WEAVE and len(fr) > 1]
    changed = False
    for fr in reversed(weaves):
        if fr[WEAVE_ROTATE]:
            fr[WEAVE_ROTATE] = False
            a = fr[WEAVE_ACTIVE]
            b = weave_pick(fr, a + 1)
            if b != a:
                pass_turn(drv, fr, b)
                changed = True
    return changed


def pass_turn(drv, fr: list, b: int) -> None:
    """The WEAVE frame fr (on the stack) hands the turn to its child b: the frames above it become the
    active child's paused segment, and b's segment goes on the stack."""
    stack = drv._stack
    k = next(k for k, f in enumerate(stack) if f is fr)
    segs = fr[WEAVE_SEGMENTS]
    segs[fr[WEAVE_ACTIVE]] = stack[k + 1:]
    del stack[k + 1:]
    stack.extend(segs[b])
    segs[b] = None
    fr[WEAVE_ACTIVE] = b


def take_turn(drv, weaves: list) -> bool:
    """What settling does for the WEAVEs around a leaf after it ran, for the fast paths: each of weaves (the
    WEAVE frames on the stack) counts one step of its active child's turn (``credit_weaves``), and those
    whose child used up its turn pick the next (``rotate_weaves``).  True when a turn passed to another
    child: the stack changed and the driver must settle into it."""
    return turn_used(weaves) and rotate_weaves(drv, weaves)


# ------------------------------------------------------------- commits of the fast paths
# The fast paths (fastpaths.py, and the one-step forms in driver.py) count in local variables and write
# their counts back through these, so that this module stays the one writer of frames.
def repeat_counted(drv, fr: list, i: int, value: Any) -> None:
    """A REPEAT frame's body finished its iteration i - 1 (counted from 0) with value: the counter (and
    its register) say i iterations are done."""
    fr[REPEAT_I] = i
    fr[REPEAT_LAST] = value
    counter = fr[ELEMENT].counter
    if counter is not None:
        drv.registers[counter.name] = i


def seq_moved(stack: list, fr: list, pos: int) -> None:
    """The SEQ frame fr, right below the leaf on top of stack, moved on to its child pos (not started)."""
    fr[SEQ_POS] = pos
    stack[-1] = [fr[ELEMENT].elements[pos]]


def repeat_seq_counted(stack: list, rep: list, seq: list, i: int, value: Any, pos: int) -> None:
    """A REPEAT frame rep of a SEQ frame seq (on top of stack, below its leaf): i iterations done, the last
    one's value, the SEQ at child pos (the registers, the fast path wrote as it went)."""
    rep[REPEAT_I], rep[REPEAT_LAST] = i, value
    seq[SEQ_POS] = pos  # seq_moved, written out: it runs once per run of a fast path's loop
    stack[-1] = [seq[ELEMENT].elements[pos]]


def seq_finished(stack: list, seq: list) -> None:
    """The SEQ frame seq (below the leaf on top of stack) finished: it is its REPEAT's body again, not started."""
    del seq[1:]
    del stack[-1]


def seq_restarted(stack: list, seq: list) -> None:
    """The SEQ frame seq (on top of stack, not started) enters its first child again."""
    seq.append(0)
    stack.append([seq[ELEMENT].elements[0]])


def turn_used(weaves: list) -> bool:
    """Each of weaves (WEAVE frames on the stack) counts one step of its active child's turn; True when some
    child used its turn up (``rotate_weaves`` then picks the next)."""
    due = False
    for fr in weaves:
        credits = fr[WEAVE_CREDITS]
        a = fr[WEAVE_ACTIVE]
        credits[a] -= 1
        if credits[a] < 1:
            fr[WEAVE_ROTATE] = True
            due = True
    return due


def turn_passed_in_repeat(drv, weave: list, credits: list, b: int, rep: list, i: int, value: Any,
                          seq: list | None, pos: int) -> None:
    """A fast path inside one WEAVE ended its child's turn after a leaf of the REPEAT frame rep (or of the
    SEQ frame seq that rep repeats, at child pos next), and the next turn is child b's: the WEAVE's credits
    counted on a copy, rep's count (``repeat_counted``), the SEQ as settling leaves it before a turn
    (``seq_moved``, or ``seq_finished`` at pos 0), then the turn (``pass_turn``).  One function for what
    takes a turn at every step of an unweighted WEAVE: each call cost 1% of such a step (bench_shapes)."""
    weave[WEAVE_CREDITS][:] = credits
    rep[REPEAT_I] = i
    rep[REPEAT_LAST] = value
    counter = rep[ELEMENT].counter
    if counter is not None:
        drv.registers[counter.name] = i
    if seq is not None:
        stack = drv._stack
        if pos:
            seq[SEQ_POS] = pos
            stack[-1] = [seq[ELEMENT].elements[pos]]
        else:
            del seq[1:]
            del stack[-1]
    pass_turn(drv, weave, b)


def set_credits(fr: list, credits: list) -> None:
    """The credits of the WEAVE frame fr's children after steps a fast path took, counted on a copy."""
    fr[WEAVE_CREDITS][:] = credits


# ------------------------------------------------------------- hot patches' frame edits
# flowvm.editing.hotpatch edits working copies of a driver's frames (lists of the same layouts) through
# these, then hands the result to Driver.replace_frames.
def copy_frame(fr: list, segment: Callable[[list], Any]) -> list:
    """A copy of fr whose WEAVE segments (if fr is a started WEAVE) are mapped through segment."""
    data = list(fr)
    if fr[ELEMENT].frame_kind is WEAVE and len(fr) > 1:
        data[WEAVE_SEGMENTS] = [None if seg is None else segment(seg) for seg in fr[WEAVE_SEGMENTS]]
    return data


def overwrite(fr: list, data: list) -> list:
    """fr (a frame the driver holds, or a new list) made equal to data; returns fr."""
    fr[:] = data
    return fr


def set_element(fr: list, el: Element) -> None:
    """fr runs el now (an edited element of the same kind, or any element when fr has not started)."""
    fr[ELEMENT] = el


def seq_frame(el: Element, pos: int) -> list:
    """A started SEQ frame at child pos (a SEQ wrapped around a running element)."""
    return [el, pos]


def seq_position(fr: list) -> int:
    return fr[SEQ_POS]


def set_seq_position(fr: list, pos: int) -> None:
    """A started SEQ frame's running child is now child pos (siblings were inserted or removed before it)."""
    fr[SEQ_POS] = pos


def weave_drop_child(fr: list, index: int) -> None:
    """A started WEAVE frame loses its child index (one waiting for its first turn): its slot in every
    per-child list goes, and the active index follows."""
    for slot in (WEAVE_SEGMENTS, WEAVE_FINISHED, WEAVE_VALUES, WEAVE_CREDITS):
        fr[slot] = fr[slot][:index] + fr[slot][index + 1:]
    if fr[WEAVE_ACTIVE] > index:
        fr[WEAVE_ACTIVE] -= 1
