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
also gets a *direct* form (``_direct_compile``): inductor's graph called
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
import statistics
import threading
import time
import warnings
from dataclasses import replace
from typing import Any, Callable


from ..base.errors import FusionWarning
from ..base.errors import WarmedUp as _WarmedUp
from ..machine.running import remaining_runs
from . import cache, jobs, outofprocess, resources
from .codegen import generate, leaf_source
from .compiler import (_compiler_ready, _direct_caller, _direct_compile, _inductor_after_tracing, _modules, _submit,
                       compile_estimate, program_ran, program_waits)
from .compiler import compile_seconds as compiler_seconds


MIN_TRIAL_SECONDS = 0.02   # a trial times each form for at least this long (and ``trials`` executions)
RECHECK_FACTOR = 1         # the k-th decision is checked again after (executions timed) * 10**k more
MAX_RECHECKS = 3


_tls = threading.local()


class Runtime:
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
        self._direct: tuple | None = None  # (input layouts, compiled graph, its bare callable, reads): _direct_compile
        self.refused: str | None = None    # why the out-of-process compile did not give a graph (see _out_of_process)
        self._verify = False               # check the direct graph's first call against eager
        self._job_pid: int | None = None   # the process whose child compiles the step (_out_of_process)
        self.cached = False                # the package came from the persistent cache (flowvm/fused/cache.py)
        self._cache_key: str | None = None  # the package's entry there (evicted if it fails)
        self._known: dict | None = None     # what an earlier run measured of the cached package (_adopt)
        self._tries = 0                    # compiles started again for lack of resources (_later)
        self._retry_at = 0.0               # time.monotonic() before which none starts again
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

    def _begin(self, *args):
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
        self._install_direct()
        if self.error is not None:
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
        if self._direct is not None and "_compiled_call" not in self.__dict__:
            return self._install_direct()(*args)
        if self._runonly is None:  # only a graph compiled out of process, for other layouts: eager, and a compile
            out = self.eager(*args)
            self._missed(args)
            return out
        hits = self.hits
        gen = self.generated
        pos = gen.head_positions
        try:
            out = self._runonly(*args) if pos is None else self._runonly(*[args[k] for k in pos])
        except Exception as err:
            if self.hits == hits:  # ran eagerly (a guard miss): the user's own error
                raise
            out = self.eager(*args)  # the compiled code failed; an eager error is the user's
            self._give_up(err)
            return out
        if self.hits == hits:
            self._missed(args)
        return out if gen.tail is None else gen.tail(out, *args)

    def _install_direct(self) -> Callable:
        """The compiled form to call: the direct graph's generated caller once there is a direct graph."""
        if self._direct is not None and "_compiled_call" not in self.__dict__:
            self._compiled_call = _direct_caller(self, self._direct[1], first=True)
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
        self._evict()
        self._direct = None
        self.__dict__.pop("_compiled_call", None)
        self.compiles -= 1
        self.hits -= 1  # counted by the direct call
        self.periods, self._last = {"eager": [], "compiled": []}, None
        self._waiting = True
        self.state, self.current, self._chosen = "compiling", self._warming, self.eager
        return self.eager(*args)

    def _missed(self, args) -> None:
        """The compiled code's guards rejected these inputs and they ran eagerly: compile for them too."""
        if self._job_running or self.compiles >= self.settings.max_compiles or self.error is not None:
            return
        self._start_compile(args)
        if not self.settings.background:
            self._job_done = False

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
        timing = f"compiled {_us(mc)} vs eager {_us(me)} per execution"
        self.trials_done += 1
        self.decision = f"{'compiled' if mc < me * (1 - self.settings.margin) else 'eager'}, measured {timing}"
        self._chosen = self._compiled_call if mc < me * (1 - self.settings.margin) else self.eager
        self.state = "compiled" if self._chosen == self._compiled_call else "eager"
        # decide again later, after ten times as many executions, in case the machine was busy this time
        self._executions = 0
        self._recheck_at = RECHECK_FACTOR * (len(eager) + len(compiled)) * 10 ** self.trials_done
        self.current = self._steady if self.trials_done <= MAX_RECHECKS else self._chosen
        if self._cache_key is not None:  # the next run takes the faster form at once (_adopt)
            cache.note(self._cache_key, {"compiled": self.state == "compiled", "compiled_s": mc, "eager_s": me,
                                         "periods": len(eager) + len(compiled)})

    def _adopt(self, known: dict) -> None:
        """Take the form an earlier run measured faster with this cached package, from the first execution
        (no trial); it is measured again, as a decision made here is, after a hundred times as many
        executions as that run timed."""
        compiled = known["compiled"]
        self.measured = (known["compiled_s"], known["eager_s"])
        timing = f"compiled {_us(known['compiled_s'])} vs eager {_us(known['eager_s'])} per execution"
        self.decision = f"{'compiled' if compiled else 'eager'}, measured {timing} (by an earlier run)"
        self._chosen = self._compiled_call if compiled else self.eager
        self.state = "compiled" if compiled else "eager"
        self.trials_done = 2
        self._executions = 0
        self._recheck_at = RECHECK_FACTOR * max(int(known["periods"]), 2 * self.settings.trials) * 10 ** 2
        self.current = self._steady

    def _steady(self, *args):
        self._executions += 1
        if self._executions >= self._recheck_at:
            self.state, self.current = "trial", self._trial
            self.periods = {"eager": [], "compiled": []}
            return self._trial(*args)
        return self._chosen(*args)

    def force(self, form: str, example: tuple | None = None) -> None:
        """Use form ("eager" or "compiled") from now on in this process (set_form makes it part of the
        program instead).  "compiled" waits for a compile job in flight, or compiles now for the
        ``example`` inputs (a tuple of the fused step's input values) when nothing is compiled yet."""
        if form == "eager":
            self.state, self.current, self.decision = "eager", self.eager, "eager, forced at run time"
            return
        if form != "compiled":
            raise ValueError(f"force: form must be 'eager' or 'compiled', got {form!r}")
        while self._job_running:
            if self._job_pid is not None and self._job_pid != os.getpid():
                self._orphaned()
                break
            time.sleep(0.01)
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

    # -- compiling
    def _start_compile(self, args) -> None:
        """Compile the head for these inputs, in the background thread unless settings say otherwise.

        Dynamo reads the real tensors while it traces (their shapes, their ``.grad``), and the
        autograd engine writes ``.grad`` without holding the GIL: tracing while the program goes on
        can crash the interpreter.  So a background compile starts only when the compile thread is
        free and its compiler modules are imported (else ``_waiting``: the next execution tries
        again), and the calling thread waits until tracing is over (dynamo hands the graph to the
        backend): a fraction of a second for a small step.  Lowering and compiling the graph, the
        slow part, works on fake tensors and runs while the program goes on."""
        try:
            import torch
        except ImportError as err:  # a function marked fusable, and no torch to compile it with
            self.compiles += 1
            self.error, self._job_done = err, True
            return
        background = self.settings.background
        if background and self._out_of_process(args):
            return
        self._waiting = background
        if background and not _compiler_ready(_modules(self.settings.backend)):
            return
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        pos = self.generated.head_positions
        if pos is not None:
            args = tuple(args[k] for k in pos)

        def job():
            start = time.perf_counter()
            _tls.warm = True
            try:
                if self._compiled is None:
                    compiled = torch.compile(self.generated.head, backend=self._backend(), fullgraph=True,
                                             dynamic=self.settings.dynamic)
                    self._runonly = _run_only(self.generated.head)
                    self._compiled = compiled
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    self._compiled(*args)
            except _WarmedUp:
                if self._direct is None:
                    self._direct = _direct_compile(self, args, inference)
            except Exception as err:  # a graph break, an unknown backend, a compiler error
                if background and resources.resource_error(err) and self._tries < resources.MAX_TRIES:
                    short.append(err)  # no thread, process or memory left for now: not the step's failure
                else:
                    self.error = err
            else:  # no graph to stop at: nothing was compiled (the function ran, with nothing to fuse)
                self.error = RuntimeError("torch.compile produced no graph for these calls")
            finally:
                _tls.warm = False
                self.compile_seconds.append(time.perf_counter() - start)
                if self.settings.backend == "inductor" and self.error is None and not short:
                    compiler_seconds.append(self.compile_seconds[-1])
                self._job_running = False
                if short:
                    self.compiles -= 1
                    self._later()
                else:
                    self._job_done = True
                self._traced.set()

        short: list = []

        self.compiles += 1
        self._waiting, self._job_running = False, True
        self._traced.clear()
        if not background:
            job()
        elif _submit(job, only_if_free=True):
            t0 = time.perf_counter()
            program_waits()
            self._traced.wait()
            self.paused_seconds.append(time.perf_counter() - t0)
        else:  # another compile took the thread first: try again at the next execution
            self.compiles -= 1
            self._waiting, self._job_running = True, False

    def _may_go_out_of_process(self) -> bool:
        import torch

        s = self.settings
        return not (s.compile_in != "process" or s.backend != "inductor" or s.mode not in (None, "default")
                    or s.dynamic or s.form == "eager" or self._direct is not None or self.refused is not None
                    or torch.is_inference_mode_enabled() or torch._C._is_any_autocast_enabled())

    def _out_of_process(self, args) -> bool:
        """Start compiling the head for these inputs in a child process (flowvm/fused/outofprocess.py), when
        the settings and the step allow it, or take its package from the cache; whether it did.  A refusal
        or failure there leaves the compile to the background thread: the next execution starts it."""
        if not self._may_go_out_of_process():
            return False
        try:
            return self._start_out_of_process(args)
        except Exception as err:  # an input torch cannot describe, say: the thread compiles
            self.refused = f"{type(err).__name__}: {err}"
            return False

    def _orphaned(self) -> None:
        """This process was forked from the one whose child process compiles the step: the result will
        never arrive here, so the thread compiles it."""
        self._job_pid = None
        if self._job_running:
            self._job_running = False
            self.refused = "the process forked while its compile ran"
            self.compiles -= 1
            self._waiting = True

    def _start_out_of_process(self, args) -> bool:
        job = jobs.describe(self.el, self.generated, self.settings.options, args)
        if isinstance(job, str):
            self.refused = job  # the reason it compiles on the thread
            return False
        if job.key is not None and self._cached(job):
            self._job_done = True  # the next execution runs it
            return True
        hint = jobs.hint(self.generated, self.settings.options, args) if job.key is not None else None
        start = time.perf_counter()

        def done(run, error):
            try:
                if run is not None:
                    self._direct = (job.layouts, run, run, job.reads)
                    self._verify = True  # the first call is checked against eager (_after_first_direct_call)
                    self._cache_key = job.key
                    if job.key is not None:
                        cache.add_hint(hint)
                    self.compile_seconds.append(time.perf_counter() - start)
                    compiler_seconds.append(self.compile_seconds[-1])
            finally:
                self._job_running, self._job_pid = False, None
                if run is not None:
                    self._job_done = True
                else:
                    self.refused = error or "no package"
                    self.compiles -= 1
                    self._waiting = True  # the next execution starts the thread's compile

        self.compiles += 1
        self._waiting, self._job_running, self._job_pid = False, True, os.getpid()
        try:
            outofprocess.Compile(job.payload, job.load, done, **({"key": job.key} if job.key else {}))
        except outofprocess.Busy:  # no thread for it now: the machine is short of resources, try later
            self.compiles -= 1
            self._job_running, self._job_pid = False, None
            self._later()
        return True

    def _cached(self, job: jobs.Job) -> bool:
        """Take the step's package from the persistent cache (flowvm/fused/cache.py), if it is there and loads;
        whether it did.  It is checked as a package just compiled is: before each call, and against eager on
        its first."""
        path = cache.lookup(job.key)
        if path is None:
            return False
        try:
            run = job.load(path)
        except Exception:  # damaged, or from a torch that writes what this one cannot read
            cache.evict(job.key)
            return False
        self.compiles += 1
        self._direct = (job.layouts, run, run, job.reads)
        self._verify, self._cache_key, self.cached = True, job.key, True
        self._known = cache.decision(path)
        return True

    def _from_cache(self, args) -> bool:
        """At the step's first execution: whether its package came from the persistent cache (then it runs
        compiled from now on, whatever ``compile_after`` and ``payback`` say: it costs no compile)."""
        if cache.root() is None or not self._may_go_out_of_process():
            return False
        try:
            if not cache.may_hold(jobs.hint(self.generated, self.settings.options, args)):
                return False  # never stored: no need to pickle the step for its key
            job = jobs.describe(self.el, self.generated, self.settings.options, args)
        except Exception:  # it does not pickle: the compile says why, in its time
            return False
        return not isinstance(job, str) and job.key is not None and self._cached(job)

    def _later(self) -> None:
        """The machine is short of resources (threads, memory): start this compile again after a while."""
        self._tries += 1
        self._retry_at = time.monotonic() + resources.backoff(self._tries)
        self._waiting = True

    def _backend(self) -> Callable:
        """The backend given to torch.compile: the settings' backend, telling ``_traced`` when the
        real tensors have been read (see _start_compile), stopping the warm-up call before it runs
        anything, and counting the calls that enter the compiled code."""
        import torch

        s = self.settings
        runtime = self
        traced_at_entry = True  # a backend given the graph reads no more real tensors ("eager", most callables)
        if callable(s.backend):
            inner = s.backend
        elif s.backend == "inductor":
            inner = _inductor_after_tracing(s, self._traced)
        else:
            inner = torch._dynamo.lookup_backend(s.backend)
        from torch._dynamo.backends.common import AotAutograd

        if s.backend == "inductor" or isinstance(inner, AotAutograd):
            # AOTAutograd reads the real inputs again (their .grad too) before compiling: inductor
            # tells when that is over; for other AOT backends the program waits for the whole compile
            traced_at_entry = False

        def flowvm_backend(gm, example_inputs):
            if traced_at_entry:
                runtime._traced.set()
            patch = getattr(torch._functorch.config, "force_non_lazy_backward_lowering", None)
            if patch is not None:  # compile the backward now, not on the first backward() in the main thread
                with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                    fn = inner(gm, example_inputs)
            else:  # pragma: no cover - older torch
                fn = inner(gm, example_inputs)

            def run(*a):
                if getattr(_tls, "warm", False):
                    raise _WarmedUp()
                runtime.hits += 1
                return fn(*a)

            return run

        return flowvm_backend

    # -- printing
    def status(self) -> str:
        text = self._status()
        if self._direct is not None and self.state in ("compiled", "trial", "eager"):
            changed = self._direct[3].changed()  # what the compiled form read, changed since: it runs eagerly
            if changed is not None:
                text += f"; eager while {changed}"
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


def _run_only(fn: Callable) -> Callable:
    """fn calling the code compiled for it when its guards pass, else running eagerly; never compiling.

    This is ``torch._dynamo.run(fn)`` without the checks its wrapper makes on every call (tracing,
    export, nested compiles: none apply to a step called by the driver), which cost about as much
    as a small compiled graph takes to run."""
    import torch

    try:
        from torch._C._dynamo.eval_frame import set_eval_frame
    except ImportError:  # pragma: no cover - another torch layout
        return torch._dynamo.run(fn)

    def run_only(*args):
        prior = set_eval_frame(False)  # False: run cached compiled code only (thread-local)
        try:
            return fn(*args)
        finally:
            set_eval_frame(prior)

    return run_only


def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.1f} µs" if us < 10000 else f"{seconds * 1e3:.1f} ms"
