"""The resumable machine that runs programs: ``Driver`` (``step``, ``run``, ``arun``).

A run's state is plain data, so a half-run driver pickles and copies: ``_stack``, the frames of the active
elements, outermost first (their layouts and the moves through them belong to flowvm/machine/frames.py);
``_carry``, a value in transit from a finished child to the frame on top; the registers; the step count.
Everything else is a cache, dropped when pickled and by ``invalidate()``: the function of the leaf the next
step runs, the frames the fast paths use (flowvm/machine/fastpaths.py), ``live`` handles of pending leaves.

Simple leaves (CALL, PRINT, a fused step) run through closures made by compile.py; any other leaf kind
implements the leaf protocol (``bind``, ``abandon``, ``PENDING``, ``ready_future``: docs/leaves.md).  One
step runs the leaf on top of the stack and then settles: finished frames hand their values up, WEAVEs take
their turns, and the driver descends to the next leaf.  Every move is atomic, so an exception anywhere leaves
a state from which the same move is retried; a step either runs one leaf or raises without running one.
docs/architecture.md follows one step from ``Driver.step()`` to the user's function and back.
"""

from __future__ import annotations

import numbers
import weakref
from time import monotonic
from typing import Any

from ..pickled import stable
from . import metrics
from . import fastpaths
from .leafcode import leaf_function
from .fastpaths import repeat_leaf, repeat_seq, repeat_woven
from .frames import (ELEMENT, REPEAT_I, REPEAT_LAST, REPEAT_N, SEQ_POS, WEAVE_FINISHED, child_index, credit_weaves,
                     marks, settle, take_turn)
from ..program.elements import REPEAT, SEQ, WEAVE, Element, provide, tool
from .idle import Idle as _Idle
from .idle import deadline_after, step_limit
from ..program.analysis import has_weave
from ..program.paths import format_path
from ..program.registers import Registers
from ..base.errors import RegisterError, SwitchError
from ..base.sentinels import INCOMPLETE, NOVALUE, PENDING
from ..base.tracebacks import user_traceback
from .runstate import RunState, RunStateAccess, run_starts  # noqa: F401  (RunState: a public name here too)


YIELD_EVERY = 0.00025  # seconds: how often arun() gives the event loop control, by default


@stable("flowvm")
class Driver(RunStateAccess):
    """Runs a program step by step; a half-run driver pickles and resumes anywhere.

    >>> from flowvm import CALL, REPEAT, Registers
    >>> reg = Registers(total=0)
    >>> prog = REPEAT(3, CALL(lambda t: t + 1, reg('total'), store_to=reg('total')))
    >>> drv = prog.start()
    >>> drv.step(), drv.steps, reg['total']
    (INCOMPLETE, 1, 1)
    >>> drv.run(), drv.steps, drv.done
    (3, 3, True)
    """

    def __init__(self, program: Element):
        if not isinstance(program, Element):
            raise TypeError(f"a program must be a flowvm element, got {type(program).__name__}")
        from ..program.verify import program_registers, verify

        self.registers: Registers = program_registers(program)
        verify(program, self.registers)
        # A copy of the root alone (its children are shared): an edit of the
        # user's program, which changes that root in place, leaves this run be.
        self.program = program = _root_copy(program)
        DRIVERS.add(self)
        self.steps = 0
        self.done = False
        self.result: Any = None
        self._stack: list[list] = [[program]]
        self._carry: Any = NOVALUE
        self._ready = False
        self._rotate = False
        self._weave = has_weave(program)
        run_starts(program)
        declared = program.process_settings
        if declared:
            self._resume = {"random": None, "settings": dict(declared), "announce": False}

    # Live handles of leaves between polls (see the leaf protocol above): a
    # cache dropped when pickled.
    @property
    def live(self) -> dict:
        live = self.__dict__.get("_live")
        if live is None:
            live = self.__dict__["_live"] = {}
        return live

    # The plan: what the driver derived about its next step (Engine._prepare), a cache never pickled.  Its
    # invariant: either every field is None (nothing derived: the next step's _prepare derives it), or _leaf
    # is the function of the leaf on top of the stack and the others describe the frames below it as they
    # are now; so whoever moves the stack or changes the program forgets the whole plan (_forget_plan), and
    # only the step that moves to a sibling leaf sets _leaf (and keeps _around: the same WEAVEs hold it).
    # The fields stay plain attributes of the driver: the fast paths read them at every step.
    PLAN = ("_leaf", "_fast", "_step_fast", "_fastseq", "_around", "_woven")
    _leaf = None  # the next leaf's function (leafcode.leaf_function, or its bind())
    _fast = None  # the REPEAT frame repeating that leaf, when it is a simple leaf (fastpaths.repeat_leaf)
    _step_fast = None  # _fast, for step(): None when watched (each step then records through the general path)
    _fastseq = None  # (REPEAT frame, SEQ frame) when the leaf is in a SEQ of plain leaves that a REPEAT repeats
    _around = None  # the WEAVE frames on the stack, when there are any
    _woven = None  # (WEAVE frames, REPEAT frame, SEQ frame or None): either shape above, inside WEAVEs
    _watch = None  # the run's history of metrics, when watched (see flowvm.machine.metrics)
    # Plain state (pickled): the index of the outermost of the frames that the last settle entered
    # and that have taken no step since (from there up to the next leaf); None: the leaf alone.
    _fresh = None

    def _forget_plan(self) -> None:
        """Forget what was derived about the next step (the fields of PLAN): the next step derives it again."""
        self._leaf = self._fast = self._step_fast = self._fastseq = self._around = self._woven = None

    # ------------------------------------------------------------------ public
    def step(self) -> Any:
        """Run one leaf action; return INCOMPLETE, or the program's value once it is finished."""
        fast = self._step_fast
        if fast is not None:
            i = fast[REPEAT_I] + 1
            if i < fast[REPEAT_N]:
                # Fast path: a leaf repeated by its REPEAT parent stays on the stack.  The leaf is called
                # here, not through _drive, which took three times as long a step (docs/architecture.md).
                try:
                    value = self._leaf()
                except Exception as err:  # its note, as _drive gives it (see _running_error)
                    raise self._running_error(err)
                self.steps += 1
                self._fresh = None
                # frames.repeat_counted, written out: the call cost 15% of this step (bench/bench_core.py)
                fast[REPEAT_I] = i
                fast[REPEAT_LAST] = value
                counter = fast[ELEMENT].counter
                if counter is not None:
                    self.registers[counter.name] = i
                return INCOMPLETE
        result = self._drive(self.steps + 1, None, None, False)  # one step of the general path
        if self._watch is not None:
            metrics.record(self)
        return result

    def run(self, max_steps: int | None = None, timeout: float | None = None) -> Any:
        """Run until the program finishes, max_steps more steps were taken, or timeout seconds passed.

        Returns the program's value when finished, else INCOMPLETE.  With a
        timeout, run() returns within about one leaf action (or one
        IDLE_SLICE of waiting) after it.  While every runnable leaf is a
        pending POPEN or SPAWN, run() sleeps on them instead of polling.
        """
        if self._watch is not None:
            return metrics.run(self, step_limit(self.steps, max_steps), deadline_after(timeout))
        return self._drive(step_limit(self.steps, max_steps), deadline_after(timeout), None, True)

    async def arun(self, max_steps: int | None = None, timeout: float | None = None,
                   steps_per_yield: int | None = None, yield_every: float = YIELD_EVERY) -> Any:
        """Drive the program from asyncio: ``await drv.arun()``.

        Gives the event loop control about every ``yield_every`` seconds (0.25 ms by default: other tasks
        run, and may inspect, save or stop the driver, between two steps), or after every
        ``steps_per_yield`` steps when that is given; a single leaf that runs longer holds the loop that
        long.  While every runnable leaf is a pending POPEN or SPAWN it awaits them, taking no CPU,
        instead of polling.  Returns as run() does; cancelling the task leaves the driver between two
        steps, on one a copy resumes from exactly (after a forward pass's backward: ``run_to_copyable``).

        >>> import asyncio
        >>> from flowvm import CALL, REPEAT, Registers
        >>> reg = Registers(n=0)
        >>> asyncio.run(REPEAT(3, CALL(lambda n: n + 1, reg('n'), store_to=reg('n'))).start().arun())
        3
        """
        import asyncio

        _check_yields(steps_per_yield, yield_every)
        limit = step_limit(self.steps, max_steps)
        deadline = deadline_after(timeout)
        idle = _Idle()
        while True:
            idle.stopped = False
            cap = limit if self._watch is None else min(limit, metrics.due_after(self))
            if steps_per_yield is None:  # a time slice, ending at the deadline at the latest
                end = monotonic() + yield_every
                self._drive(cap, end if deadline is None or end < deadline else deadline, idle, False)
            else:
                self._drive(min(cap, self.steps + steps_per_yield), deadline, idle, False)
            if self._watch is not None:
                metrics.record(self)
            if self.done:
                return self.result
            if self.steps >= limit or (deadline is not None and monotonic() >= deadline):
                return INCOMPLETE
            try:
                if idle.stopped:
                    await idle.wait_async(self, deadline)
                else:
                    await asyncio.sleep(0)
            except asyncio.CancelledError:  # left on a step a copy resumes from exactly (said when it waited)
                self.settle_cancelled()
                raise

    def _drive(self, limit, deadline: float | None, idle: "_Idle | None", block: bool) -> Any:
        """The loop of run(), arun() and step(): with block=False it returns instead of waiting on pending
        leaves.  The one place the general path calls a leaf (the fast paths call theirs in their own
        loops: docs/architecture.md)."""
        try:  # (flowvm.machine.live finds a driver mid-step by this method's frame)
            while True:
                if self.steps >= limit and not self.done:
                    return INCOMPLETE  # checked first: run(max_steps=0) enters nothing
                if self._leaf is None and not self._prepare():
                    return self.result
                if deadline is not None and monotonic() >= deadline:
                    return INCOMPLETE
                if (self._fast is not None or self._fastseq is not None or self._woven is not None) \
                        and self._fast_steps(limit, deadline):
                    continue  # (if a WEAVE's turn passed to another child, the driver is settled into it)
                value = self._leaf()
                if value is not PENDING:
                    self._after_leaf(value)
                    continue
                idle = self._polled(idle, deadline, block)
                if idle is None:
                    return INCOMPLETE
        except Exception as err:  # the one place where a leaf's error gets its note (see _running_error)
            raise self._running_error(err)

    def _fast_steps(self, limit, deadline: float | None) -> bool:
        """Steps of the fast path the next leaf is on (fastpaths.py), if it has steps to take.  True when
        the loop looks again (a deadline to check, the step limit reached, a WEAVE's turn passed); False
        when the general path takes the next step (a REPEAT's last iteration, with no deadline, at once).
        Each writes the frames back before an error leaves it; with a deadline, each looks at the clock
        after every step, since a step may take far longer than the last."""
        fast = self._fast
        if fast is not None:
            if fast[REPEAT_I] + 1 >= fast[REPEAT_N]:
                return False  # the last iteration: the general path finishes the REPEAT
            repeat_leaf(self, fast, limit, deadline)
            return deadline is not None or self.steps >= limit
        shape = self._fastseq or self._woven  # (REPEAT frame, SEQ frame), or (WEAVE frames, REPEAT, SEQ or None)
        rep, seq = shape[-2], shape[-1]
        if rep[REPEAT_I] + 1 >= rep[REPEAT_N] and (seq is None or seq[SEQ_POS] + 1 == len(seq[ELEMENT].elements)):
            return False  # the last leaf of the REPEAT's last iteration: the general path takes it, at once
        if self._fastseq is not None:
            ran = repeat_seq(self, self._fastseq, limit, deadline)
            return (deadline is not None and ran > 0) or self.steps >= limit
        return repeat_woven(self, self._woven, limit, deadline) > 0

    def _polled(self, idle: "_Idle | None", deadline: float | None, block: bool) -> "_Idle | None":
        """The leaf returned PENDING: count the poll; when every runnable leaf polled pending in turn, wait
        on them (block), or return None to say so (for arun, which awaits them).  Returns the Idle that
        follows the polls (a new one when idle is None)."""
        if idle is None:
            idle = _Idle()
        key = id(self._stack[-1])
        steps = self.steps
        self._after_poll()
        if idle.full_circle(key, steps):
            if not block:
                idle.stopped = True
                return None
            idle.wait(self, deadline)
        return idle

    # ---------------------------------------------------------- between two leaves
    def _prepare(self) -> bool:
        """Settle if needed and fill the caches for the next leaf; False when the program is finished.

        The leaf's function is made here: for a simple leaf (CALL, PRINT, FUSED) the closure compile.py
        makes, for any other what its ``bind`` returns (the leaf protocol, docs/leaves.md)."""
        if self._resume is not None:  # a copy's first step (or first run() once finished)
            self._apply_resume()
        if self.done:
            return False
        if not self._ready:
            settle(self)
            if self.done:
                return False
        stack = self._stack
        around = self._around = _weaves_around(stack) if self._weave else None
        fr = stack[-1]
        el = fr[ELEMENT]
        if not type(el).simple_leaf:
            self._leaf = el.bind(self, fr)
            return True
        self._leaf = leaf_function(el, self.registers)
        if len(stack) < 2 or not fastpaths.ENABLED:
            return True
        # The fast path (fastpaths.py) of a simple leaf in a REPEAT, or in a SEQ of simple leaves in a
        # REPEAT, found here: in a method of its own, a step of a deep nest of tight loops took 4-7% longer
        parent = stack[-2]
        kind = parent[ELEMENT].frame_kind  # a subclass of REPEAT or SEQ that keeps the kind's moves is that kind
        if around is not None and _turn_per_step(around):
            return True
        if kind is REPEAT:
            if around is not None:
                self._woven = (around, parent, None)
            else:
                self._fast = parent
                if self._watch is None:  # a watched step records its history: the general path
                    self._step_fast = parent
        elif kind is SEQ and len(stack) > 2 and stack[-3][ELEMENT].frame_kind is REPEAT \
                and all(type(c).simple_leaf for c in parent[ELEMENT].elements):
            if around is None:
                self._fastseq = (stack[-3], parent)
            else:
                self._woven = (around, stack[-3], parent)
        return True

    def _after_leaf(self, value: Any) -> None:
        stack = self._stack
        if len(stack) > 1 and fastpaths.ENABLED:
            fr = stack[-2]
            if fr[ELEMENT].frame_kind is SEQ:  # the next sibling is a plain leaf: move to it directly
                elements = fr[ELEMENT].elements
                pos = fr[SEQ_POS] + 1
                if pos < len(elements) and type(elements[pos]).simple_leaf:
                    # what settling would do: the SEQ moves on (its children's values are dropped)
                    nxt = elements[pos]
                    self.steps += 1
                    fr[SEQ_POS] = pos  # frames.seq_moved, written out (see Driver.step)
                    stack[-1] = [nxt]
                    around = self._around  # the same WEAVE frames hold the sibling
                    self._forget_plan()
                    self._around, self._fresh = around, None
                    if around is not None and take_turn(self, around):
                        self.settle_after_turn()  # the turn passed to another child of a WEAVE
                        return
                    try:
                        self._leaf = leaf_function(nxt, self.registers)  # as _prepare makes it
                    except Exception:  # retried, and raised, by the next step's _prepare
                        pass
                    return
        self.steps += 1
        self._fresh = None
        stack.pop()
        self._carry = value
        self._ready = False
        around = self._around  # the WEAVE frames around the leaf, found by _prepare
        self._forget_plan()
        if around is not None:
            credit_weaves(self, around)
        try:
            self._prepare()
        except Exception:
            # Retried, and raised, at the start of the next step: this step did run its leaf.
            pass

    def _after_poll(self) -> None:
        """A leaf polled something still running: one step, the leaf stays where it is."""
        self.steps += 1
        self._fresh = None
        if self._weave:
            credit_weaves(self)
            if self._rotate:
                self.settle_after_turn()

    def settle_after_turn(self) -> None:
        """A WEAVE's turn ended after a step (the stack may hold another child's frames now): settle into
        the next leaf, as after any leaf; a move that fails is retried, and raised, by the next step."""
        self._ready = False
        self._forget_plan()
        try:
            self._prepare()
        except Exception:
            pass

    def _running_error(self, err: BaseException) -> BaseException:
        """err raised by the leaf on top, annotated; a register the leaf reads that holds no value (the
        KeyError of its lookup) becomes a RegisterError naming it.  The error of a move (settling into
        the leaf), which frames.settle annotated, is left as it is."""
        if self.__dict__.pop("_move_error", None) is err:
            return err
        el = self._stack[-1][ELEMENT] if self._stack else None
        if (isinstance(err, KeyError) and not isinstance(err, RegisterError) and el is not None and err.args
                and isinstance(err.args[0], str) and err.args[0] not in self.registers
                and any(r.name == err.args[0] for r in el.own_reads())):
            from ..program.printer import describe

            name = err.args[0]
            new = RegisterError(f"register {name!r} holds no value when {describe(el)} reads it", name)
            new.__cause__, new.__suppress_context__ = err, True
            err = new
        self._annotate(err, "running")
        mine = user_traceback(err.__traceback__)  # the program's own frames, not the machine's that called it
        return err if mine is None else err.with_traceback(mine)

    def _annotate(self, err: BaseException, doing: str) -> None:
        try:
            path, fr = self.frame_paths()[-1] if self._stack else ((), [self.program])
            from ..program.printer import describe

            where = format_path(path) or "<root>"
            err.add_note(f"flowvm: while {doing} {describe(fr[ELEMENT])} at path '{where}' (step {self.steps + 1})")
            if isinstance(err, (RegisterError, SwitchError)) and not err.path:
                err.path = format_path(path)
            err._flowvm_noted = True
        except Exception:  # pragma: no cover - never hide the user's error
            pass

    @property
    def position(self) -> str | None:
        """Path of the leaf the next step runs (None when finished or not yet settled)."""
        if self.done or not self._ready:
            return None
        return format_path(self.frame_paths()[-1][0])

    @property
    def fast_path(self) -> str | None:
        """The tight loop the next steps of run() take, if any: "repeat-leaf" (a simple leaf repeated by its
        REPEAT), "repeat-seq" (a SEQ of simple leaves repeated by a REPEAT), or None (the general path,
        settling through the frames after each leaf).  For profiling a program's shape: the frames and
        results are the same either way (docs/architecture.md)."""
        if self._leaf is None or self.done:
            return None
        if self._fast is not None or (self._woven is not None and self._woven[2] is None):
            return "repeat-leaf"
        return "repeat-seq" if self._fastseq is not None or self._woven is not None else None

    def frame_paths(self) -> list[tuple[tuple[int, ...], list]]:
        """(path, frame) for each frame on the active stack, outermost first."""
        out = []
        path: tuple[int, ...] = ()
        for k, fr in enumerate(self._stack):
            if k:
                path = path + (child_index(self._stack[k - 1]),)
            out.append((path, fr))
        return out

    def __str__(self) -> str:
        """The listing of the program with the run's position: '>>' at the next leaf, '..' where paused
        WEAVE children resume, the loop counters as comments, and the step count."""
        from ..program.printer import fmt, listing

        if self.done:
            state = f"finished after {self.steps} steps, result {fmt(self.result, 60)}"
        else:
            pos = self.position
            state = f"step {self.steps}, next: path {pos!r}" if pos is not None else f"step {self.steps}"
        return f"# flowvm driver: {state}\n" + listing(self.program, {} if self.done else marks(self._stack))

    def __repr__(self) -> str:
        state = "finished" if self.done else f"at {self.position!r}" if self._ready else "not settled"
        return f"<flowvm.Driver {self.program.kind} step {self.steps} {state}>"

    # ---------------------------------------------------------------- watching
    def watch(self, *names: str, every: int | None = None) -> "Driver":
        """Keep the history of the registers named: a point ``[step, value]`` every ``every`` steps (by
        default about 200 points over the steps the program fixes) and one when the run ends, whichever of
        run(), arun() or step() drives it.  The history is part of the run: copies, checkpoints and state
        files hold it, and a resumed run records exactly the points of the uninterrupted one.  Returns the
        driver.

        >>> from flowvm import CALL, REPEAT, Registers
        >>> reg = Registers(n=0)
        >>> drv = REPEAT(4, CALL(lambda n: n + 1, reg('n'), store_to=reg('n'))).start().watch('n', every=2)
        >>> drv.run(); drv.history
        4
        {'n': [(0, 0.0), (2, 2.0), (4, 4.0)]}
        """
        from ..program.analysis import static_steps

        metrics.watch(self, names, every, static_steps(self.program))
        self._step_fast = None  # step() records the history now: no more of the fast path that would not
        return self

    @property
    def history(self) -> dict[str, list[tuple[int, Any]]]:
        """The points of the registers watched (see watch), by name: ``[(step, value), ...]``."""
        if self._watch is None:
            return {}
        return {name: [tuple(p) for p in self._watch["points"][name]] for name in self._watch["names"]}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("step", None)  # (a watched driver of older versions had a step of its own)
        for name in self.PLAN:
            state.pop(name, None)
        state.pop("_live", None)
        state.pop("_move_error", None)
        state["_resume"] = self._resume_for_copy()
        return state

    def invalidate(self) -> None:
        """Drop what the driver derived from its program and frames (the next leaf's function, the frames
        the fast paths hold, whether the program has a WEAVE); the next step derives them again.  For
        whoever changes the program or the frames in place (hot patches, in-place edits).  When the element
        the driver was about to run became a container, the next step settles into it."""
        self._weave = has_weave(self.program)
        self._forget_plan()
        stack = self._stack
        if self._ready and stack and not stack[-1][ELEMENT].is_leaf:
            self._ready = False

    # ---------------------------------------------------------------- editing a run
    def find(self, pattern: Any = None, *, where: Any = None, missing_ok: bool = False):
        """Matches in the program this driver runs; their edits patch the driver in place (hot patches:
        see flowvm.editing.hotpatch)."""
        return tool("find")(self, pattern, where=where, missing_ok=missing_ok)

    def at(self, *paths: Any):
        """The elements at the given paths of the driver's program, to hot-patch them."""
        return tool("at")(self, *paths)

    @property
    def dependency_overrides(self) -> dict:
        """Replacements for Depends providers in this run; they take precedence over the program's."""
        return self.__dict__.setdefault("dependency_overrides", {})

    @dependency_overrides.setter
    def dependency_overrides(self, value: dict) -> None:
        if not isinstance(value, dict):
            raise TypeError(f"dependency_overrides must be a dict {{provider: replacement}}, got {type(value).__name__}")
        self.__dict__["dependency_overrides"] = value

    def __reduce_ex__(self, protocol):
        # Whatever the outer pickler (pickle, cloudpickle, copy.deepcopy), the
        # half-run state is written by flowvm's own pickler (checkpoint.py), so
        # every copy keeps the same things: gradients, global generators, lambdas.
        # The driver is one self-contained unit: an object it shares with
        # something pickled beside it is copied, not shared.
        return tool("copy_driver")(self)

provide("start", Driver)  # Element.start()
# The drivers in the middle of a step in this context, innermost first, as a chain (driver, outer chain) ending
# in (): set by step() and by the loop of run() and arun(), read by flowvm.machine.live.
DRIVERS: "weakref.WeakSet[Driver]" = weakref.WeakSet()  # drivers started in this process (see flowvm.machine.live)


def _check_yields(steps_per_yield: int | None, yield_every: float) -> None:
    if steps_per_yield is not None and (isinstance(steps_per_yield, bool) or not isinstance(steps_per_yield, numbers.Integral)
                                        or steps_per_yield < 1):
        raise ValueError(f"steps_per_yield must be an int >= 1 or None, got {steps_per_yield!r}")
    if isinstance(yield_every, bool) or not isinstance(yield_every, numbers.Real) or not yield_every > 0:
        raise ValueError(f"yield_every must be a number of seconds > 0, got {yield_every!r}")


def _root_copy(program: Element) -> Element:
    """A new root object with the same fields and caches (compiled functions stay shared)."""
    root = object.__new__(type(program))
    root.__dict__.update(program.__dict__)
    if "_overrides" in root.__dict__:  # its own table: overrides set on the program later do not reach the run
        root.__dict__["_overrides"] = dict(root.__dict__["_overrides"])
    return root


def _weaves_around(stack: list) -> list | None:
    """The WEAVE frames on stack, outermost first (None: none)."""
    return [fr for fr in stack if fr[ELEMENT].frame_kind is WEAVE] or None


def _turn_per_step(around: list) -> bool:
    """Whether the WEAVE around a leaf (one, unweighted, with two or more children left) passes the turn at
    every step: the fast path would run one step at a time there, and the general path's step is shorter
    (bench_shapes, two nests in an unweighted WEAVE: 4.7 against 5.7 µs a step)."""
    return len(around) == 1 and around[0][ELEMENT].weights is None and around[0][WEAVE_FINISHED].count(False) > 1
