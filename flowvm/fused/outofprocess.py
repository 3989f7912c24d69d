"""Compiling a fused step in a child process with AOTInductor, so that the program's interpreter never runs
the compiler.

A compile on the background thread shares the program's interpreter: its imports, tracing and the
``compile()`` of generated code hold the GIL for up to 150 ms at a time, and the program stalls for that
long.  A head over plain CPU tensors (the *direct* form's kind, see ``compiler.direct_compile``) needs
nothing from the program's process but its function and its inputs' layouts, so it compiles elsewhere:

- the parent pickles the head function (cloudpickle) and its inputs' layouts, never their values;
- a child python process running ``main`` (at a lower CPU priority, exiting if the parent dies) traces it on zero tensors of those layouts, checks the graph as the direct form does
  (``plain_graph``), exports it and writes an AOTInductor package;
- the parent loads the package with torch's C++ loader (a few milliseconds: neither dynamo nor inductor
  is imported in the program's process) and calls it behind the direct form's layout check.

Anything the child refuses or fails at (a graph that is not plain, a function that does not pickle, a
compiler error) sends the step to the background thread's compile instead, which reports real errors as
before.  ``FuseSettings.compile_in = "thread"`` keeps every compile on the thread.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from . import checks, torch_internals, resources
from .refused import Refused
from .checks import aoti_available, holds_state, plain_graph, plain_tensor, settings, torch_function
from .compiler import _at_exit

TIMEOUT = 900.0           # seconds; a compile running longer is stopped (and the step compiles on the thread)
# A child at the idle priority gets no CPU while the machine is busy: one that got less than STARVE_SHARE of a
# core over STARVE_SECONDS (where its CPU time can be read) is stopped, and the step compiles on the thread.
STARVE_SECONDS = float(os.environ.get("FLOWVM_COMPILE_STARVE", "60"))
STARVE_SHARE = 0.05
POLL = 1.0
EXIT_WAIT = 5.0           # seconds the program's end waits for the compiles' threads once their children are stopped
PACKAGE = "step.pt2"
LIBRARY = "step.so"        # the package's library alone, when that is all it needs (torch_internals.aoti_library)
JOB = "job.pkl"
RETRY = 4                 # the child's exit status when it was short of resources (tried again later)
_children: set[subprocess.Popen] = set()
_children_lock = threading.Lock()
_workdirs: set[str] = set()
_compiles: set["Compile"] = set()   # under way (their threads), for the program's end
_stopping = threading.Event()       # the program is ending: no compile starts


def _forget_after_fork() -> None:
    """A forked child owns none of its parent's compiles."""
    global _children_lock, _stopping
    _children_lock = threading.Lock()
    _stopping = threading.Event()
    _children.clear()
    _workdirs.clear()
    _compiles.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def eligible(calls: Any, args: tuple) -> bool:
    """Whether a head with these calls and inputs may compile out of process as a plain function: every
    input a plain CPU tensor needing no gradient, every function torch's own (a user's function may read
    tensors or settings of the program's process that the child would not see, or see as they were at
    import), and no tensor or module among the calls' constants (a compiled package would hold copies of
    them).  Steps calling modules are the stateful kind (flowvm/fused/stateful.py)."""
    if not aoti_available():
        return False
    if not args or not all(plain_tensor(a) and a.device.type == "cpu" for a in args):
        return False
    for call in calls:
        if not torch_function(call.fn):
            return False
        if holds_state(list(call.args)) or holds_state(dict(call.kwargs)):
            return False
    return True


def job_payload(head: Callable, args: tuple, options: dict) -> bytes:
    """The child's job: the head, its inputs' layouts, the compiler's options and the torch settings that
    change what the head computes (raises when the head does not pickle, or pickles with data)."""
    import cloudpickle

    layouts = [(tuple(a.shape), tuple(a.stride()), a.dtype) for a in args]
    job = {"kind": "plain", "head": head, "layouts": layouts, "options": dict(options), **settings()}
    return cloudpickle.dumps(job)


def sized(payload: bytes) -> bytes:
    """The job, unless its pickle is so large that it carries data (raises)."""
    if len(payload) > checks.MAX_JOB_BYTES:
        raise ValueError(f"the fused step's pickle is {len(payload)} bytes (it carries data)")
    return payload


def _kept(names: list[str]) -> list[str]:
    """The files of a compile's work directory that the cache keeps: the library alone where there is one."""
    skip = {JOB, PACKAGE} if LIBRARY in names else {JOB}
    return sorted(n for n in names if n not in skip)


def load_plain(workdir: str) -> Callable:
    """The package of a plain job: a list of input tensors to a list of output tensors."""
    library = os.path.join(workdir, LIBRARY)
    if os.path.exists(library):
        return torch_internals.aoti_runner(library).run
    return torch_internals.aoti_loader(os.path.join(workdir, PACKAGE)).run


CHILD = "import sys; from flowvm.fused.outofprocess import main; sys.exit(main(sys.argv[1:]))"


class Busy(Exception):
    """No thread could be started for a compile now (the machine is short of resources): try again later."""


class Compile:
    """One out-of-process compile of a job (``job_payload``, ``stateful.payload``) under way.  ``on_done(run,
    error)`` is called on a waiter thread with what ``load(workdir)`` made of the child's files, or with the
    reason it failed.  With a cache key, the files go to the cache (flowvm/fused/cache.py) once they load.

    The child starts once a machine-wide slot is free (flowvm/fused/resources.py).  A child or a start short
    of resources (no thread, process or memory left) is tried again later, up to ``resources.MAX_TRIES``
    times; ``tries`` counts them.  Raises Busy when no waiter thread can start."""

    def __init__(self, payload: bytes, load: Callable[[str], Any], on_done: Callable[[Any, str | None], None],
                 key: str | None = None):
        self.payload = payload
        self.load = load
        self.on_done = on_done
        self.key = key
        self.tries = 0
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._run, name="flowvm-aot", daemon=True)
        with _children_lock:
            _compiles.add(self)
        try:
            self.thread.start()
        except RuntimeError as err:  # can't start new thread
            with _children_lock:
                _compiles.discard(self)
            raise Busy(str(err)) from err

    def _run(self) -> None:
        run, error = None, "the compile process did not start"
        try:
            resources.sweep()  # the files of programs killed while they compiled
            while True:
                self.tries += 1
                try:
                    run, error, again = self._attempt()
                except resources.Stopped:
                    run, error, again = None, "the program ended", False
                except Exception as exc:
                    if not resources.resource_error(exc):
                        raise
                    run, error, again = None, f"{type(exc).__name__}: {exc}", True
                if not again:
                    break
                if self.tries >= resources.MAX_TRIES:
                    error = f"short of resources {self.tries} times ({error})"
                    break
                if _stopping.wait(resources.backoff(self.tries)):
                    error = "the program ended"
                    break
        except BaseException as exc:  # noqa: B036 - anything at all: the step must not stay "compiling"
            run, error = None, f"{type(exc).__name__}: {exc}"
        finally:
            try:
                self.on_done(run, error)
            finally:
                with _children_lock:
                    _compiles.discard(self)

    def _attempt(self) -> tuple[Any, str | None, bool]:
        """One try: (what load made of the package, why there is none, whether to try again later)."""
        with resources.slot(_stopping.is_set) as fd:
            workdir = resources.workdir()
            _workdirs.add(workdir)
            try:
                with open(os.path.join(workdir, JOB), "wb") as f:
                    f.write(self.payload)
                out, err, code, timed_out = self._child(workdir, fd)
                if code == 0:
                    run = self.load(workdir)
                    if self.key is not None:
                        from . import cache

                        cache.store(self.key, workdir, _kept(os.listdir(workdir)))
                    return run, None, False
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
                _workdirs.discard(workdir)
        lines = out.decode(errors="replace").strip().splitlines()
        said = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
        if "retry" in said:
            return None, said["retry"], True
        if code == -9 and not timed_out and not _stopping.is_set():  # killed from outside: out of memory?
            return None, "the compile process was killed (out of memory?)", True
        tail = err.decode(errors="replace").strip().splitlines()
        return None, said.get("refused") or (tail[-1] if tail else f"exit status {code}"), False

    def _child(self, workdir: str, fd: int | None) -> tuple[bytes, bytes, int, bool]:
        """Run the child on workdir, holding the slot's lock with it: (stdout, stderr, exit status, timed out)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] +
                                            [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        with _children_lock:
            if _stopping.is_set():
                raise resources.Stopped()
            self.proc = subprocess.Popen([sys.executable, "-c", CHILD, workdir], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                         pass_fds=() if fd is None else (fd,))
            _children.add(self.proc)
        try:
            out, err, why = _wait(self.proc)
        finally:
            with _children_lock:
                _children.discard(self.proc)
        if why is not None:
            err += f"\n{why}".encode()
        return out, err, self.proc.returncode, why is not None


def _wait(proc: subprocess.Popen) -> tuple[bytes, bytes, str | None]:
    """The child's output once it exits, or once it is stopped: after TIMEOUT, or when it starves (less than
    STARVE_SHARE of a core over STARVE_SECONDS).  (stdout, stderr, why it was stopped or None)."""
    start = window = time.monotonic()
    used = cpu_seconds(proc.pid)
    while True:
        try:
            out, err = proc.communicate(timeout=POLL)
            return out, err, None
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        why = f"gave up after {TIMEOUT:g} s" if now - start >= TIMEOUT else None
        if why is None and STARVE_SECONDS > 0 and now - window >= STARVE_SECONDS:
            cpu = cpu_seconds(proc.pid)
            if cpu is not None and used is not None and cpu - used < STARVE_SHARE * (now - window):
                why = (f"the compile process got {cpu - used:.1f} s of CPU in {now - window:.0f} s (a busy machine); "
                       f"the step compiles on the thread")
            window, used = now, cpu
        if why is not None:
            proc.kill()
            out, err = proc.communicate()
            return out, err, why


def cpu_seconds(pid: int) -> float | None:
    """The CPU time a process has used (user and system), where /proc tells it; else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def stop(wait: float = EXIT_WAIT) -> None:
    """The program ends: no compile starts, those running are stopped and their threads waited for (a
    thread loading a package when the interpreter finalizes could abort the process, see
    ``compiler.stop``), and their files removed."""
    _stopping.set()
    with _children_lock:
        procs, compiles = list(_children), list(_compiles)
    for proc in procs:
        try:
            proc.kill()
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass
    deadline = time.monotonic() + wait
    for c in compiles:
        if c.thread is not threading.current_thread() and c.thread.ident is not None:
            c.thread.join(max(0.0, deadline - time.monotonic()))
    for workdir in list(_workdirs):
        shutil.rmtree(workdir, ignore_errors=True)


_at_exit(stop)


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    """The child: compile the job in directory argv[0] into an AOTInductor package there, at the lowest CPU
    priority (the program comes first, also when it uses every core).  Exit status 0: done; 3: refused
    (the reason on stdout); RETRY: short of resources (threads, processes, memory), to be tried later."""
    workdir = argv[0]
    _exit_with_parent()
    resources.lowest_priority()
    try:
        return _compile(workdir)
    except Exception as exc:
        if not resources.resource_error(exc):
            raise
        print(json.dumps({"retry": f"{type(exc).__name__}: {exc}"[:500]}), flush=True)
        return RETRY


def _compile(workdir: str) -> int:
    import pickle

    import torch

    with open(os.path.join(workdir, JOB), "rb") as f:
        job = pickle.load(f)
    torch.set_num_threads(job["threads"])
    torch.set_default_dtype(job["default_dtype"])
    torch.set_float32_matmul_precision(job["matmul_precision"])
    torch.use_deterministic_algorithms(job["deterministic"])
    if job["kind"] == "stateful":
        from .childcompile import compile_job

        try:
            compile_job(job, workdir)
        except Refused as why:
            print(json.dumps({"refused": str(why)}))
            return 3
        print(json.dumps({"ok": True}))
        return 0
    head = job["head"]
    args = tuple(torch.empty_strided(shape, stride, dtype=dtype).zero_() for shape, stride, dtype in job["layouts"])
    gm = torch_internals.fake_trace(head, args)
    reason = plain_graph(gm)
    if reason is not None:
        print(json.dumps({"refused": reason}))
        return 3

    class Step(torch.nn.Module):
        def forward(self, *inputs):
            return head(*inputs)

    torch_internals.aoti_package(Step(), args, os.path.join(workdir, PACKAGE), job["options"])
    torch_internals.aoti_library(os.path.join(workdir, PACKAGE), os.path.join(workdir, LIBRARY))
    print(json.dumps({"ok": True}))
    return 0

