"""Running a FUSED element: the generated function, its compiled form, and the choice between them.

Everything here is a cache of a FUSED element (``_c_runtime``): never
pickled, rebuilt on first use after loading.

The generated function takes the registers the fused calls read before
writing them and returns every register they write, then the last call's
value; each call is one source line, so an exception raised by the eager
form is traced back to the call that raised it.  When the calls include a
backward pass (``Tensor.backward``), only the calls before it (the *head*)
are compiled; the backward pass and anything after it run eagerly.

``torch.compile`` compiles lazily, on the first call, and that call also runs
the function.  To compile without running anything (in a background thread,
while the program goes on eagerly), the compiler backend is wrapped: a call
made by the warm-up thread gets as far as the compiled graph and stops there
with ``_WarmedUp``, before any tensor is computed, any input mutated or any
random number drawn.  The real calls then go through ``torch._dynamo.run``,
which uses the compiled code whose guards pass and otherwise runs the
function eagerly without compiling (a guard miss: new shapes, say).  A miss
is noticed (the graph was not entered) and starts another background
compile, up to ``max_compiles``.  A head over plain tensors with no autograd
also gets a *direct* form (``direct_compile``): inductor's graph called
without dynamo, behind flowvm's own layout check, since for a small step
dynamo's per-call guards cost more than the kernel.

Choosing (form "auto"): once compiled code exists, the executions alternate
between the two forms and time the *period* from one execution of the
element to the next, so the time of anything the form affects elsewhere
(the backward pass of a compiled forward, say) is counted.  After ``trials``
periods of each form the faster by median is kept (compiled only when it is
faster by more than ``margin``).  The decision shows in the element's header.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import replace
from typing import Any, Callable

from ..base.errors import FusionWarning
from ..machine.live import remaining_runs
from . import cache
from .choosing import MIN_TRIAL_SECONDS, Choosing, microseconds  # noqa: F401  (MIN_TRIAL_SECONDS: the trials' knob)
from .checks import collective
from .effects import refused_call
from .refused import Refused
from .codegen import generate, leaf_source
from .compiler import _direct_caller, compile_estimate, program_ran
from .packaged import Packaged
from .threadcompile import ThreadCompile, run_only, compile_tls  # noqa: F401


class Runtime(Choosing, Packaged, ThreadCompile):
    """The live state of one FUSED element: functions, compile jobs, timings, decision."""

    def __init__(self, el):
        self.el = el
        self.settings = el.settings
        gen = self.generated = generate(el)
        self.eager = gen.fused
        self._leaves: dict[int, tuple[dict, Callable]] = {}
        self.hits = 0                   # executions that entered compiled code
        self.compiles = 0               # compile jobs started
        self.compile_seconds: list[float] = []
        self.paused_seconds: list[float] = []  # how long the program waited for each trace (background)
        self.error: BaseException | None = None
        self.state = "eager" if self.settings.form == "eager" or gen.head is None else "new"
        self.decision = ""              # why the current form, for the header
        self.periods: dict[str, list[float]] = {"eager": [], "compiled": []}
        self._job_running = False
        self._job_done = False
        self._waiting = False           # a compile to start once the compile thread is free
        self._traced = threading.Event()  # set once the running job's tracing is over
        self._last: tuple[float, str] | None = None
        self.measured: tuple[float, float] | None = None  # (compiled, eager) median periods, seconds
        self.trials_done = 0
        self._executions = 0
        self._recheck_at = 0
        self._chosen: Callable = self.eager
        self._compiled: Callable | None = None
        self._runonly: Callable | None = None
        self._direct: tuple | None = None  # (input layouts, compiled graph, its bare callable, reads): direct_compile
        self.refused: str | None = None    # why the out-of-process compile did not give a graph (see _out_of_process)
        self._verify = False               # check the direct graph's first call against eager
        self._job_pid: int | None = None   # the process whose child compiles the step (_out_of_process)
        self.cached = False                # the package came from the persistent cache (flowvm/fused/cache.py)
        self._cache_key: str | None = None  # the package's entry there (evicted if it fails)
        self._known: dict | None = None     # what an earlier run measured of the cached package (_adopt)
        self._deferred: tuple | None = None  # (job, entry) of a cached package not loaded yet (_cached)
        self._tries = 0                    # compiles started again for lack of resources (_later)
        self._retry_at = 0.0               # time.monotonic() before which none starts again
        self._callcheck = None             # the thread's compiled form's own checks (flowvm/fused/callcheck.py)
        self.eager_while: str | None = None  # why the last call of the compiled form ran eagerly (callcheck)
        self._never: str | None = None     # why it is never compiled ("": nothing), once asked (_refused_now)
        self._hint: str | None = None      # the step's cache hint, once computed (jobs.hint)
        self.current: Callable = self.eager if self.state == "eager" else self._first

    # -- the leaf the driver calls
    def leaf(self, regs: dict) -> Callable[[], Any]:
        cached = self._leaves.get(id(regs))
        if cached is not None and cached[0] is regs:
            return cached[1]
        ns = {"R": regs, "rt": self}
        exec(compile(leaf_source(self.el), f"<flowvm FUSED leaf {id(self.el):x}>", "exec"), ns)
        self._leaves[id(regs)] = (regs, ns["leaf"])
        return ns["leaf"]

    # -- errors
    def annotate(self, err: BaseException) -> None:
        """Add a note naming the fused CALL that raised err (found from the traceback's line)."""
        index = None
        tb = err.__traceback__
        gen = self.generated
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == gen.filename:
                index = gen.line_of.get(tb.tb_lineno, index)
            tb = tb.tb_next
        if index is None:
            return
        from ..program.printer import call_text

        call = self.el.calls[index]
        origin = self.el.origins[index]
        err.add_note(f"flowvm: raised by CALL {call_text(call)}, call {index + 1} of {len(self.el.calls)} "
                     f"in a fused step (path '{origin or '<root>'}' before optimization)")

    # -- forms
    def _first(self, *args):
        """The first execution: start compiling (or compile now, when not in the background)."""
        st = self.settings
        if st.form != "eager" and self._from_cache(args):  # compiled already: no warm-up, nothing to repay
            return self._after_compile()(*args)
        if self._never or self.state == "eager":  # refused on the way (_refused_now), or eager by a hint's
            return self.eager(*args)  # decision (_eager_by_hint)
        self._checks_payback = st.background and st.form == "auto" and st.payback > 0 and st.backend == "inductor"
        self._remaining = remaining_runs() if self._checks_payback else None
        if st.background and st.form == "auto" and (st.compile_after > 0 or self._remaining is not None):
            self._eager_seconds = 0.0
            self._eager_runs = 0
            self.current = self._proving
            self.state = "proving"
            return self._proving(*args)
        return self._begin(*args)

    def _proving(self, *args):
        """Eager executions until the step has run compile_after seconds; then the compile starts, if the
        run has enough executions left to repay it (``payback``)."""
        t0 = time.perf_counter()
        out = self.eager(*args)
        self._eager_seconds += time.perf_counter() - t0
        self._eager_runs += 1
        if self._eager_seconds >= self.settings.compile_after:
            self.current = self._begin if self._repays() else self.eager
        return out

    def _repays(self) -> bool:
        """Whether the executions the run has left (known from its REPEATs) run long enough to repay a
        compile; if not, the step stays eager for good, saying why."""
        if self._remaining is None:
            return True
        left = self._remaining - self._eager_runs
        seconds_left = left * self._eager_seconds / max(self._eager_runs, 1)
        cost = compile_estimate(self.settings.backend)
        if seconds_left >= self.settings.payback * cost:
            return True
        self.state = "eager"
        self.decision = (f"eager: the run's {left} executions left (about {seconds_left:.2g} s) would not repay a "
                         f"compile (about {cost:.0f} s, payback {self.settings.payback:g}x)")
        return False

    def _refused_now(self) -> bool:
        """Whether the step must never be compiled (then it stays eager from now on, saying why): the ranks must
        run the same collectives (checks.collective), an assertion must not be dropped, an op must not compute
        other values (effects.refused_call).  Asked once, when a compile would start or a cached package be
        taken: a step that never gets that far pays nothing for the checks."""
        if self._never is None:
            self._never = collective(self.el.calls) or refused_call(self.el.calls) or ""
            if self._never:
                reason = self._never
                self.state, self.current, self.refused, self.decision = "eager", self.eager, reason, f"eager: {reason}"
        return bool(self._never)

    def _begin(self, *args):
        if self._refused_now():
            return self.eager(*args)
        self._start_compile(args)
        if not self.settings.background:
            return self._after_compile()(*args)
        self.current = self._warming
        self.state = "compiling"
        return self.eager(*args)

    def _warming(self, *args):
        if self._job_pid is not None and self._job_pid != os.getpid():
            self._orphaned()
        if self._waiting and time.monotonic() >= self._retry_at:
            self._start_compile(args)
        if self._job_done:
            return self._after_compile()(*args)
        program_ran()
        return self.eager(*args)

    def _after_compile(self) -> Callable:
        """Pick what runs once a compile job finished."""
        self._job_done = False
        if self._deferred is None:  # else loaded when the compiled form first runs
            self._install_direct()
        if isinstance(self.error, Refused):  # the graph holds what must not be compiled (flowvm/fused/effects.py)
            self.refused = str(self.error)
            self.state, self.current, self.decision = "eager", self.eager, f"eager: {self.refused}"
        elif self.error is not None:
            self.current = self._check_failure
        elif self.settings.form == "compiled":
            self.state, self.current, self.decision = "compiled", self._compiled_call, "forced"
        elif self._known is not None:
            self._adopt(self._known)
        else:
            self.state, self.current = "trial", self._trial
        return self.current

    def _check_failure(self, *args):
        """The compile failed: if the calls fail eagerly too, the error is the user's (raised, and the
        compile is tried again on a retry); else give up on compiling, with one warning."""
        try:
            out = self.eager(*args)
        except Exception:
            if self.compiles < self.settings.max_compiles:
                self.error, self.current, self.state = None, self._first, "new"
            raise
        self._give_up(self.error)
        return out

    def _give_up(self, err: BaseException) -> None:
        self.state, self.current = "failed", self.eager
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        self.decision = f"eager, compile failed ({reason[:100]})"
        from ..program.printer import call_text

        calls = "; ".join(call_text(c) for c in self.el.calls)
        warnings.warn(FusionWarning(f"flowvm: torch.compile failed for the fused step [{calls[:200]}]; it runs "
                                    f"eagerly from now on ({reason[:300]})"), stacklevel=4)

    def _compiled_call(self, *args):
        """The compiled form through dynamo's guards (inputs they reject run eagerly and get a compile
        of their own).  Once a direct graph exists, ``_install_direct`` shadows this method with a
        generated function that calls the graph and falls back here for other inputs."""
        if self._deferred is not None and not self._load_deferred():
            return self.eager(*args)  # the cached package did not load: the step compiles anew (_warming)
        if self._direct is not None and "_compiled_call" not in self.__dict__:
            return self._install_direct()(*args)
        if self._runonly is None:  # only a graph compiled out of process, for other layouts: eager, and a compile
            out = self.eager(*args)
            self._missed(args)
            return out
        return self._guarded_call(args)

    def _guarded_call(self, args: tuple):
        """A call through dynamo's guards, checked first (flowvm/fused/callcheck.py) where the step needs it."""
        hits = self.hits
        gen = self.generated
        pos = gen.head_positions
        head = args if pos is None else tuple(args[k] for k in pos)
        check = self._callcheck
        saved = None
        if check is not None:  # aliasing and modules as compiled (flowvm/fused/callcheck.py)
            why = check.why_not(head)
            if why is not None:
                self.eager_while = why
                return self.eager(*args)
            if self.eager_while is not None:
                self.eager_while = None
            saved = check.before(head)
        try:
            out = self._runonly(*head)
        except Exception as err:
            if self.hits == hits:  # ran eagerly (a guard miss): the user's own error
                raise
            return self._compiled_failed(err, saved, args)
        if self.hits == hits:
            self._missed(args)
        elif saved is not None and check.written is None:
            check.after(saved)
        return out if gen.tail is None else gen.tail(out, *args)

    def _compiled_failed(self, err: Exception, saved: tuple | None, args: tuple):
        """The compiled code raised: undo its writes and draws and run eagerly (an eager error is the user's),
        or, when they cannot be undone, raise its error as it is (running again would write twice)."""
        check = self._callcheck
        if check is not None and not check.undo(saved):
            err.add_note("flowvm: the compiled form of this fused step raised after writing in place; it is "
                         "not run again eagerly (that would repeat its writes)")
            raise err
        out = self.eager(*args)
        self._give_up(err)
        return out

    def _install_direct(self) -> Callable:
        """The compiled form to call: the direct graph's generated caller once there is a direct graph."""
        if self._direct is not None and "_compiled_call" not in self.__dict__:
            _, fn, bare, _ = self._direct
            first = self._verify or bare is not fn  # a first call to check, or a wrapper to run once
            self._compiled_call = _direct_caller(self, fn, first=first)
        return self._compiled_call

    def _direct_failed(self, err: BaseException, *args):
        """The direct graph raised: run these inputs eagerly (an eager error is the user's), and compile
        no more."""
        out = self.eager(*args)
        self._evict()
        self._give_up(err)
        return out

    def _evict(self) -> None:
        """The package failed or disagreed with eager: it leaves the persistent cache too."""
        if self._cache_key is not None:
            cache.evict(self._cache_key)
            self._cache_key = None

    def _reject_direct(self, reason: str, *args):
        """A graph compiled out of process gave another first result than eager (float rounding in a
        reduction can do that, as can a setting the child did not have): drop it; the thread compiles
        the step next (its dynamo guards see every setting).  These inputs run eagerly."""
        self.refused = reason
        self._direct = None
        self.__dict__.pop("_compiled_call", None)
        self.hits -= 1  # counted by the direct call
        self._compile_anew()
        return self.eager(*args)

    def _compile_anew(self) -> None:
        """The package at hand is gone (evicted from the cache): eager while the step compiles again (the
        next execution starts it, ``_warming``), then a trial of the new package."""
        self._evict()
        self.compiles -= 1
        self.periods, self._last = {"eager": [], "compiled": []}, None
        self._waiting = True
        self.state, self.current, self._chosen = "compiling", self._warming, self.eager

    def _missed(self, args) -> None:
        """The compiled code's guards rejected these inputs and they ran eagerly: compile for them too."""
        if self._job_running or self.compiles >= self.settings.max_compiles or self.error is not None:
            return
        self._start_compile(args)
        if not self.settings.background:
            self._job_done = False

    def force(self, form: str, example: tuple | None = None) -> None:
        """Use form ("eager" or "compiled") from now on in this process (set_form makes it part of the
        program instead).  "compiled" waits for a compile job in flight, or compiles now for the
        ``example`` inputs (a tuple of the fused step's input values) when nothing is compiled yet."""
        if form == "eager":
            self.state, self.current, self.decision = "eager", self.eager, "eager, forced at run time"
            return
        if form != "compiled":
            raise ValueError(f"force: form must be 'eager' or 'compiled', got {form!r}")
        if self._refused_now():
            raise RuntimeError(f"force('compiled'): the step stays eager: {self.refused}")
        while self._job_running:
            if self._job_pid is not None and self._job_pid != os.getpid():
                self._orphaned()
                break
            time.sleep(0.01)
        if self._deferred is not None:
            self._load_deferred()  # one that fails leaves nothing compiled: compiled now, from example
        if self.hits == 0 and self.compiles == 0:
            if example is None:
                raise ValueError("force('compiled'): nothing is compiled yet; pass example inputs or run a step first")
            settings, self.settings = self.settings, replace(self.settings, background=False)
            try:
                self._start_compile(tuple(example))
            finally:
                self.settings = settings
        if self.error is not None:
            raise RuntimeError(f"force('compiled'): the compile failed: {self.error}") from self.error
        self._job_done = False
        self.state, self.current, self.decision = "compiled", self._install_direct(), "compiled, forced at run time"
