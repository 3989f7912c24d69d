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
from dataclasses import dataclass
from time import monotonic
from typing import Any

from ..pickled import stable
from .compile import leaf_function
from . import fastpaths, history
from .fastpaths import repeat_leaf, repeat_seq, repeat_woven
from .frames import (ELEMENT, REPEAT_I, REPEAT_LAST, REPEAT_N, SEQ_POS, child_index, credit_weaves, marks,
                     settle, take_turn)
from ..base.environment import apply_random, apply_settings, capture_random, capture_settings, check_settings
from ..program.elements import REPEAT, SEQ, WEAVE, Element, provide, tool
from ..base.errors import RegisterError, SwitchError
from .idle import Idle as _Idle
from .idle import deadline_after, step_limit
from ..program.analysis import has_weave
from ..program.paths import format_path
from ..program.registers import Registers
from ..base.sentinels import INCOMPLETE, NOVALUE, PENDING




@dataclass
class RunState:
    """A driver's run state as plain data (``Driver.snapshot()``, ``Driver.restore()``): what persistence
    saves and loads, without reaching into the driver.

    ``frames`` are the driver's own frame lists (flowvm.machine.frames), outermost first: read them, and
    hand new ones to ``restore``.  ``carry`` is the value in transit from a finished child to the frame on
    top (``NOVALUE`` when none); ``ready``: the driver sits just before its next leaf; ``rotate``: a WEAVE's
    turn is due at the next settle; ``fresh``: the index of the outermost frame that the last settle entered
    and that has taken no step since (None: the leaf alone); ``history``: the watched registers' points
    (flowvm.machine.history) or None; ``environment``: the global random states and settings a copy resumes
    with (``{"random", "settings", "announce"}``, flowvm.base.environment) or None.
    """

    steps: int
    done: bool
    result: Any
    frames: list
    carry: Any = NOVALUE
    ready: bool = False
    rotate: bool = False
    fresh: int | None = None
    history: dict | None = None
    environment: dict | None = None


YIELD_EVERY = 0.00025  # seconds: how often arun() gives the event loop control, by default


@stable("flowvm")
class Driver:
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

    # Caches, never pickled: the compiled function of the leaf the next step
    # runs, and the frames around it that the fast paths use.
    _leaf = None
    _fast = None
    _step_fast = None  # _fast, for step(): None when watched (each step then records through the general path)
    _watch = None  # the run's history of metrics, when watched (see flowvm.machine.history)
    # Plain state (pickled): the index of the outermost of the frames that the last settle entered
    # and that have taken no step since (from there up to the next leaf); None: the leaf alone.
    _fresh = None
    _fastseq = None  # (REPEAT frame, SEQ frame) when the leaf is in a SEQ of plain leaves that a REPEAT repeats
    _around = None  # the WEAVE frames on the stack, when there are any
    _woven = None  # (WEAVE frames, REPEAT frame, SEQ frame or None): either shape above, inside WEAVEs

    # ------------------------------------------------------------------ public
    def step(self) -> Any:
        """Run one leaf action; return INCOMPLETE, or the program's value once it is finished."""
        try:
            fast = self._step_fast
            if fast is not None:
                i = fast[REPEAT_I] + 1
                if i < fast[REPEAT_N]:
                    # Fast path: a leaf repeated by its REPEAT parent stays on the stack.
                    value = self._leaf()
                    self.steps += 1
                    self._fresh = None
                    # frames.repeat_counted, written out: the call cost 15% of this step (bench/bench_core.py)
                    fast[REPEAT_I] = i
                    fast[REPEAT_LAST] = value
                    counter = fast[ELEMENT].counter
                    if counter is not None:
                        self.registers[counter.name] = i
                    return INCOMPLETE
            if self._leaf is None and not self._prepare():
                if self._watch is not None:
                    history.record(self)
                return self.result
            value = self._leaf()
        except Exception as err:  # the one place where a leaf's error gets its note (see _running_error)
            raise self._running_error(err)
        if value is PENDING:
            self._after_poll()
        else:
            self._after_leaf(value)
        if self._watch is not None:
            history.record(self)
        return self.result if self.done else INCOMPLETE

    def run(self, max_steps: int | None = None, timeout: float | None = None) -> Any:
        """Run until the program finishes, max_steps more steps were taken, or timeout seconds passed.

        Returns the program's value when finished, else INCOMPLETE.  With a
        timeout, run() returns within about one leaf action (or one
        IDLE_SLICE of waiting) after it.  While every runnable leaf is a
        pending POPEN or SPAWN, run() sleeps on them instead of polling.
        """
        if self._watch is not None:
            return history.run(self, step_limit(self.steps, max_steps), deadline_after(timeout))
        return self._drive(step_limit(self.steps, max_steps), deadline_after(timeout), None, True)

    async def arun(self, max_steps: int | None = None, timeout: float | None = None,
                   steps_per_yield: int | None = None, yield_every: float = YIELD_EVERY) -> Any:
        """Drive the program from asyncio: ``await drv.arun()``.

        Gives the event loop control about every ``yield_every`` seconds (0.25 ms by default: other tasks
        run, and may inspect, save or stop the driver, between two steps), or after every
        ``steps_per_yield`` steps when that is given; a single leaf that runs longer holds the loop that
        long.  While every runnable leaf is a pending POPEN or SPAWN it awaits them, taking no CPU,
        instead of polling.  Returns as run() does; cancelling the task leaves the driver between two
        steps.

        >>> import asyncio
        >>> from flowvm import CALL, REPEAT, Registers
        >>> reg = Registers(n=0)
        >>> asyncio.run(REPEAT(3, CALL(lambda n: n + 1, reg('n'), store_to=reg('n'))).start().arun())
        3
        """
        import asyncio

        if steps_per_yield is not None and (isinstance(steps_per_yield, bool)
                                            or not isinstance(steps_per_yield, numbers.Integral)
                                            or steps_per_yield < 1):
            raise ValueError(f"steps_per_yield must be an int >= 1 or None, got {steps_per_yield!r}")
        if isinstance(yield_every, bool) or not isinstance(yield_every, numbers.Real) or not yield_every > 0:
            raise ValueError(f"yield_every must be a number of seconds > 0, got {yield_every!r}")
        limit = step_limit(self.steps, max_steps)
        deadline = deadline_after(timeout)
        idle = _Idle()
        while True:
            idle.stopped = False
            cap = limit if self._watch is None else min(limit, history.due_after(self))
            if steps_per_yield is None:  # a time slice, ending at the deadline at the latest
                end = monotonic() + yield_every
                self._drive(cap, end if deadline is None or end < deadline else deadline, idle, False)
            else:
                self._drive(min(cap, self.steps + steps_per_yield), deadline, idle, False)
            if self._watch is not None:
                history.record(self)
            if self.done:
                return self.result
            if self.steps >= limit or (deadline is not None and monotonic() >= deadline):
                return INCOMPLETE
            if idle.stopped:
                await idle.wait_async(self, deadline)
            else:
                await asyncio.sleep(0)

    def _drive(self, limit, deadline: float | None, idle: "_Idle | None", block: bool) -> Any:
        """The loop of run() and arun(): with block=False it returns instead of waiting on pending leaves."""
        try:  # (flowvm.machine.running finds a driver mid-step by this method's frame)
            while True:
                if self.steps >= limit and not self.done:
                    return INCOMPLETE  # checked first: run(max_steps=0) enters nothing
                if self._leaf is None and not self._prepare():
                    return self.result
                fast = self._fast
                if deadline is not None:
                    if monotonic() >= deadline:
                        return INCOMPLETE
                    # the fast paths look at the clock after every step: a step may take far longer than
                    # the last
                    if fast is not None and fast[REPEAT_I] + 1 < fast[REPEAT_N]:
                        repeat_leaf(self, fast, limit, deadline)
                        continue
                    if fast is None and self._fastseq is not None \
                            and repeat_seq(self, self._fastseq, limit, deadline):
                        continue
                    if self._woven is not None and repeat_woven(self, self._woven, limit, deadline):
                        continue
                elif fast is not None:
                    repeat_leaf(self, fast, limit)  # (it writes the frames back before an error leaves it)
                    if self.steps >= limit:
                        return INCOMPLETE
                elif self._fastseq is not None:
                    repeat_seq(self, self._fastseq, limit)
                    if self.steps >= limit:
                        return INCOMPLETE
                elif self._woven is not None and repeat_woven(self, self._woven, limit):
                    continue  # (if the turn passed to another child, the driver is settled into it)
                value = self._leaf()
                if value is PENDING:
                    key = id(self._stack[-1])
                    steps = self.steps
                    self._after_poll()
                    if idle is None:
                        idle = _Idle()
                    if idle.full_circle(key, steps):
                        if not block:
                            idle.stopped = True
                            return INCOMPLETE
                        idle.wait(self, deadline)
                else:
                    self._after_leaf(value)
        except Exception as err:  # the other place where a leaf's error gets its note
            raise self._running_error(err)

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

        history.watch(self, names, every, static_steps(self.program))
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
        state.pop("_leaf", None)
        state.pop("_fast", None)
        state.pop("_step_fast", None)
        state.pop("_fastseq", None)
        state.pop("_around", None)
        state.pop("_woven", None)
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
        self._leaf = self._fast = self._step_fast = self._fastseq = self._around = self._woven = None
        stack = self._stack
        if self._ready and stack and not stack[-1][ELEMENT].is_leaf:
            self._ready = False

    # ------------------------------------------------------- the run state, for tools
    # Other modules read and change the run through these, never through the underscore fields.
    def snapshot(self) -> RunState:
        """The run state as plain data, with the random states and settings of this moment (what a copy
        made now resumes with): for persistence (flowvm.persist)."""
        return RunState(steps=self.steps, done=self.done, result=self.result, frames=list(self._stack),
                        carry=self._carry, ready=self._ready, rotate=self._rotate, fresh=self._fresh,
                        history=self._watch, environment=self._resume_for_copy())

    def restore(self, state: RunState) -> "Driver":
        """Put a saved run state into this driver (one started on the same program, not yet stepped), and
        return it.  Its frames must hold this driver's elements (flowvm.persist checks them); a malformed
        history is a ValueError.  The environment, when given, is set at the next step."""
        if not isinstance(state, RunState):
            raise TypeError(f"restore expects a RunState (Driver.snapshot()), got {type(state).__name__}")
        if not (state.fresh is None or 0 <= state.fresh <= len(state.frames)):
            raise ValueError(f"fresh is {state.fresh!r:.40}, expected None or an int in [0, {len(state.frames)}]")
        self.steps, self.done, self.result = state.steps, state.done, state.result
        self._stack = list(state.frames)
        self._carry, self._ready, self._rotate, self._fresh = state.carry, state.ready, state.rotate, state.fresh
        self.__dict__.pop("_watch", None)
        history.adopt(self, state.history)
        self.invalidate()
        if state.environment is not None:
            self.saved_environment = state.environment
        return self

    @classmethod
    def from_snapshot(cls, program: Element, state: RunState) -> "Driver":
        """A driver of program holding the run state (see restore)."""
        return cls(program).restore(state)

    @property
    def frames(self) -> tuple:
        """The frames of the active elements, outermost first (read-only: flowvm.machine.frames writes them;
        ``frames.walk`` visits the paused ones too)."""
        return tuple(self._stack)

    @property
    def unstarted_from(self) -> int | None:
        """The index of the outermost frame that the last settle entered on its way to the next leaf and that
        has taken no step since (a hot patch treats them as not started); None when there is none."""
        return self._fresh if self._ready and not self.done else None

    @property
    def watched(self) -> dict | None:
        """The history's own plain data (``{"every", "auto", "names", "points"}``, flowvm.machine.history), kept
        up to date as the run goes (so a holder of it sees new points), or None when unwatched."""
        return self._watch

    def replace_frames(self, frames: list, program: Element | None = None) -> None:
        """For hot patches (flowvm.editing.hotpatch): the run goes on from these frames (the frame lists it
        keeps, written through flowvm.machine.frames) and, when given, this program.  The caches are dropped
        and the driver settles into its next leaf; a move that fails is raised by the next step."""
        self._stack[:] = frames
        if program is not None:
            self.program = program
        self.invalidate()
        self._fresh = None  # frame indices moved; a rewound driver settles again just below and sets it anew
        stack = self._stack
        untouched = self.steps == 0 and len(stack) == 1 and len(stack[0]) == 1
        if not self.done and not untouched:  # a driver fresh from start() still reads nothing until it steps
            try:
                self._prepare()
            except Exception:
                pass  # a move that fails is retried, and raised, by the next step

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

    # ------------------------------------------------------- copies and their process
    # What this driver sets when it takes its next step (see environment.py), or None:
    # {"random": global generator states or None, "settings": {name: value}, "announce": bool}.
    # A copy gets the states and settings of the moment it was made; a new driver the settings its
    # program declares (Element.with_process_settings).
    _resume: dict | None = None

    def _resume_for_copy(self) -> dict:
        pending = self._resume
        if pending is not None and pending["random"] is not None:
            return pending  # a copy that has not stepped yet: it stands for the run at that same moment
        settings = capture_settings()
        if pending is not None:
            settings.update(pending["settings"])  # what the next step would have set
        return {"random": capture_random(), "settings": settings, "announce": True}

    def resume_with(self, random: bool = True, settings: bool | dict = True) -> "Driver":
        """Choose what this driver sets in its process when it takes its next step.

        A copy of a run (pickle, cloudpickle, deepcopy, checkpoint) carries the states of the global random
        generators and the settings that change results (torch's thread count, deterministic algorithms,
        matmul precision, default dtype, cuDNN flags: see flowvm.base.environment) of the moment it was made,
        and sets them, saying which settings differed, when it takes its first step.  ``random=False``
        keeps this process's generator states; ``settings=False`` keeps this process's settings; a dict
        of settings (``{"torch.threads": 4}``) sets those instead of the saved ones.  Returns the driver.
        """
        pending = dict(self._resume or {"random": None, "settings": {}, "announce": True})
        if not random:
            pending["random"] = None
        if settings is False:
            pending["settings"] = {}
        elif isinstance(settings, dict):
            pending["settings"] = {**pending["settings"], **check_settings(settings, "<settings>")}
        elif settings is not True:
            raise TypeError(f"resume_with: settings must be True, False or a dict, got {settings!r}")
        self._resume = pending if pending["random"] is not None or pending["settings"] else None
        if self._resume is not None:
            self.invalidate()  # the next step goes through _prepare
        return self

    @property
    def saved_environment(self) -> dict | None:
        """What the next step sets (a copy's saved random states and settings), or None.  Set it (a dict
        ``{"random": states or None, "settings": {name: value}, "announce": bool}``, checked by the caller)
        to give a loaded run the environment it was saved with."""
        return self._resume

    @saved_environment.setter
    def saved_environment(self, environment: dict | None) -> None:
        if environment is not None:
            environment = {"random": environment.get("random"), "settings": dict(environment.get("settings") or {}),
                           "announce": bool(environment.get("announce", True))}
        self._resume = environment
        self.invalidate()  # the next step goes through _prepare

    def copy_environment(self) -> dict:
        """What a copy of the run made now resumes with: the global random states and the settings of this
        moment (or those a copy that has not stepped yet still stands for)."""
        return self._resume_for_copy()

    def _apply_resume(self) -> None:
        pending = self._resume
        if pending["random"] is not None:
            apply_random(pending["random"])
        apply_settings(pending["settings"], announce=pending["announce"])
        self._resume = None
        run_starts(self.program)

    def __reduce_ex__(self, protocol):
        # Whatever the outer pickler (pickle, cloudpickle, copy.deepcopy), the
        # half-run state is written by flowvm's own pickler (checkpoint.py), so
        # every copy keeps the same things: gradients, global generators, lambdas.
        # The driver is one self-contained unit: an object it shares with
        # something pickled beside it is copied, not shared.
        return tool("copy_driver")(self)

    # ----------------------------------------------------------------- engine
    def _prepare(self) -> bool:
        """Settle if needed and fill the caches for the next leaf; False when the program is finished."""
        if self._resume is not None:  # a copy's first step (or first run() once finished)
            self._apply_resume()
        if self.done:
            return False
        if not self._ready:
            settle(self)
            if self.done:
                return False
        stack = self._stack
        el = stack[-1][ELEMENT]
        around = None
        if self._weave:
            around = self._around = [fr for fr in stack if type(fr[ELEMENT]) is WEAVE] or None
        if type(el).simple_leaf:
            self._leaf = leaf_function(el, self.registers)
            if len(stack) > 1 and fastpaths.ENABLED:
                parent = stack[-2]
                kind = type(parent[ELEMENT])
                if kind is REPEAT:
                    if around is None:
                        self._fast = parent
                        if self._watch is None:  # a watched step records its history: the general path
                            self._step_fast = parent
                    else:
                        self._woven = (around, parent, None)
                elif kind is SEQ and len(stack) > 2 and type(stack[-3][ELEMENT]) is REPEAT \
                        and all(type(c).simple_leaf for c in parent[ELEMENT].elements):
                    if around is None:
                        self._fastseq = (stack[-3], parent)
                    else:
                        self._woven = (around, stack[-3], parent)
        else:
            self._leaf = el.bind(self, stack[-1])
        return True

    def _after_leaf(self, value: Any) -> None:
        stack = self._stack
        if len(stack) > 1 and fastpaths.ENABLED:
            fr = stack[-2]
            if type(fr[ELEMENT]) is SEQ:  # the next sibling is a plain leaf: move to it directly
                elements = fr[ELEMENT].elements
                pos = fr[SEQ_POS] + 1
                if pos < len(elements):
                    nxt = elements[pos]
                    if type(nxt).simple_leaf:
                        # what settling would do: the SEQ moves on (its children's values are dropped)
                        self.steps += 1
                        fr[SEQ_POS] = pos  # frames.seq_moved, written out (see step)
                        stack[-1] = [nxt]
                        self._leaf = self._fast = self._step_fast = self._fastseq = self._woven = self._fresh = None
                        if self._around is not None and take_turn(self, self._around):
                            self.settle_after_turn()  # the turn passed to another child of a WEAVE
                            return
                        try:
                            self._leaf = leaf_function(nxt, self.registers)
                        except Exception:  # retried, and raised, by the next step's _prepare
                            pass
                        return
        self.steps += 1
        self._fresh = None
        self._stack.pop()
        self._carry = value
        self._ready = False
        around = self._around  # the WEAVE frames around the leaf, found by _prepare
        self._leaf = self._fast = self._step_fast = self._fastseq = self._around = self._woven = None
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
        self._leaf = self._fast = self._step_fast = self._fastseq = self._around = self._woven = None
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
        return err

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


provide("start", Driver)  # Element.start()
# The drivers in the middle of a step in this context, innermost first, as a chain (driver, outer chain) ending
# in (): set by step() and by the loop of run() and arun(), read by flowvm.machine.running.
DRIVERS: "weakref.WeakSet[Driver]" = weakref.WeakSet()  # drivers started in this process (see flowvm.machine.running)


def run_starts(program: Element) -> None:
    """A run of program starts (a new driver, or a copy's first step): its leaves with a ``run_starts()``
    method start work ahead (a SPAWN, the default pool's workers); fragments inside leaves do not count."""
    for leaf in program._cached_subtree("run_starts", lambda: _starting_leaves(program)):
        leaf.run_starts()


def _starting_leaves(program: Element) -> list:
    found, todo = [], [program]
    while todo:
        el = todo.pop()
        if not el.is_leaf:
            todo.extend(el.children)
        elif getattr(el, "run_starts", None) is not None:
            found.append(el)
    return found


def _root_copy(program: Element) -> Element:
    """A new root object with the same fields and caches (compiled functions stay shared)."""
    root = object.__new__(type(program))
    root.__dict__.update(program.__dict__)
    if "_overrides" in root.__dict__:  # its own table: overrides set on the program later do not reach the run
        root.__dict__["_overrides"] = dict(root.__dict__["_overrides"])
    return root
