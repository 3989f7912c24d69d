"""What the driver does between two leaves: ``Engine``, a base class of ``Driver`` (driver.py).

``_prepare`` settles into the next leaf (frames.settle), makes its function and finds the frames the fast
paths use; ``_after_leaf`` and ``_after_poll`` count the step and move on; ``_running_error`` and ``_annotate`` give errors their note.  The fields these methods
keep are the Driver's (see its class docstring and docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

from ..base.errors import RegisterError, SwitchError
from ..base.tracebacks import user_traceback
from ..program.elements import REPEAT, SEQ, WEAVE
from ..program.paths import format_path
from . import fastpaths
from .compile import leaf_function
from .frames import ELEMENT, SEQ_POS, WEAVE_FINISHED, credit_weaves, settle, take_turn


def _weaves_around(stack: list) -> list | None:
    """The WEAVE frames on stack, outermost first (None: none)."""
    return [fr for fr in stack if fr[ELEMENT].frame_kind is WEAVE] or None


def _turn_per_step(around: list) -> bool:
    """Whether the WEAVE around a leaf (one, unweighted, with two or more children left) passes the turn at
    every step: the fast path would run one step at a time there, and the general path's step is shorter
    (bench_shapes, two nests in an unweighted WEAVE: 4.7 against 5.7 µs a step)."""
    return len(around) == 1 and around[0][ELEMENT].weights is None and around[0][WEAVE_FINISHED].count(False) > 1


class Engine:
    """The steps between leaves, for ``Driver``."""

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
        kind = type(parent[ELEMENT])
        if around is not None and _turn_per_step(around):
            return True
        if kind is REPEAT:
            if around is not None:
                self._woven = (around, parent, None)
            else:
                self._fast = parent
                if self._watch is None:  # a watched step records its history: the general path
                    self._step_fast = parent
        elif kind is SEQ and len(stack) > 2 and type(stack[-3][ELEMENT]) is REPEAT \
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
            if type(fr[ELEMENT]) is SEQ:  # the next sibling is a plain leaf: move to it directly
                elements = fr[ELEMENT].elements
                pos = fr[SEQ_POS] + 1
                if pos < len(elements) and type(elements[pos]).simple_leaf:
                    # what settling would do: the SEQ moves on (its children's values are dropped)
                    nxt = elements[pos]
                    self.steps += 1
                    fr[SEQ_POS] = pos  # frames.seq_moved, written out (see Driver.step)
                    stack[-1] = [nxt]
                    self._leaf = self._fast = self._step_fast = self._fastseq = self._woven = self._fresh = None
                    if self._around is not None and take_turn(self, self._around):
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

