"""A driver's run state for tools (``RunState``, ``Driver.snapshot``/``restore``, ``replace_frames``) and the
environment a copy of a run resumes with (``resume_with``, ``saved_environment``): ``RunStateAccess``, a base
class of ``Driver`` (driver.py).  Other modules read and change a run through these, never through the
driver's underscore fields (tests/test_ownership.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..base.environment import apply_random, apply_settings, capture_random, capture_settings, check_settings
from ..base.sentinels import NOVALUE
from ..program.elements import Element
from . import metrics


@dataclass
class RunState:
    """A driver's run state as plain data (``Driver.snapshot()``, ``Driver.restore()``): what persistence
    saves and loads, without reaching into the driver.

    ``frames`` are the driver's own frame lists (flowvm.machine.frames), outermost first: read them, and
    hand new ones to ``restore``.  ``carry`` is the value in transit from a finished child to the frame on
    top (``NOVALUE`` when none); ``ready``: the driver sits just before its next leaf; ``rotate``: a WEAVE's
    turn is due at the next settle; ``fresh``: the index of the outermost frame that the last settle entered
    and that has taken no step since (None: the leaf alone); ``history``: the watched registers' points
    (flowvm.machine.metrics) or None; ``environment``: the global random states and settings a copy resumes
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


class RunStateAccess:
    """The run state and the resume environment, for ``Driver``."""

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
        metrics.adopt(self, state.history)
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
        """The history's own plain data (``{"every", "auto", "names", "points"}``, flowvm.machine.metrics), kept
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

    def copyable(self):
        """None when a copy of the run made now (pickle, cloudpickle, deepcopy, ``flowvm.save``, a state file)
        resumes exactly; else the ``CopyError`` such a copy raises, naming the register or frame at fault.

        A run between a forward pass and its backward holds a tensor whose autograd graph the backward
        needs, and an autograd graph cannot be copied (flowvm.base.autograd): step on, and copy once the
        backward has run.  The command's saves wait so themselves.  A finished run is always copyable.
        Costs about one pickling of the run, without its large arrays."""
        from ..program.elements import tool

        return None if self.done else tool("copy_problem")(self)

    def run_to_copyable(self, seconds: float = 20.0):
        """Step on until a copy of the run made now resumes exactly (``copyable()`` is None: the backward of
        a forward pass has run) or the run finishes, for at most ``seconds``; returns None then, or the
        CopyError still in the way.  The command's saves, a coordinated checkpoint and a cancelled
        ``arun()`` go through it."""
        from time import monotonic

        problem = self.copyable()
        t0, start, n = monotonic(), self.steps, 1
        while problem is not None and monotonic() - t0 < seconds:
            self.run(max_steps=n)
            n = n if self.steps - start < 16 else min(2 * n, 1024)  # checks cost a pickling of the run
            problem = self.copyable()
        return problem

    def settle_cancelled(self) -> None:
        """A cancelled ``arun()``: step on to a step a copy resumes from exactly (``run_to_copyable``), and say
        so in a CopyWarning when it had to (how many steps, how long) or could not."""
        import warnings
        from time import monotonic

        from ..base.errors import CopyWarning

        start, t0 = self.steps, monotonic()
        problem = self.run_to_copyable()
        took, waited = monotonic() - t0, self.steps - start
        if problem is not None:
            warnings.warn(f"arun() cancelled at step {self.steps}: a copy of the run would not resume exactly "
                          f"after {waited} more steps ({took:.1f} s): {problem}", CopyWarning, stacklevel=3)
        elif waited:
            warnings.warn(f"arun() cancelled at step {start} stopped at step {self.steps}: a register held an "
                          f"autograd graph a backward() still needed, and a copy resumes exactly only without "
                          f"one (waited {waited} step{'s' if waited != 1 else ''}, {took:.2f} s)", CopyWarning,
                          stacklevel=3)

    def copy_environment(self) -> dict:
        """What a copy of the run made now resumes with: the global random states and the settings of this
        moment (or those a copy that has not stepped yet still stands for)."""
        return self._resume_for_copy()

    def _apply_resume(self) -> None:
        pending = self._resume
        if pending["random"] is not None:
            apply_random(pending["random"], owner=self)
        apply_settings(pending["settings"], announce=pending["announce"], owner=self)
        self._resume = None
        run_starts(self.program)


# A save that nobody timed by hand (the command's, a coordinated checkpoint's) waits for a step the run resumes
# from exactly (Driver.copyable: no autograd graph a later backward needs) at most this long ($FLOWVM_SAVE_WAIT
# seconds); then the checkpoint is skipped (a periodic one) or not written (the last one).
WAIT_SECONDS = 20.0


def save_wait() -> float:
    """$FLOWVM_SAVE_WAIT, else WAIT_SECONDS."""
    try:
        return max(0.0, float(os.environ.get("FLOWVM_SAVE_WAIT", WAIT_SECONDS)))
    except ValueError:
        return WAIT_SECONDS


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
