"""The worker processes that prepare ``Batches`` ahead of the program.

A ``WorkerPool`` holds ``n`` processes, each with a duplex pipe to the
parent.  The parent sends a worker tasks ``(key, seed, epoch, indices)``;
the worker makes the batch with its copy of the batch maker (the source, the
transform, the collation) and sends back ``(key, "ok", batch)`` or
``(key, "error", details)``.  Each worker answers its tasks in the order they
came, and the parent decides which worker makes which batch, so the batches
come back in exactly the order the parent asks for them, whatever the timing.

No thread runs in the parent: results are read when the program asks for a
batch, waiting on the worker's pipe *and* its process sentinel, so a worker
that dies is an error at once, never a hang.  A worker that makes nothing for
the pool's ``timeout`` (a sample that hangs, a worker stopped with SIGSTOP) is
a ``WorkerError`` naming it and the batch; a signal asking the run to stop
(flowvm.base.interrupts) ends the wait after a second with ``Interrupted``.

Start method: ``fork`` on Linux when no other Python thread runs at that
moment (the workers start in milliseconds, sharing the source's memory
copy-on-write); otherwise ``forkserver`` where there is one, else ``spawn``,
started in a background thread (the batch maker travels pickled with
cloudpickle).  ``start_method=`` chooses one.

A worker never outlives its parent: on Linux it asks the kernel for SIGKILL
when its parent dies (``prctl(PR_SET_PDEATHSIG)``), and a thread of the worker
watches the parent's pid besides; a worker blocked on its pipe sees it close.
"""

from __future__ import annotations

import collections
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

from . import interrupts
from .errors import WorkerError

__all__ = ["WorkerPool", "WorkerError", "die_with_parent", "process_alive", "start_method_for"]

_PR_SET_PDEATHSIG = 1
_SLICE = 0.25  # seconds between the checks of a wait for a batch (timeout, stop asked for)


def start_method_for(requested: str | None) -> str:
    """The multiprocessing start method the workers use (see the module's docstring)."""
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    if requested is not None:
        if requested not in methods:
            raise ValueError(f"Batches: start_method {requested!r} is not available here (one of {methods})")
        return requested
    if sys.platform.startswith("linux") and "fork" in methods and threading.active_count() == 1:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


# ------------------------------------------------------------------ the worker's side
def die_with_parent(owner: int, pdeathsig: bool = True) -> None:
    """Exit when the owner process is gone (SIGKILL from the kernel on Linux, and a watching thread)."""
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the thread below does it
            pass
    parent = os.getppid()
    if not process_alive(owner):  # gone before the death signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent and process_alive(owner):
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="flowvm-batches-parent-watch", daemon=True).start()


def process_alive(pid: int) -> bool:
    """Whether process pid runs (a zombie, dead but not yet reaped, does not; nor a pid now another user's)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):  # not Linux
        return True


def _worker_main(tasks, results, owner: int, pdeathsig: bool, maker: Any) -> None:
    die_with_parent(owner, pdeathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)  # as torch's DataLoader workers: no oversubscribed cores
    if isinstance(maker, bytes):
        import cloudpickle

        maker = cloudpickle.loads(maker)
    outbox = _sender(results)
    while True:
        try:
            task = tasks.recv()
        except (EOFError, OSError):
            os._exit(0)
        if task is None:
            os._exit(0)
        key, seed, epoch, indices = task
        try:
            data = pickle.dumps((key, "ok", maker(seed, epoch, indices)), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as err:  # noqa: B036 - every failure goes back to the parent as data
            details = {"sample": getattr(err, "flowvm_sample", None), "error": f"{type(err).__name__}: {err}",
                       "traceback": "".join(traceback.format_exception(err))}
            data = pickle.dumps((key, "error", details))
        outbox.put(data)


def _sender(conn):
    """A thread sending the worker's answers, so that the worker makes its next batch while the parent has
    not read the last one yet (a batch larger than the pipe's buffer would otherwise hold it up)."""
    import queue

    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def run() -> None:
        while True:
            try:
                conn.send_bytes(outbox.get())
            except (OSError, ValueError):
                os._exit(0)

    threading.Thread(target=run, name="flowvm-batches-sender", daemon=True).start()
    return outbox


# ------------------------------------------------------------------ the parent's side
class WorkerPool:
    """n worker processes making batches with maker(seed, epoch, indices); see the module's docstring."""

    def __init__(self, n: int, maker: Callable, start_method: str | None = None, timeout: float = 300.0):
        import multiprocessing

        self.timeout = timeout  # seconds a batch may take before the worker counts as stuck
        self.method = start_method_for(start_method)
        self.ctx = multiprocessing.get_context(self.method)
        self.n = n
        self.procs: list = []
        self.conns: list = []  # per worker: the pipe its batches come back on
        self.tasks: list = []  # per worker: the pipe its tasks go out on
        self.outstanding = [collections.deque() for _ in range(n)]  # per worker: keys sent, not yet read
        self.where: dict = {}  # key -> the worker it was sent to (until read)
        self.ready: dict = {}  # key -> batch read ahead of its turn
        self.indices: dict = {}  # key -> its sample indices (for error messages)
        self.closed = False
        self._failure: BaseException | None = None
        self.owner = os.getpid()  # a forked copy of the owner must leave these workers alone
        if self.method == "fork":
            self._starter = None
            try:
                self._start(maker, pdeathsig=threading.current_thread() is threading.main_thread())
            except Exception as err:  # raised by the next batch asked for, not by a load that makes the pool
                self._failure = err
        else:
            import cloudpickle

            payload = cloudpickle.dumps(maker)
            self._starter = threading.Thread(target=self._start_quietly, args=(payload, self.method == "forkserver"),
                                             name="flowvm-batches-start", daemon=True)
            self._starter.start()

    def _start(self, maker: Any, pdeathsig: bool) -> None:
        for _ in range(self.n):
            task_r, task_w = self.ctx.Pipe(duplex=False)
            result_r, result_w = self.ctx.Pipe(duplex=False)
            _widen(result_w)
            proc = self.ctx.Process(target=_worker_main, args=(task_r, result_w, os.getpid(), pdeathsig, maker),
                                    name="flowvm-batches-worker", daemon=True)
            proc.start()
            task_r.close()
            result_w.close()
            self.procs.append(proc)
            self.conns.append(result_r)
            self.tasks.append(task_w)

    def _start_quietly(self, payload: bytes, pdeathsig: bool) -> None:
        try:
            self._start(payload, pdeathsig)
        except BaseException as err:  # noqa: B036 - raised by the next batch asked for
            self._failure = err

    def wait_started(self) -> None:
        if self._starter is not None:
            self._starter.join()
            self._starter = None
        if self._failure is not None:
            raise WorkerError(f"Batches: the worker processes could not start ({self.method}): "
                              f"{type(self._failure).__name__}: {self._failure}") from self._failure
        if self.closed:
            raise WorkerError("Batches: the worker pool is closed")

    @property
    def pids(self) -> list[int]:
        self.wait_started()
        return [p.pid for p in self.procs]

    def in_flight(self) -> int:
        return sum(len(d) for d in self.outstanding) + len(self.ready)

    def has(self, key) -> bool:
        return key in self.where or key in self.ready

    def submit(self, worker: int, key, seed: int, epoch: int, indices) -> None:
        self.wait_started()
        try:
            self.tasks[worker].send((key, seed, epoch, indices))
        except OSError:  # a dead worker: take() reports it
            pass
        self.outstanding[worker].append(key)
        self.where[key] = worker
        self.indices[key] = indices

    def keep_only(self, keys: set) -> None:
        """Drop the batches read ahead that are no longer wanted (the position jumped)."""
        for key in [k for k in self.ready if k not in keys]:
            del self.ready[key]
            self.indices.pop(key, None)

    def take(self, key) -> Any:
        """The batch for key (submitted before): read from its worker, keeping what comes before it."""
        if key in self.ready:
            self.indices.pop(key, None)
            return self.ready.pop(key)
        worker = self.where[key]
        while True:
            got, status, payload = self._read(worker, key)
            self.where.pop(got, None)
            if got == key:
                indices = self.indices.pop(key, None)
                if status == "ok":
                    return payload
                raise self._error(worker, key, indices, payload)
            if status == "ok":
                self.ready[got] = payload
            else:
                self.indices.pop(got, None)  # asked for again when its turn comes, and raised then

    def _read(self, worker: int, key) -> tuple:
        """The next answer of a worker; a WorkerError if it died or made nothing for ``timeout`` seconds,
        Interrupted once a signal asked the run to stop (the pool is closed then)."""
        from multiprocessing.connection import wait

        conn, proc = self.conns[worker], self.procs[worker]
        start = time.monotonic()
        while True:
            if conn.poll() or conn in wait([conn, proc.sentinel], timeout=_SLICE):
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    data = None
                if data is not None:
                    self.outstanding[worker].popleft()
                    return pickle.loads(data)
            elif proc.is_alive():
                self._waited(worker, key, time.monotonic() - start)
                continue
            proc.join(timeout=1)
            indices = self.indices.get(key)
            self.close()
            raise WorkerError(f"Batches: worker {worker} (pid {proc.pid}) died ({_exit_text(proc.exitcode)}) "
                              f"while making the batch {_describe(key, indices)}; the next batch asked for "
                              f"starts new workers.{_main_hint(self.method)}")

    def _waited(self, worker: int, key, seconds: float) -> None:
        """A worker made nothing for seconds: past the timeout, or once a signal asked the run to stop, the
        workers are stopped and the wait ends with an error (the batch is made again when asked for)."""
        signum = interrupts.due()
        if signum is None and seconds < self.timeout:
            return
        proc, indices = self.procs[worker], self.indices.get(key)
        doing = f"worker {worker} (pid {proc.pid}, {_process_state(proc.pid)}) made nothing for {seconds:.0f} s " \
                f"while making the batch {_describe(key, indices)}"
        self.close()
        if signum is not None:
            raise interrupts.Interrupted(f"Batches: stopped by {signal.Signals(signum).name}: {doing}", signum)
        raise WorkerError(f"Batches: {doing}, past its timeout of {self.timeout:g} s (Batches(timeout=...) sets "
                          "it): a sample's preparation that hangs, or a worker stopped from outside; the next "
                          "batch asked for starts new workers")

    def _error(self, worker: int, key, indices, details: dict) -> WorkerError:
        sample = details.get("sample")
        where = f"sample {sample} of the batch {_describe(key, indices)}" if sample is not None else \
            f"the batch {_describe(key, indices)}"
        return WorkerError(f"Batches: worker {worker} (pid {self.procs[worker].pid}) failed on {where}: "
                           f"{details['error']}\n\nThe worker's traceback:\n{details['traceback']}")

    def close(self) -> None:
        """Stop the workers (asked to exit, killed after a second) and forget every batch in flight."""
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self.owner:  # in a forked copy of the owner: the workers are the owner's
            return
        if self._starter is not None:
            self._starter.join()
        for conn in self.tasks:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 1.0
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1)
        for conn in self.conns + self.tasks:
            conn.close()
        self.where.clear()
        self.ready.clear()
        self.indices.clear()


def _process_state(pid: int) -> str:
    """A process's state as Linux shows it ("stopped", "sleeping", ...)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split("(", 1)[-1].rstrip(")\n ") or "state unknown"
    except OSError:
        pass
    return "state unknown"


def _widen(conn) -> None:
    """Let a batch pipe hold as much as the system allows (Linux: /proc/sys/fs/pipe-max-size, 1 MiB by
    default, against 64 KiB), so that a worker hands over a batch in one write, rather than in pieces, each
    waiting for the parent to read the last (on a busy machine, for the parent to be scheduled)."""
    try:
        import fcntl

        with open("/proc/sys/fs/pipe-max-size") as f:
            size = int(f.read())
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, min(size, 1 << 26))
    except (ImportError, AttributeError, OSError, ValueError):  # not Linux: the default size
        pass


def _main_hint(method: str) -> str:
    if method == "fork":
        return ""
    return (f" Workers started with {method} import the main script again: if it has no "
            "`if __name__ == '__main__':` guard around its work, they run that work and fail.")


def _describe(key, indices) -> str:
    seed, epoch, position = key
    shown = "" if indices is None else ", samples " + _list(indices)
    return f"at position {position} of epoch {epoch} (seed {seed}{shown})"


def _list(indices) -> str:
    values = [int(i) for i in indices[:8]]
    return "[" + ", ".join(map(str, values)) + (", ...]" if len(indices) > 8 else "]")


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
