"""Running a function in a forked child under a memory limit (``RLIMIT_AS``), with an audit hook counting
what it imports and executes: what the tests of untrusted files use, so that a bad case cannot take the
machine and code run from a file is seen."""

from __future__ import annotations

import os
import pickle
import resource
import select
import signal
import sys
import time
import traceback

MiB = 1 << 20


def address_space() -> int:
    """This process's virtual memory size, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


class Audit:
    """Counts the audit events of code a file could make run: imports of modules not loaded before, exec and
    compile of code, pickle's find_class, processes started, and attributes set on objects by name."""

    WATCHED = ("exec", "compile", "pickle.find_class", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
               "ctypes.dlopen")

    def __init__(self):
        self.before = set(sys.modules)
        self.events: list[tuple[str, str]] = []
        self.active = False

    def __call__(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        if event == "import":
            name = args[0]
            if name not in self.before and name not in sys.modules:
                self.events.append((event, str(name)[:80]))
        elif event in self.WATCHED:
            self.events.append((event, repr(args)[:80]))


def bounded(fn, extra_mb: int = 512, timeout: float = 60.0, audit: bool = False):
    """fn() in a forked child whose address space may grow by extra_mb MiB at most.  Returns ("ok", value) or
    ("raised", exception type name, message), and with audit the audit events it caused; ("killed", signal) or
    ("timeout",) when the child did not come back."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.close(read)
            hook = Audit()
            if audit:
                sys.addaudithook(hook)
            limit = address_space() + extra_mb * MiB
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            hook.active = True
            try:
                result: tuple = ("ok", fn())
            except BaseException as err:  # noqa: BLE001 - reported to the parent
                result = ("raised", type(err).__name__, str(err)[:2000], traceback.format_exc()[-3000:])
            hook.active = False
            try:
                data = pickle.dumps((result, hook.events))
            except Exception:
                data = pickle.dumps(((result[0], repr(result[1:])[:2000]), hook.events))
            with os.fdopen(write, "wb") as f:
                f.write(data)
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    os.close(write)
    chunks, deadline = [], time.monotonic() + timeout
    with os.fdopen(read, "rb") as f:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return _answer(("timeout",), [], audit)
            piece = os.read(f.fileno(), 1 << 20)
            if not piece:
                break
            chunks.append(piece)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return _answer(("killed", os.WTERMSIG(status)), [], audit)
    if not chunks:
        return _answer(("killed", None), [], audit)
    result, events = pickle.loads(b"".join(chunks))
    return _answer(result, events, audit)


def _answer(result: tuple, events: list, audit: bool):
    return (result, events) if audit else result
