"""Frames: the moves through each container kind, and settling, over the layouts of slots.py (whose names
this module re-exports: import frames' names from here).  ``START[kind](drv, frame)`` enters a container,
``NEXT[kind](drv, frame, value)`` takes the value of its finished child.  Each returns ``PUSHED`` after
pushing the next child's frame (``push``), or the container's own value when it is finished.  ``settle``
hands finished values up and descends to the next leaf.  A kind written outside flowvm registers its moves
with ``register_container`` (docs/containers.md).  The layouts of the frames these moves write are in
slots.py; the moves index them by number, as they run on every step of the general path.  With slots.py
this module is the one writer of frames (docs/architecture.md).
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, Callable

from ..base.errors import FlowError, RegisterError, SwitchError
from ..base.sentinels import NOVALUE, PUSHED
from ..program.elements import BUFFER, CALL, LOOP, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Element
from ..program.kinds import KindTable
from ..program.registers import Register
from .slots import (ELEMENT, SEQ_POS, REPEAT_I, REPEAT_N, REPEAT_LAST, BUFFER_I, BUFFER_N, BUFFER_VALUES,
    LOOP_START_STEPS, LOOP_ITERATIONS, WHILE_PHASE, WHILE_LAST, WHILE_ITERATIONS, SWITCH_CHILD, WEAVE_ACTIVE,
    WEAVE_SEGMENTS, WEAVE_FINISHED, WEAVE_VALUES, WEAVE_CREDITS, WEAVE_DONE, WEAVE_ROTATE, walk,
    comment, COMMENT, marks, child_index, weave_pick, credit_weaves, rotate_weaves, pass_turn, take_turn,
    repeat_counted, seq_moved, repeat_seq_counted, seq_finished, seq_restarted, turn_used, set_credits,
    turn_passed_in_repeat, copy_frame, overwrite, set_element, seq_frame, seq_position, set_seq_position,
    weave_drop_child)  # noqa: F401  (the frames API)


def read_register(drv, reg: Register, what: str) -> Any:
    try:
        return drv.registers[reg.name]
    except KeyError:
        raise RegisterError(f"{what}: register {reg.name!r} holds no value", reg.name) from None


def _count(drv, el: Element) -> int:
    n = el.n
    if isinstance(n, Register):
        n = read_register(drv, n, f"{el.kind} count")
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{el.kind} count register {el.n.name!r} holds {type(n).__name__} {n!r:.60}, "
                            "expected an int >= 0")
        if n < 0:
            raise ValueError(f"{el.kind} count register {el.n.name!r} holds {n}, expected an int >= 0")
        n = int(n)
    return n


def _start_seq(drv, fr):
    el = fr[0]
    if not el.elements:
        return None
    fr.append(0)
    drv._stack.append([el.elements[0]])
    return PUSHED


def _next_seq(drv, fr, value):
    el = fr[0]
    pos = fr[1] + 1
    if pos == len(el.elements):
        return value
    fr[1] = pos
    drv._stack.append([el.elements[pos]])
    return PUSHED


def _start_repeat(drv, fr):
    el = fr[0]
    n = _count(drv, el)
    if el.counter is not None:
        drv.registers[el.counter.name] = 0
    if n == 0:
        return None
    fr.extend((0, n, None))
    drv._stack.append([el.body])
    return PUSHED


def _next_repeat(drv, fr, value):
    el = fr[0]
    i = fr[1] = fr[1] + 1
    fr[3] = value
    if el.counter is not None:
        drv.registers[el.counter.name] = i
    if i < fr[2]:
        drv._stack.append([el.body])
        return PUSHED
    return value


def _start_buffer(drv, fr):
    el = fr[0]
    n = _count(drv, el)
    if n == 0:
        return _store(drv, el, [])
    fr.extend((0, n, []))
    drv._stack.append([el.body])
    return PUSHED


def _next_buffer(drv, fr, value):
    el = fr[0]
    fr[3].append(value)
    i = fr[1] = fr[1] + 1
    if i < fr[2]:
        drv._stack.append([el.body])
        return PUSHED
    return _store(drv, el, collect(fr[3]))


def _store(drv, el, value):
    if el.store_to is not None:
        drv.registers[el.store_to.name] = value
    return value


def collect(values: list) -> Any:
    """BUFFER's value: one stacked numpy array or torch tensor when possible, else the list."""
    if not values:
        return values
    np = sys.modules.get("numpy")
    if np is not None and all(isinstance(v, (np.ndarray, np.generic)) for v in values):
        if len({np.shape(v) for v in values}) == 1:
            return np.stack(values)
        return values
    torch = sys.modules.get("torch")
    if torch is not None and all(isinstance(v, torch.Tensor) for v in values):
        if len({tuple(v.shape) for v in values}) == 1:
            return torch.stack(values)
    return values


def _start_loop(drv, fr):
    fr.extend((drv.steps, 0))
    drv._stack.append([fr[0].body])
    return PUSHED


def _failed_again(fr: list, size: int, err: Exception) -> bool:
    """A move out of fr failed: whether it had failed before with the same value.

    The first failure comes right after the leaf that produced the value (and is raised at the start of
    the next step, which retries the move); the retry that raises it marks the frame to be re-entered,
    so that the step after it recomputes what failed (the cause may have been fixed meanwhile)."""
    if len(fr) == size:
        fr.append(True)
        return False
    del fr[size:]
    err._flowvm_rewound = True  # the settle's caller: nothing to carry, the next step starts afresh
    return True


def _next_loop(drv, fr, value):
    if drv.steps == fr[1]:
        err = FlowError("LOOP body finished an iteration without taking a step; it would spin forever "
                        "(does a REPEAT or BUFFER count in it hold 0?)")
        if _failed_again(fr, 3, err):
            fr[1] = drv.steps  # the next step enters the body again, reading its counts anew
            drv._stack.append([fr[0].body])
        raise err
    del fr[3:]
    fr[1] = drv.steps
    fr[2] += 1
    drv._stack.append([fr[0].body])
    return PUSHED


def _start_while(drv, fr):
    fr.extend((0, None, 0))
    drv._stack.append([fr[0].cond])
    return PUSHED


def _next_while(drv, fr, value):
    el = fr[0]
    if fr[1] == 0:
        if value:
            fr[1] = 1
            drv._stack.append([el.body])
            return PUSHED
        return fr[2]
    fr[2] = value
    fr[3] += 1
    fr[1] = 0
    drv._stack.append([el.cond])
    return PUSHED


def _switch_case(el: SWITCH, value: Any) -> int:
    idx = el.case_index(value)
    if idx < 0:
        cases = ", ".join(repr(k) for k in el.cases)
        raise SwitchError(f"SWITCH has no case for selector value {value!r:.80} (cases: {cases}) and no default",
                          value)
    return idx


def _start_switch(drv, fr):
    el = fr[0]
    if isinstance(el.selector, CALL):
        fr.append(0)
        drv._stack.append([el.selector])
        return PUSHED
    idx = _switch_case(el, read_register(drv, el.selector, "SWITCH selector"))
    fr.append(idx)
    drv._stack.append([el.children[idx]])
    return PUSHED


def _next_switch(drv, fr, value):
    el = fr[0]
    if fr[1] == 0 and isinstance(el.selector, CALL):
        try:
            idx = _switch_case(el, value)
        except SwitchError as err:
            if _failed_again(fr, 2, err):
                drv._stack.append([el.selector])  # the next step runs the selector again
            raise
        del fr[2:]
        fr[1] = idx
        drv._stack.append([el.children[idx]])
        return PUSHED
    return value


def _start_weave(drv, fr):
    el = fr[0]
    n = len(el.elements)
    if el.required == 0:
        return [None] * n
    fr.extend((0, [[[c]] for c in el.elements], [False] * n, [None] * n, [0] * n, 0, False))
    a = weave_pick(fr, 0)
    fr[WEAVE_ACTIVE] = a
    segs = fr[WEAVE_SEGMENTS]
    drv._stack.extend(segs[a])
    segs[a] = None
    return PUSHED


def _next_weave(drv, fr, value):
    a = fr[WEAVE_ACTIVE]
    fr[WEAVE_FINISHED][a] = True
    fr[WEAVE_VALUES][a] = value
    fr[WEAVE_CREDITS][a] = 0
    fr[WEAVE_ROTATE] = False
    fr[WEAVE_DONE] += 1
    if fr[WEAVE_DONE] >= fr[0].required:
        abandon(drv, fr)
        return list(fr[WEAVE_VALUES])
    b = weave_pick(fr, a + 1)
    fr[WEAVE_ACTIVE] = b
    segs = fr[WEAVE_SEGMENTS]
    drv._stack.extend(segs[b])
    segs[b] = None
    return PUSHED


def abandon(drv, fr) -> None:
    """Tell the leaves of a finishing WEAVE's unfinished children that they are dropped."""
    for seg in fr[WEAVE_SEGMENTS]:
        for sub in seg or ():
            el = sub[0]
            if el.frame_kind is WEAVE and len(sub) > 1:
                abandon(drv, sub)
            elif el.is_leaf and hasattr(el, "abandon"):
                el.abandon(drv, sub)


class Moves(KindTable):
    """A table of moves by element class (a ``KindTable``): a class without an entry takes its nearest base
    class's, so a subclass of a kind moves as that kind; a class with none is a FlowError naming it."""

    def missing(self, cls: type):
        raise FlowError(f"{getattr(cls, 'kind', cls.__name__)} is a container kind with no moves: "
                        f"register them with flowvm.machine.frames.register_container (docs/containers.md)")


START = Moves("start", None, {SEQ: _start_seq, REPEAT: _start_repeat, BUFFER: _start_buffer, LOOP: _start_loop,
                        WHILE: _start_while, SWITCH: _start_switch, WEAVE: _start_weave})
NEXT = Moves("next", None, {SEQ: _next_seq, REPEAT: _next_repeat, BUFFER: _next_buffer, LOOP: _next_loop,
                      WHILE: _next_while, SWITCH: _next_switch, WEAVE: _next_weave})


def register_container(cls: type, start: Callable, next: Callable) -> type:
    """Make cls (an Element subclass with children, written anywhere) a container the driver runs:
    ``start(driver, frame)`` enters it, ``next(driver, frame, value)`` takes the value of its finished child.
    Each returns ``push(driver, child)`` to run a child next, or the container's own value when it is
    finished.  ``frame`` is a list: ``frame[0]`` the element, the rest the container's own counters (plain
    data: ints, lists, values), appended by ``start``; it is what a copy of the run keeps.  Returns cls.
    docs/containers.md has a worked example."""
    if not (isinstance(cls, type) and issubclass(cls, Element)) or cls.is_leaf:
        raise TypeError(f"register_container: expected a container Element class, got {cls!r:.60}")
    if not (callable(start) and callable(next)):
        raise TypeError(f"register_container: start and next of {cls.__name__} must be functions")
    START.register(cls, start)
    NEXT.register(cls, next)
    if "frame_kind" not in cls.__dict__:
        # a subclass of a built-in kind with moves of its own has frames of its own layout: it is no longer
        # that kind to the machine and the state files (a class that keeps the layout sets frame_kind itself)
        cls.frame_kind = None
    return cls


def push(drv, child: Element) -> Any:
    """Run child next (a container's move): its frame goes on top of the stack; returns PUSHED, what the move
    returns."""
    drv._stack.append([child])
    return PUSHED


# ------------------------------------------------------------------------ settling
def settle(drv) -> None:
    """Hand finished values up, take WEAVE turns, and descend to the next leaf."""
    stack = drv._stack
    value = drv._carry
    nexts, starts, pushed, novalue = NEXT, START, PUSHED, NOVALUE
    # The frames this settle starts: those of them right below the next leaf have taken no step
    # yet, so a hot patch may rewind them (see _fresh and flowvm.editing.hotpatch).
    entered: dict[int, list] = {}  # id -> frame (held, so that no id is reused meanwhile)
    try:
        while True:
            if value is not novalue:
                if not stack:
                    drv.done = True
                    drv.result = value
                    drv._carry = novalue
                    drv._ready = True
                    return
                fr = stack[-1]
                r = nexts[fr[0].__class__](drv, fr, value)
            else:
                if drv._rotate:
                    rotate_weaves(drv)
                fr = stack[-1]
                el = fr[0]
                if el.is_leaf:
                    drv._carry = novalue
                    drv._ready = True
                    fresh = len(stack) - 1
                    while fresh and id(stack[fresh - 1]) in entered:
                        fresh -= 1
                    drv._fresh = fresh
                    return
                entered[id(fr)] = fr
                r = starts[el.__class__](drv, fr)
            if r is pushed:
                value = novalue
            else:
                stack.pop()
                value = r
    except Exception as err:
        # the move that failed is retried from here; or the frame it failed in was re-entered
        drv._carry = NOVALUE if getattr(err, "_flowvm_rewound", False) else value
        if not getattr(err, "_flowvm_noted", False):
            drv._annotate(err, "finishing" if value is not novalue else "entering")
        drv._move_error = err  # for _running_error, the step's handler (a cache: never pickled)
        raise
