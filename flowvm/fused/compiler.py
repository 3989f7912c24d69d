"""Compiling a FUSED element's generated function: the background compile thread, and the *direct* form
(inductor's graph called without dynamo, behind flowvm's own layout check).  See flowvm/fused/runtime.py."""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable


from . import torch_internals
from .codegen import barrier_index
from .isolation import isolate_random_state, isolate_tracing
from .checks import holds_state, mismatch, plain_graph, plain_tensor, torch_function

if TYPE_CHECKING:
    from .runtime import Runtime


# One daemon thread runs compile jobs, one at a time (dynamo compiles one frame at a time anyway).
# A job that traces starts only when the thread is free, and the thread that started it waits
# until dynamo has finished reading the real tensors (see Runtime._start_compile).
_jobs: "queue.Queue[Callable[[], None]]" = queue.Queue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()
_busy = 0                                  # jobs submitted and not finished
_imported: set[str] = set()                # compiler modules imported (by the worker or the program)
_import_queued: set[str] = set()


# The compile thread gives way to the program: after each RUN_SLICE seconds of running Python it sleeps
# PAUSE seconds (while the program is stepping), so that the program's thread, which takes the GIL back
# after each torch call, does not queue behind imports and compiler passes for a switch interval each time.
RUN_SLICE = 0.001
PAUSE = 0.003
_program_ran = [0.0]   # perf_counter() of the program's last execution of a fused step while compiling
_slice = [0.0]


def program_ran() -> None:
    """Called by a fused step running eagerly while its compile is under way: the program is stepping."""
    _program_ran[0] = time.perf_counter()


def program_waits() -> None:
    """The program waits for the compile thread (tracing): let it run at full speed."""
    _program_ran[0] = 0.0


class Stopped(BaseException):
    """Raised inside the compile thread's job when the program ends (see ``stop``): it unwinds the job."""


STOP_WAIT = 5.0  # seconds the program's end waits for the compile thread to unwind its job
_stopping = threading.Event()


def _pace(frame, event, arg) -> None:
    if _stopping.is_set():
        raise Stopped()  # unsets this hook: raised once, at the job's next call
    now = time.perf_counter()
    if now - _slice[0] >= RUN_SLICE:
        if now - _program_ran[0] < 0.1:  # the program stepped in the last 100 ms: give it the GIL for a while
            time.sleep(PAUSE)
        _slice[0] = time.perf_counter()


def _work() -> None:
    global _busy
    while not _stopping.is_set():
        job = _jobs.get()
        sys.setprofile(_pace)  # this thread only (set again for each job: raising Stopped unsets it)
        try:
            if not _stopping.is_set():
                job()
        except BaseException:  # pragma: no cover - a job records its own errors
            pass
        finally:
            sys.setprofile(None)
            with _worker_lock:
                _busy -= 1


def submit_compile(job: Callable[[], None], only_if_free: bool = False) -> bool:
    """Run job on the compile thread (a daemon: a short run never waits for it at exit, see ``stop``);
    with only_if_free, only when no other job is queued or running.  Whether it was submitted (not when the
    program is ending, nor when the thread cannot start: the caller tries again later)."""
    global _worker, _busy
    with _worker_lock:
        if _stopping.is_set() or only_if_free and _busy:
            return False
        if _worker is None or not _worker.is_alive():
            worker = threading.Thread(target=_work, name="flowvm-compile", daemon=True)
            isolate_tracing(worker)  # its tracing must not patch what the program's own calls do
            isolate_random_state(worker)  # nor set back the generators the program draws from
            try:
                worker.start()
            except RuntimeError:  # can't start new thread: the machine is short of resources for now
                return False
            _worker = worker
        _busy += 1
        _jobs.put(job)
    return True


def stop(wait: float = STOP_WAIT) -> None:
    """The program ends: the compile thread's job unwinds at its next Python call (``Stopped``, raised by
    its profile hook) and the thread ends, waited for up to ``wait`` seconds.

    A daemon thread still running when the interpreter finalizes is stopped where it next takes the GIL;
    inside a torch call that released it, that unwinds C++ code that may not be unwound, and the process
    aborts ("terminate called without an active exception") after the program's own work is done."""
    _stopping.set()
    worker = _worker
    if worker is None or not worker.is_alive() or worker is threading.current_thread():
        return
    _jobs.put(lambda: None)  # wakes an idle thread
    worker.join(wait)


def _at_exit(fn: Callable[[], None]) -> None:
    """Run fn when the program ends, before the interpreter waits for its threads (as concurrent.futures
    does), else with atexit."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError
        register(fn)
    except RuntimeError:  # pragma: no cover - another python, or already ending
        import atexit

        atexit.register(fn)


_at_exit(stop)


def backend_modules(backend: Any) -> tuple[str, ...]:
    """The compiler modules a compile for this backend imports (seconds, the first time)."""
    return ("torch._dynamo", "torch._inductor.compile_fx") if backend == "inductor" else ("torch._dynamo",)


# What a compile is expected to take, for deciding whether a run repays it (Runtime._repays): the first one
# in a process imports the compiler too; later ones take about as long as those before.
FIRST_COMPILE_SECONDS = {"inductor": 20.0}
compile_seconds: list[float] = []  # inductor compiles finished in this process


def compile_estimate(backend: Any) -> float:
    if compile_seconds:
        return sorted(compile_seconds)[len(compile_seconds) // 2]
    return FIRST_COMPILE_SECONDS.get(backend, 1.0) if isinstance(backend, str) else 1.0


def compiler_ready(names: tuple[str, ...]) -> bool:
    """Whether these modules are imported; if not, the compile thread imports them (queued once)."""
    if all(n in _imported for n in names):
        return True
    if not _import_queued.intersection(names) and all(n in sys.modules for n in names):
        _imported.update(names)  # imported by the program itself
        return True
    todo = [n for n in names if n not in _imported and n not in _import_queued]
    if todo:
        def job():
            import importlib

            for n in todo:
                try:
                    importlib.import_module(n)
                except Exception:  # the compile job itself reports it
                    pass
                _imported.add(n)

        _import_queued.update(todo)
        submit_compile(job)
    return False


def inductor_after_tracing(s, traced: threading.Event, check: Callable | None = None) -> Callable:
    """Inductor as torch.compile runs it (``mode``, ``options``, ``dynamic``), setting ``traced``
    when AOTAutograd hands its first graph (on fake tensors) to inductor's inner compiler, ``check(gm)``
    seeing each graph first."""
    return torch_internals.inductor_after_tracing(s.mode, dict(s.options), s.dynamic, traced, check)


def direct_compile(rt: Runtime, args: tuple, inference: bool) -> tuple | None:
    """For a head that only calls torch's own functions on plain tensors (no autograd, no modules, nothing
    mutated or aliased), inductor's compiled graph called directly, with no dynamo guards: (layouts, fn,
    bare callable or None, reads).

    The guard is flowvm's own: every input has the layout (type, dtype, device, shape, strides) it
    was compiled for and needs no gradient, and everything else the trace read (``reads``: the calls'
    mutable constants, the torch settings; flowvm/fused/reads.py) is as it was; anything else takes the
    dynamo path.  A function of the user's may read globals, closures or attributes that a trace would
    keep as constants: only dynamo's guards check those, so such a head has no direct form.  A small
    fused step spends more time in dynamo's guards and frame handling than in its kernel, so this is
    where compiling pays off for it.  None when the head does not qualify (or anything fails).
    """
    from .reads import Reads, Unchecked

    calls = _direct_calls(rt, args, inference)
    if calls is None:
        return None
    try:
        reads = Reads.capture(calls)  # now, as the trace reads them: the compile thread has the program's modes
    except Unchecked:
        return None
    try:
        gm = torch_internals.fake_trace(rt.generated.head, args)
        if plain_graph(gm) is not None:
            return None  # in-place, view or random ops, or results that are not new tensors: left to dynamo
        fn = torch_internals.inductor_graph(gm, list(args), dict(rt.settings.options))
    except Exception:
        return None
    layouts = tuple((type(a), a.dtype, a.device, a.shape, a.stride()) for a in args)
    return layouts, fn, _bare_callable(fn), reads


def _direct_calls(rt: Runtime, args: tuple, inference: bool) -> list | None:
    """The head's calls when the settings and inputs allow a direct form and every call is one of torch's
    own functions holding no state; None otherwise."""
    s = rt.settings
    if s.backend != "inductor" or s.mode not in (None, "default") or s.dynamic or inference:
        return None
    if not args or not all(plain_tensor(a) for a in args):
        return None
    calls = rt.el.calls if rt.generated.tail is None else rt.el.calls[:barrier_index(rt.el.calls)]
    for call in calls:
        if not torch_function(call.fn) or holds_state(list(call.args)) or holds_state(dict(call.kwargs)):
            return None
    return calls


def _bare_callable(fn) -> Callable | None:
    """On the CPU the graph's wrapper only adds bookkeeping (profiler labels, GPU autotune caches) around
    its generated callable: after one call through the wrapper, _compiled_call calls that directly."""
    call = getattr(fn, "current_callable", None)
    if call is None or not set(getattr(fn, "device_types", None) or ()) <= {"cpu"}:
        return None
    return call


def _direct_caller(rt: Runtime, kernel: Callable, first: bool) -> Callable:
    """The compiled form with a direct graph: ``Runtime._compiled_call`` specialised to it, generated
    with the layout check unrolled (a small step's time is mostly such overhead).  Installed as the
    runtime's ``_compiled_call``; inputs failing the check take the general method.  With first,
    the graph's wrapper runs once and then its bare callable replaces it (see direct_compile)."""
    import torch

    layouts, reads = rt._direct[0], rt._direct[3]
    gen = rt.generated
    n = len(rt.el.inputs)
    params = [f"a{k}" for k in range(n)]
    head = params if gen.head_positions is None else [params[k] for k in gen.head_positions]
    ns: dict[str, Any] = {"rt": rt, "kernel": kernel, "tail": gen.tail, "general": type(rt)._compiled_call,
                          "after_first": _after_first_direct_call, "strided": torch.strided}
    checks = []
    for k, (name, (cls, dtype, device, shape, stride)) in enumerate(zip(head, layouts)):
        ns.update({f"c{k}": cls, f"d{k}": dtype, f"s{k}": shape, f"t{k}": stride, f"v{k}": device})
        where = f"{name}.is_cpu" if device == torch.device("cpu") else f"{name}.device == v{k}"
        lazy = f"not {name}.is_neg()" + (f" and not {name}.is_conj()" if dtype.is_complex else "")
        checks.append(f"type({name}) is c{k} and {name}.dtype is d{k} and not {name}.requires_grad "
                      f"and {name}.shape == s{k} and {name}.stride() == t{k} and {where} "
                      f"and {name}.layout is strided and {lazy}")
    # the torch settings (autocast, the default dtype...) and the calls' mutable constants as compiled
    checks += reads.source(ns)
    stateful = getattr(kernel, "ready", None) is not None  # flowvm/fused/stateful.py: modules' state too
    if stateful:
        ns["ready"] = kernel.ready
        checks.append("(S := ready()) is not None")
    args = ", ".join(params)
    result = "out" if gen.tail is None else f"tail(out, {args})"
    lines = [
        f"def compiled_call({args}):",
        f"    if {' and '.join(checks) or 'True'}:",
        "        rt.hits += 1",
        "        try:",
        f"            out = kernel({'S, ' if stateful else ''}[{', '.join(head)}])",
        "        except Exception as err:",
        f"            return rt._direct_failed(err, {args})",
    ]
    lines.append(f"        return after_first(rt, compiled_call, out, {args})" if first else f"        return {result}")
    lines.append(f"    return general(rt, {args})")
    exec(compile("\n".join(lines) + "\n", f"<flowvm FUSED direct {id(rt.el):x}>", "exec"), ns)
    return ns["compiled_call"]


def _after_first_direct_call(rt: Runtime, old: Callable, out: Any, *args: Any) -> Any:
    """The step's result after the graph's wrapper ran once (out: the graph's); from now on its bare
    callable runs (when it has one).  A graph compiled elsewhere (flowvm/fused/outofprocess.py) is checked
    against eager on this first call: the same types, dtypes and shapes, values equal to float rounding;
    else it is dropped and the step compiles on the thread (Runtime._reject_direct)."""
    if rt._verify:
        rt._verify = False
        kernel = rt._direct[1]
        if hasattr(kernel, "verify"):  # a step with modules (flowvm/fused/stateful.py)
            wrong = kernel.verify(out, lambda: rt.generated.head(*_head_args(rt, args)))
        else:
            wrong = mismatch(out, rt.generated.head(*_head_args(rt, args)))
        if wrong is not None:
            return rt._reject_direct(f"its first result differs from eager's ({wrong})", *args)
    _install_bare(rt, old)
    tail = rt.generated.tail
    return out if tail is None else tail(out, *args)


def _head_args(rt: Runtime, args: tuple) -> tuple:
    pos = rt.generated.head_positions
    return args if pos is None else tuple(args[k] for k in pos)


def _install_bare(rt: Runtime, old: Callable) -> None:
    _, fn, bare, _ = rt._direct
    new = _direct_caller(rt, bare if bare is not None else fn, first=False)
    rt._compiled_call = new
    if rt.current is old:
        rt.current = new
    if rt._chosen is old:
        rt._chosen = new


