"""Compiling a fused step in a child process with AOTInductor, so that the program's interpreter never runs
the compiler.

A compile on the background thread shares the program's interpreter: its imports, tracing and the
``compile()`` of generated code hold the GIL for up to 150 ms at a time, and the program stalls for that
long.  A head over plain CPU tensors (the *direct* form's kind, see ``compiler._direct_compile``) needs
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

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable

MAX_JOB_BYTES = 1 << 20   # a head whose pickle is larger carries data: it compiles on the thread
TIMEOUT = 900.0           # seconds; a compile running longer is stopped (and the step compiles on the thread)
PACKAGE = "step.pt2"
_children: set[subprocess.Popen] = set()
_children_lock = threading.Lock()
_workdirs: set[str] = set()
# compiles running at once: each takes a core and about 1 GB; the program keeps at least one core
_slots = threading.BoundedSemaphore(max(1, (os.cpu_count() or 2) - 1))


def _forget_after_fork() -> None:
    """A forked child owns none of its parent's compiles."""
    global _children_lock, _slots
    _children_lock = threading.Lock()
    _slots = threading.BoundedSemaphore(max(1, (os.cpu_count() or 2) - 1))
    _children.clear()
    _workdirs.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def plain_graph(gm: Any) -> str | None:
    """Why a graph traced by ``make_fx`` is not a plain tensor function (None when it is): its results are
    tensors computed from the inputs, with no input handed back, no in-place, view or random op."""
    import torch

    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = out_node.args[0]
    if not isinstance(results, (tuple, list)) or not all(
            isinstance(r, torch.fx.Node) and isinstance(r.meta.get("val"), torch.Tensor) for r in results):
        return "a result that is not a tensor"
    if any(r.op == "placeholder" for r in results):
        return "an input handed back as it is (aliased)"
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None or schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
            return f"{node.target}: in-place or view op"
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            return f"{node.target}: random numbers (inductor draws them differently from eager)"
    return None


def plain_tensor(a: Any) -> bool:
    """A dense tensor (not a subclass, sparse or nested) that needs no gradient and has no lazy negation
    or conjugation: what the direct form and a compiled package take."""
    import torch

    return (type(a) is torch.Tensor and a.layout is torch.strided and not a.is_nested and not a.requires_grad
            and not a.is_neg() and not a.is_conj())


def eligible(calls: Any, args: tuple) -> bool:
    """Whether a head with these calls and inputs may compile out of process: every input a plain CPU
    tensor needing no gradient, every function torch's own (a user's function may read tensors or settings
    of the program's process that the child would not see, or see as they were at import), and no tensor
    or module among the calls' constants (a compiled package would hold copies of them)."""
    import torch

    from ..program.registers import Register

    if not hasattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader") or getattr(sys, "frozen", False):
        return False  # a torch without AOTInductor packages; an application whose executable is not python
    if not args or not all(plain_tensor(a) and a.device.type == "cpu" for a in args):
        return False

    def holds_state(value: Any) -> bool:
        if isinstance(value, Register):
            return False
        if isinstance(value, (torch.Tensor, torch.nn.Module)):
            return True
        if isinstance(value, (list, tuple, set, frozenset)):
            return any(holds_state(v) for v in value)
        if isinstance(value, dict):
            return any(holds_state(k) or holds_state(v) for k, v in value.items())
        return False

    for call in calls:
        if not _torch_function(call.fn):
            return False
        if holds_state(list(call.args)) or holds_state(dict(call.kwargs)):
            return False
    return True


def _torch_function(fn: Any) -> bool:
    """A function of torch itself (``torch.sin``, ``torch.nn.functional.relu``, ``torch.Tensor.add``, an
    ``OpOverload``), not bound to an object: no state of the program's process behind it."""
    import types

    import torch

    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    if not isinstance(fn, (types.BuiltinFunctionType, types.FunctionType, types.MethodDescriptorType,
                           types.WrapperDescriptorType)):
        return False
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, types.ModuleType):
        return False  # a bound method: its object is state
    module = getattr(fn, "__module__", None) or getattr(owner, "__name__", None) or ""
    if isinstance(fn, (types.MethodDescriptorType, types.WrapperDescriptorType)):
        return getattr(fn, "__objclass__", None) in (torch.Tensor, torch._C.TensorBase)
    return module == "torch" or module.startswith(("torch.", "torch._C"))


def job_payload(head: Callable, args: tuple, options: dict) -> bytes:
    """The child's job: the head, its inputs' layouts, the compiler's options and the torch settings that
    change what the head computes (raises when the head does not pickle, or pickles with data)."""
    import cloudpickle
    import torch

    layouts = [(tuple(a.shape), tuple(a.stride()), a.dtype) for a in args]
    job = {"head": head, "layouts": layouts, "options": dict(options), "threads": torch.get_num_threads(),
           "default_dtype": torch.get_default_dtype(), "matmul_precision": torch.get_float32_matmul_precision(),
           "deterministic": torch.are_deterministic_algorithms_enabled()}
    payload = cloudpickle.dumps(job)
    if len(payload) > MAX_JOB_BYTES:
        raise ValueError(f"the fused step's pickle is {len(payload)} bytes (it carries data)")
    return payload


CHILD = "import sys; from flowvm.fused.outofprocess import main; sys.exit(main(sys.argv[1:]))"


class Compile:
    """One out-of-process compile under way.  ``on_done(run, error)`` is called on a waiter thread with the
    package's ``run`` (a list of input tensors to a list of output tensors) or with the reason it failed."""

    def __init__(self, head: Callable, args: tuple, options: dict, on_done: Callable[[Any, str | None], None]):
        self.payload = job_payload(head, args, options)  # raises when the head does not pickle: no compile
        self.on_done = on_done
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._run, name="flowvm-aot", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        run, error, workdir = None, "the compile process did not start", None
        try:
            workdir = tempfile.mkdtemp(prefix="flowvm-aot-")
            _workdirs.add(workdir)
            with open(os.path.join(workdir, "job.pkl"), "wb") as f:
                f.write(self.payload)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] +
                                                [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            with _slots:
                with _children_lock:
                    self.proc = subprocess.Popen([sys.executable, "-c", CHILD, workdir],
                                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, env=env)
                    _children.add(self.proc)
                try:
                    out, err = self.proc.communicate(timeout=TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    out, err = self.proc.communicate()
                    err += f"\ngave up after {TIMEOUT:g} s".encode()
                finally:
                    with _children_lock:
                        _children.discard(self.proc)
            package = os.path.join(workdir, PACKAGE)
            if self.proc.returncode == 0 and os.path.exists(package):
                import torch

                loader = torch._C._aoti.AOTIModelPackageLoader(package, "model", False, 1, -1)
                run, error = loader.run, None
            else:
                lines = out.decode(errors="replace").strip().splitlines()
                reason = json.loads(lines[-1]).get("refused") if lines and lines[-1].startswith("{") else None
                tail = err.decode(errors="replace").strip().splitlines()
                error = reason or (tail[-1] if tail else f"exit status {self.proc.returncode}")
        except BaseException as exc:  # noqa: B036 - anything at all: the step must not stay "compiling"
            run, error = None, f"{type(exc).__name__}: {exc}"
        finally:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
                _workdirs.discard(workdir)
            self.on_done(run, error)


@atexit.register
def _stop_children() -> None:
    """A program that ends leaves no compile running, and none of their files."""
    with _children_lock:
        for proc in list(_children):
            try:
                proc.kill()
                proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
    for workdir in list(_workdirs):
        shutil.rmtree(workdir, ignore_errors=True)


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        import time

        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    """The child: compile the job in directory argv[0] into an AOTInductor package there."""
    workdir = argv[0]
    _exit_with_parent()
    try:
        os.nice(10)  # the program comes first, also when it uses every core
    except (AttributeError, OSError):
        pass
    import pickle

    import torch

    with open(os.path.join(workdir, "job.pkl"), "rb") as f:
        job = pickle.load(f)
    torch.set_num_threads(job["threads"])
    torch.set_default_dtype(job["default_dtype"])
    torch.set_float32_matmul_precision(job["matmul_precision"])
    torch.use_deterministic_algorithms(job["deterministic"])
    head = job["head"]
    args = tuple(torch.empty_strided(shape, stride, dtype=dtype).zero_() for shape, stride, dtype in job["layouts"])
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        gm = make_fx(head, tracing_mode="fake")(*args)
    reason = plain_graph(gm)
    if reason is not None:
        print(json.dumps({"refused": reason}))
        return 3

    class Step(torch.nn.Module):
        def forward(self, *inputs):
            return head(*inputs)

    exported = torch.export.export(Step(), args, strict=False)
    torch._inductor.aoti_compile_and_package(exported, package_path=os.path.join(workdir, PACKAGE),
                                             inductor_configs=job["options"])
    print(json.dumps({"ok": True}))
    return 0

