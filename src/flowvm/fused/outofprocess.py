"""Compiling a fused step in a child process with AOTInductor, so that the program's interpreter never runs
the compiler.

A compile on the background thread shares the program's interpreter: its imports, tracing and the
``compile()`` of generated code hold the GIL for up to 150 ms at a time, and the program stalls for that
long.  A head over plain CPU tensors (the *direct* form's kind, see ``compiler._direct_compile``) needs
nothing from the program's process but its function and its inputs' layouts, so it compiles elsewhere:

- the parent pickles the head function (cloudpickle) and its inputs' layouts, never their values;
- a child ``python -m flowvm.fused.outofprocess DIR`` (at a lower CPU priority, exiting if the parent
  dies) traces it on zero tensors of those layouts, checks the graph as the direct form does
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
PACKAGE = "step.pt2"
_children: set[subprocess.Popen] = set()
_children_lock = threading.Lock()
# compiles running at once: each takes a core and about 1 GB; the program keeps at least one core
_slots = threading.BoundedSemaphore(max(1, (os.cpu_count() or 2) - 1))


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


def eligible(calls: Any, args: tuple) -> bool:
    """Whether a head with these calls and inputs may compile out of process: every input a plain CPU
    tensor needing no gradient, and no module and no tensor among the calls' functions and constants (a
    compiled package would hold copies of them)."""
    import torch

    from ..program.registers import Register

    if not hasattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader"):
        return False  # a torch without AOTInductor packages
    if not args or not all(type(a) is torch.Tensor and not a.requires_grad and a.device.type == "cpu"
                           for a in args):
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
        owner = getattr(call.fn, "__self__", None)
        if isinstance(call.fn, torch.nn.Module) or isinstance(owner, (torch.nn.Module, torch.Tensor)):
            return False
        if holds_state(list(call.args)) or holds_state(dict(call.kwargs)):
            return False
    return True


class Compile:
    """One out-of-process compile under way.  ``on_done(run, error)`` is called on a waiter thread with the
    package's ``run`` (a list of input tensors to a list of output tensors) or with the reason it failed."""

    def __init__(self, head: Callable, args: tuple, options: dict, on_done: Callable[[Any, str | None], None]):
        import cloudpickle
        import torch

        layouts = [(tuple(a.shape), tuple(a.stride()), a.dtype) for a in args]
        job = {"head": head, "layouts": layouts, "options": dict(options), "threads": torch.get_num_threads()}
        self.payload = cloudpickle.dumps(job)  # raises for a head that does not pickle: the caller falls back
        if len(self.payload) > MAX_JOB_BYTES:
            raise ValueError(f"the fused step's pickle is {len(self.payload)} bytes (it carries data)")
        self.on_done = on_done
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._run, name="flowvm-aot", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        workdir = tempfile.mkdtemp(prefix="flowvm-aot-")
        run, error = None, "the compile process did not start"
        try:
            with open(os.path.join(workdir, "job.pkl"), "wb") as f:
                f.write(self.payload)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] +
                                                [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            with _slots:
                with _children_lock:
                    self.proc = subprocess.Popen([sys.executable, "-m", "flowvm.fused.outofprocess", workdir],
                                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, env=env)
                    _children.add(self.proc)
                out, err = self.proc.communicate()
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
        except Exception as exc:  # loading, or starting the process
            run, error = None, f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        self.on_done(run, error)


@atexit.register
def _stop_children() -> None:
    """A program that ends leaves no compile running."""
    with _children_lock:
        for proc in list(_children):
            try:
                proc.kill()
            except OSError:
                pass


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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
