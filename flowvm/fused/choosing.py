"""Choosing between a fused step's eager and compiled forms (form "auto"), a part of ``Runtime``
(flowvm/fused/runtime.py): once compiled code exists, executions alternate between the two forms and time
the *period* from one execution of the element to the next; after ``trials`` periods of each the faster by
median is kept (compiled only when faster by more than ``margin``), and measured again later.  A package from
the persistent cache comes with what an earlier run measured (``_adopt``): no trial."""

from __future__ import annotations

import statistics
import time

from . import cache

MIN_TRIAL_SECONDS = 0.02   # a trial times each form for at least this long (and ``trials`` executions)
RECHECK_FACTOR = 1         # the k-th decision is checked again after (executions timed) * 10**k more
MAX_RECHECKS = 3


class Choosing:
    def _trial(self, *args):
        now = time.perf_counter()
        last = self._last
        if last is not None:
            self.periods[last[1]].append(now - last[0])
        e, c = self.periods["eager"], self.periods["compiled"]
        if self._enough(e) and self._enough(c):
            self._decide(e[1:], c[1:])  # the first period of each form is a warm-up, left out
            self._last = None
            return self.current(*args)
        form = "compiled" if len(c) <= len(e) else "eager"
        self._last = (now, form)
        if form == "compiled":
            return self._compiled_call(*args)
        return self.eager(*args)

    def _enough(self, periods: list[float]) -> bool:
        n = len(periods) - 1
        return n >= self.settings.trials and (sum(periods) >= MIN_TRIAL_SECONDS or n >= 50 * self.settings.trials)

    def _decide(self, eager: list[float], compiled: list[float]) -> None:
        if self.state != "trial":  # the compile failed during the trial
            return
        me, mc = statistics.median(eager), statistics.median(compiled)
        self.measured = (mc, me)
        timing = f"compiled {microseconds(mc)} vs eager {microseconds(me)} per execution"
        self.trials_done += 1
        self.decision = f"{'compiled' if mc < me * (1 - self.settings.margin) else 'eager'}, measured {timing}"
        self._chosen = self._compiled_call if mc < me * (1 - self.settings.margin) else self.eager
        self.state = "compiled" if self._chosen == self._compiled_call else "eager"
        # decide again later, after ten times as many executions, in case the machine was busy this time
        self._executions = 0
        self._recheck_at = RECHECK_FACTOR * (len(eager) + len(compiled)) * 10 ** self.trials_done
        self.current = self._steady if self.trials_done <= MAX_RECHECKS else self._chosen
        decision = {"compiled": self.state == "compiled", "compiled_s": mc, "eager_s": me,
                    "periods": len(eager) + len(compiled)}
        if self._cache_key is not None:  # the next run takes the faster form at once (_adopt)
            cache.note(self._cache_key, decision)
        if self._hint is not None:  # and a short one that would run it eagerly need not look (_eager_by_hint)
            cache.note_hint(self._hint, decision)

    def _adopt(self, known: dict) -> None:
        """Take the form an earlier run measured faster with this cached package, from the first execution
        (no trial); it is measured again, as a decision made here is, after a hundred times as many
        executions as that run timed."""
        compiled = known["compiled"]
        self.measured = (known["compiled_s"], known["eager_s"])
        timing = f"compiled {microseconds(known['compiled_s'])} vs eager {microseconds(known['eager_s'])} per execution"
        self.decision = f"{'compiled' if compiled else 'eager'}, measured {timing} (by an earlier run)"
        self._chosen = self._compiled_call if compiled else self.eager
        self.state = "compiled" if compiled else "eager"
        self.trials_done = 2
        self._executions = 0
        self._recheck_at = RECHECK_FACTOR * max(int(known["periods"]), 2 * self.settings.trials) * 10 ** 2
        self.current = self._steady

    def _eager_by_hint(self, hint: str) -> bool:
        """Whether an earlier run measured a step of this hint faster eagerly and this run ends before it would
        measure it again (``_adopt``'s recheck, from the REPEATs' counts): then it runs eagerly at once,
        without pickling the step for its key or loading anything."""
        from ..machine.live import remaining_runs

        known = cache.hinted(hint)
        if known is None or known["compiled"]:
            return False
        left = remaining_runs()
        if left is None or left >= RECHECK_FACTOR * max(known["periods"], 2 * self.settings.trials) * 10 ** 2:
            return False
        self.measured = (known["compiled_s"], known["eager_s"])
        self.decision = (f"eager, measured compiled {microseconds(known['compiled_s'])} vs eager "
                         f"{microseconds(known['eager_s'])} per execution (by an earlier run)")
        self.state, self.current, self._chosen = "eager", self.eager, self.eager
        return True

    def _steady(self, *args):
        self._executions += 1
        if self._executions >= self._recheck_at:
            self.state, self.current = "trial", self._trial
            self.periods = {"eager": [], "compiled": []}
            return self._trial(*args)
        return self._chosen(*args)

    def status(self) -> str:
        text = self._status()
        if self._direct is not None and self.state in ("compiled", "trial", "eager"):
            changed = self._direct[3].changed()  # what the compiled form read, changed since: it runs eagerly
            if changed is not None:
                text += f"; eager while {changed}"
        if getattr(self, "eager_while", None) is not None and self.state in ("compiled", "trial"):
            text += f"; eager while {self.eager_while}"  # the thread's form's own checks (flowvm/fused/callcheck.py)
        return text

    def _status(self) -> str:
        s = self.settings
        if s.form == "eager":
            return "eager (forced)"
        if self.generated.head is None:
            return "eager, nothing to compile before the backward pass"
        if self.state == "new":
            return "not run yet"
        if self.state == "proving":
            return (f"eager; compiles once it has run {self.settings.compile_after:g} s "
                    f"({self._eager_seconds:.1f} s so far)")
        if self.state == "compiling":
            if self._job_pid is not None:  # an out-of-process compile under way
                return "compiling in the background (in another process), eager meanwhile"
            return "compiling in the background, eager meanwhile"
        if self.state == "trial":
            n = min(len(self.periods["eager"]), len(self.periods["compiled"]))
            done = max(n - 1, 0)
            if done < s.trials:
                return f"measuring compiled against eager ({done} of {s.trials} runs each)"
            return f"measuring compiled against eager ({done} runs each, until each form has run " \
                   f"{MIN_TRIAL_SECONDS:g} s)"
        if self.state == "compiled" and self.decision == "forced":
            return "compiled (forced)"
        return self.decision


def microseconds(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.1f} µs" if us < 10000 else f"{seconds * 1e3:.1f} ms"
