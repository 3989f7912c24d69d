"""A fused step's compile on the compile thread (torch.compile, dynamo's guards), a part of ``Runtime``
(flowvm/fused/runtime.py).

``torch.compile`` compiles lazily, on the first call, and that call also runs the function.  To compile
without running anything, the compiler backend is wrapped: a call made by the warm-up thread gets as far as
the compiled graph and stops there with ``_WarmedUp``, before any tensor is computed, any input mutated or any
random number drawn."""

from __future__ import annotations

import functools
import threading
import time
from typing import Callable

from ..base.errors import WarmedUp as _WarmedUp
from . import torch_internals, resources
from .callcheck import CallCheck
from .codegen import barrier_index
from .effects import refused_dynamo_graph, refused_graph
from .refused import Refused
from .compiler import compiler_ready, direct_compile, inductor_after_tracing, backend_modules, submit_compile, program_waits
from .compiler import compile_seconds as compiler_seconds

compile_tls = threading.local()
run_only = torch_internals.run_only


class ThreadCompile:
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
        if background and not compiler_ready(backend_modules(self.settings.backend)):
            return
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        pos = self.generated.head_positions
        if pos is not None:
            args = tuple(args[k] for k in pos)

        if self._callcheck is None:  # the checks the compiled form runs before each call (flowvm/fused/callcheck.py)
            calls = self.el.calls if self.generated.tail is None else self.el.calls[:barrier_index(self.el.calls)]
            self._callcheck = CallCheck(calls, args, self.settings.backend)
        else:
            self._callcheck.add(args)
        short: list = []
        job = functools.partial(self._thread_job, args, grad, inference, background, short)
        self.compiles += 1
        self._waiting, self._job_running = False, True
        self._traced.clear()
        if not background:
            job()
        elif submit_compile(job, only_if_free=True):
            t0 = time.perf_counter()
            program_waits()
            self._traced.wait()
            self.paused_seconds.append(time.perf_counter() - t0)
        else:  # another compile took the thread first: try again at the next execution
            self.compiles -= 1
            self._waiting, self._job_running = True, False

    def _backend(self) -> Callable:
        """The backend given to torch.compile: the settings' backend, telling ``_traced`` when the
        real tensors have been read (see _start_compile), stopping the warm-up call before it runs
        anything, and counting the calls that enter the compiled code."""
        s = self.settings
        runtime = self
        traced_at_entry = True  # a backend given the graph reads no more real tensors ("eager", most callables)
        if callable(s.backend):
            inner = s.backend
        elif s.backend == "inductor":
            inner = inductor_after_tracing(s, self._traced, self._check_graph)
        else:
            inner = torch_internals.lookup_backend(s.backend)
        if s.backend == "inductor" or torch_internals.is_aot_backend(inner):
            # AOTAutograd reads the real inputs again (their .grad too) before compiling: inductor
            # tells when that is over; for other AOT backends the program waits for the whole compile
            traced_at_entry = False

        def flowvm_backend(gm, example_inputs):
            if traced_at_entry:
                runtime._traced.set()
            why = refused_dynamo_graph(gm)  # an assertion in code of yours, say
            if why is not None:
                raise Refused(why)
            with torch_internals.lowering_backward_now():  # the backward now, not at the first backward() later
                fn = inner(gm, example_inputs)

            def run(*a):
                if getattr(compile_tls, "warm", False):
                    raise _WarmedUp()
                runtime.hits += 1
                return fn(*a)

            return run

        return flowvm_backend

    def _check_graph(self, gm) -> None:
        """Each aten graph inductor is given: refuse an op that compiles to other values than eager's or
        that may be dropped (flowvm/fused/effects.py); note whether the step writes in place or draws random
        numbers (what a failed call must not repeat: flowvm/fused/callcheck.py)."""
        import torch

        why = refused_graph(gm)
        if why is not None:
            raise Refused(why)
        check = self._callcheck
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            schema = getattr(node.target, "_schema", None)
            if schema is not None and schema.is_mutable:
                check.writes = True
            if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
                check.draws = True

    def _thread_job(self, args: tuple, grad: bool, inference: bool, background: bool, short: list) -> None:
        """The compile thread's job: torch.compile the head and stop it at its graph (``_WarmedUp``), then the
        direct form when the head qualifies; a shortage of resources is noted in ``short`` (tried later)."""
        import torch

        start = time.perf_counter()
        compile_tls.warm = True
        try:
            if self._compiled is None:
                compiled = torch.compile(self.generated.head, backend=self._backend(), fullgraph=True,
                                         dynamic=self.settings.dynamic)
                self._runonly = run_only(self.generated.head)
                self._compiled = compiled
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), torch_internals.aten_graphs_seen():
                self._compiled(*args)
        except _WarmedUp:
            if self._direct is None:
                self._direct = direct_compile(self, args, inference)
        except Exception as err:  # a graph break, an unknown backend, a compiler error
            refused = _refusal(err)
            if refused is not None:  # the step holds what must not be compiled: eager, saying why
                err = refused
                self.refused = str(refused)
            if refused is None and background and resources.resource_error(err) and self._tries < resources.MAX_TRIES:
                short.append(err)  # no thread, process or memory left for now: not the step's failure
            else:
                self.error = err
        else:  # no graph to stop at: nothing was compiled (the function ran, with nothing to fuse)
            self.error = RuntimeError("torch.compile produced no graph for these calls")
        finally:
            compile_tls.warm = False
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


def _refusal(err: BaseException) -> Refused | None:
    """The ``Refused`` a compile error carries (dynamo wraps a backend's exceptions), or None."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, Refused):
            return err
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
        seen += 1
    return None
