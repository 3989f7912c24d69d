"""Starting the ranks: torch's elastic agent (``torch.distributed.launcher.api.elastic_launch``, what
torchrun runs) on one host or several, restarts after a lost rank, and the error a failed group ends with.

One host: a c10d rendezvous on a free loopback port.  Several hosts: every host runs the same launch with
``nnodes`` and the rendezvous endpoint ``HOST:PORT`` (a c10d rendezvous, which the host at that address
serves); with ``node_rank`` given, a static rendezvous with that host rank (torchrun's
``--rdzv-backend=static``).
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ..base.errors import FlowError
from ..pickled import stable
from ..persist.pickler import Unpickler, pickle_bytes
from . import coordinated, group

__all__ = ["config", "run_elastic", "RankError", "Finished", "launch", "rank_failure", "record_error"]

KIND = "flowvm_kind"  # in a rank's error file: "raised" (its own error) or "group" (a collective failed)


@dataclass
class Finished:
    """What ``launch`` returns: rank 0's step count, whether its run is done, the program's value and its
    registers, and the exit status (0, or 128 + the signal the ranks stopped on)."""

    steps: int
    done: bool
    value: Any
    registers: dict
    status: int = 0


@stable("flowvm.distributed")
class RankError(FlowError):
    """A rank of a data-parallel run failed: ``rank`` is its number, ``exitcode`` its exit status (a negative
    signal number when killed), ``message`` its error, ``traceback`` where it was raised (when known) and
    ``kind`` how it failed: "raised", "killed", "hung" (it never joined a collective the others waited for)
    or "group" (a collective failed)."""

    def __init__(self, rank: int, exitcode: int, message: str, traceback: str = "", kind: str = "raised"):
        super().__init__(f"rank {rank} failed (exit code {exitcode}): {message}")
        self.rank, self.exitcode, self.message, self.traceback = rank, exitcode, message, traceback
        self.kind = kind
        self.exitcodes = {rank: exitcode}  # of every rank that failed

    def stopped(self) -> int | None:
        """The signal the ranks agreed to stop on (they saved and exited with 128 + it; the agent may have
        stopped the last ones with SIGTERM meanwhile), or None when a rank failed."""
        import signal

        asked = {128 + signal.SIGTERM, 128 + signal.SIGINT}
        agreed = {code for code in self.exitcodes.values() if code in asked}
        if len(agreed) == 1 and all(code in asked or code == -signal.SIGTERM for code in self.exitcodes.values()):
            return agreed.pop() - 128
        return None


def config(nproc: int, nnodes: int = 1, rdzv: str | None = None, node_rank: int | None = None,
           max_restarts: int = 0, run_id: str | None = None, monitor_interval: float = 0.1):
    """The elastic agent's LaunchConfig for nproc ranks on each of nnodes hosts."""
    from torch.distributed.launcher.api import LaunchConfig

    if nproc < 1 or nnodes < 1 or max_restarts < 0:
        raise ValueError(f"nproc and nnodes must be >= 1 and max_restarts >= 0, got nproc={nproc}, "
                         f"nnodes={nnodes}, max_restarts={max_restarts}")
    if nnodes > 1 and not rdzv:
        raise ValueError("several hosts (nnodes > 1) need the rendezvous endpoint rdzv='HOST:PORT'")
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank {node_rank} is outside 0..{nnodes - 1}")
    backend, configs = "c10d", {}
    if node_rank is not None and nnodes > 1:
        backend, configs = "static", {"rank": node_rank}
    endpoint = rdzv or "127.0.0.1:0"
    if run_id is None:  # the hosts of a run must agree on it: one they all derive from the endpoint they share
        run_id = f"flowvm-{endpoint}" if rdzv else uuid.uuid4().hex
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun does: ranks sharing a host's cores
    return LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, run_id=run_id,
                        rdzv_endpoint=endpoint, rdzv_backend=backend, rdzv_configs=configs,
                        max_restarts=max_restarts, monitor_interval=monitor_interval, start_method="spawn")


def record_error(err: BaseException, kind: str) -> bool:
    """Write a rank's error where its agent reads it (``$TORCHELASTIC_ERROR_FILE``), marked with its kind:
    the launcher then names the rank whose own error stopped the group.  False when no agent listens."""
    import traceback

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    notes = "".join(f"\n{note}" for note in getattr(err, "__notes__", ()))
    data = {"message": {"message": f"{type(err).__name__}: {err}{notes}",
                        "extraInfo": {"py_callstack": "".join(traceback.format_exception(err)),
                                      "timestamp": str(int(time.time())), KIND: kind,
                                      "rank": group.rank()}}}
    with open(path, "w") as f:
        json.dump(data, f)
    return True


def _extra(failure) -> dict:
    info = (failure.error_file_data or {}).get("message", {})
    return info.get("extraInfo", {}) if isinstance(info, dict) else {}


def _message(failure) -> str:
    message = failure.message or ""
    if isinstance(message, dict):  # torch reads our error file's message as the whole record
        message = str(message.get("message", ""))
    if failure.exitcode < 0:
        import signal

        name = signal.Signals(-failure.exitcode).name
        message = f"killed by {name}" if not message or message.startswith("Signal") else message
    return message or f"exit code {failure.exitcode}"


def _stopped_by_agent(failure) -> bool:
    """Whether a rank ended on the SIGTERM the agent stops a group's ranks with (and wrote no error)."""
    import signal

    return not _extra(failure).get(KIND) and failure.exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM)


def culprit(failures: dict) -> tuple[int, str]:
    """The rank that stopped a failed group, and its kind: the first whose own error stopped it ("raised"),
    else the first killed by a signal ("killed"), else one the agent stopped while the others' collectives
    timed out waiting for it ("hung"), else the first whose collective failed ("group")."""
    def first(ranks):
        return min(ranks, key=lambda r: (failures[r].timestamp, r))

    kinds = {r: _extra(f).get(KIND) for r, f in failures.items()}
    raised = [r for r, kind in kinds.items() if kind == "raised"]
    return (first(raised), "raised") if raised else _culprit_of_signals(failures, kinds, first)


def _culprit_of_signals(failures: dict, kinds: dict, first) -> tuple[int, str]:
    escalated = _escalated(failures, kinds)
    killed = [r for r, f in failures.items() if f.exitcode < 0 and not _stopped_by_agent(f) and r not in escalated]
    if killed:
        return first(killed), "killed"
    hung = [r for r, f in failures.items() if _stopped_by_agent(f) or r in escalated]
    if hung and any(kind == "group" for kind in kinds.values()):
        return first(hung), "hung"
    return first(failures), "group"


def _escalated(failures: dict, kinds: dict) -> list[int]:
    """The ranks the agent had to SIGKILL while the others' collectives timed out waiting for them: hung
    (stopped with SIGSTOP, say: they never ended on the agent's SIGTERM); a rank killed from outside breaks the
    others' connections instead."""
    import signal

    timed_out = any(kind == "group" and "timed out" in _message(failures[r]).lower() for r, kind in kinds.items())
    return [r for r, f in failures.items() if timed_out and f.exitcode == -signal.SIGKILL]


def rank_failure(failed) -> RankError:
    """The error of the rank that stopped a failed group (torch's ChildFailedError, see ``culprit``);
    ranks that failed only because of it are not reported."""
    failures = failed.failures
    rank, kind = culprit(failures)
    failure = failures[rank]
    message, traceback = _message(failure), _extra(failure).get("py_callstack", "")
    if kind == "hung":
        waited = min((r for r in failures if _extra(failures[r]).get(KIND) == "group"),
                     key=lambda r: (failures[r].timestamp, r))
        how = " with SIGKILL (it did not end on SIGTERM: stopped with SIGSTOP?)" if failure.exitcode == -9 else ""
        message = (f"hung: it never joined a collective, and rank {waited}'s failed waiting for it "
                   f"({_message(failures[waited]).splitlines()[0]}); the agent stopped it{how}")
    err = RankError(rank, failure.exitcode, message, traceback, kind)
    err.exitcodes = {r: f.exitcode for r, f in failures.items()}
    return err


def run_elastic(cfg, entrypoint: Callable | str, *args: Any) -> dict:
    """Run entrypoint(*args) on every rank under the elastic agent; its results by rank.  A failed group
    (after its restarts) is a RankError naming the rank that stopped it.  SIGINT or SIGTERM before the
    ranks start (while the hosts meet) ends the process at once with status 128 + the signal."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # the agent's W/E log lines on a rank's failure: the launcher reports it itself, once (this process runs
    # none of the program: only the agent logs here)
    logging.disable(logging.ERROR)
    try:
        with _signals_end_the_wait():
            return elastic_launch(cfg, entrypoint)(*args)
    except ChildFailedError as failed:
        raise rank_failure(failed) from None
    finally:
        logging.disable(logging.NOTSET)


@contextlib.contextmanager
def _signals_end_the_wait():
    """Until the agent starts the ranks (and takes SIGINT/SIGTERM over to pass them on), a signal ends this
    process.  The rendezvous blocks in torch's C++ store, where no Python handler runs: the signal's number
    reaches a thread of ours through the interpreter's wakeup fd instead."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):  # only marks the signal as handled in Python: the thread acts on it
        return None

    sigs = (signal.SIGINT, signal.SIGTERM)
    old = {sig: signal.signal(sig, handler) for sig in sigs}
    read, write = os.pipe()
    os.set_blocking(write, False)
    old_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch():
        while True:
            data = os.read(read, 1)
            if not data or data[0] == 0:
                return
            if data[0] in sigs and signal.getsignal(data[0]) is handler:  # the agent has not taken it over
                print(f"flowvm: stopped by {signal.Signals(data[0]).name} while waiting for the hosts",
                      file=sys.stderr, flush=True)
                os._exit(128 + data[0])

    thread = threading.Thread(target=watch, name="flowvm-signals", daemon=True)
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        for sig, previous in old.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        os.write(write, b"\0")
        thread.join(5)
        os.close(write)
        os.close(read)


# ------------------------------------------------------------------ from Python
def _rank_main(build: Callable, options: dict, location, every, every_seconds, sync_every, key, timeout,
               max_steps, per_rank=None):
    from .loop import Synchronized

    group.init(timeout)
    try:
        resumed = location is not None and coordinated.is_checkpoint(location)
        if resumed and not coordinated.read_manifest(location, key).get("done"):
            drv = coordinated.load(location, key)
        else:
            resumed = False
            drv = build(**options).start()
        meta = {"builder": f"{getattr(build, '__module__', '?')}.{getattr(build, '__qualname__', '?')}",
                "world_size": max(group.world_size(), 1)}
        if per_rank is None:  # as the program file declares it, where build() is defined
            per_rank = getattr(sys.modules.get(getattr(build, "__module__", None) or ""), "PER_RANK", None)
        status = Synchronized(drv, location, every, every_seconds, sync_every, key, meta,
                              resumed=resumed, per_rank=per_rank).run(max_steps)
        if group.rank() != 0:
            return None
        # pickled here, while the group lives (a DistributedDataParallel among them pickles only then)
        return pickle_bytes(Finished(drv.steps, drv.done, drv.result if drv.done else None, dict(drv.registers),
                                     status))
    except BaseException as err:
        record_error(err, "group" if _collective_error(err) else "raised")
        raise
    finally:
        drv = None
        gc.collect()  # the run's DDP modules hold the group: gone before it ends, not at the interpreter's exit
        group.shutdown()


def _collective_error(err: BaseException) -> bool:
    """Whether err is a collective's failure (a lost peer, a timeout) rather than the program's own."""
    import torch.distributed as dist

    return isinstance(err, getattr(dist, "DistError", ())) or "gloo" in str(err).lower() or \
        "nccl" in str(err).lower()


def launch(build: Callable, nproc: int = 2, options: dict | None = None, *, checkpoint=None,
           every: int | None = None, every_seconds: float | None = None, sync_every: int | None = None,
           key: str | None = None, timeout: float | None = None, max_restarts: int = 0, nnodes: int = 1,
           rdzv: str | None = None, node_rank: int | None = None, max_steps: int | None = None,
           rdzv_id: str | None = None, per_rank=None):
    """Run ``build(**options)``'s program data-parallel on nproc ranks (per host) under torch's elastic
    agent, and return rank 0's result (``Finished``: steps, done, value, registers, status).

    ``build`` must be importable by name (a module-level function: the ranks are new processes).  With
    ``checkpoint`` (a folder or URL prefix) the ranks save coordinated checkpoints there every ``every``
    steps or ``every_seconds`` seconds and at the end, and a launch finding an unfinished run there resumes
    it; after a lost rank the agent restarts the group up to ``max_restarts`` times, each time from the last
    complete checkpoint.  ``timeout``: seconds a collective may wait for a rank before it fails.  A failed
    group raises RankError, naming the rank that failed and its error.  The ranks' models must stay one (see
    flowvm.distributed.replicas): ``per_rank`` names the registers each rank keeps its own of (default: the
    ``PER_RANK`` of build()'s module); ranks whose models differ raise a ReplicaError, in the RankError."""
    from .loop import DEFAULT_SYNC_EVERY

    cfg = config(nproc, nnodes, rdzv, node_rank, max_restarts, run_id=rdzv_id)
    with _quiet_torch():  # the RankError raised names the rank and carries its traceback: said once
        results = run_elastic(cfg, _rank_main, build, dict(options or {}), checkpoint, every, every_seconds,
                              sync_every or DEFAULT_SYNC_EVERY, key, timeout, max_steps, per_rank)
    return Unpickler(io.BytesIO(results[0])).load()


@contextlib.contextmanager
def _quiet_torch():
    """torch's elastic agent and process spawner log only critical records meanwhile (they would print a
    failed rank's traceback, and the warnings of its shutdown, on top of the error ``launch`` raises)."""
    import logging

    import torch.distributed.launcher.api  # noqa: F401  (the agent's loggers made, at their levels)

    names = [name for name in list(logging.root.manager.loggerDict)
             if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"))]
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
