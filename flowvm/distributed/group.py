"""The process group a rank belongs to: rank, world size, the group's start from the launcher's environment,
and the few collectives flowvm itself needs (agreeing on a flag, gathering small objects).

A rank is a process started by torch's elastic agent (``flowvm run --nproc``, ``torchrun``,
``flowvm.distributed.launch``), which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``.  ``init()`` starts the default process group from them: gloo on CPU, NCCL when CUDA is
available (each rank then uses the GPU of its local rank), with a timeout after which a collective that
some rank never joins is an error instead of a hang.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any, Callable

from ..base.errors import CheckpointError, FlowError
from ..pickled import stable

__all__ = ["rank", "world_size", "local_rank", "launched", "init", "shutdown", "backend", "agree",
           "gather", "broadcast", "barrier", "rank0", "Rank0", "DEFAULT_TIMEOUT", "TIMEOUT_ENV"]

DEFAULT_TIMEOUT = 1800.0  # seconds: torch's own default for gloo
TIMEOUT_ENV = "FLOWVM_DIST_TIMEOUT"


def _dist():
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def rank() -> int:
    """This process's rank in the default process group: 0 outside a distributed run."""
    dist = _dist()
    if dist is not None:
        return dist.get_rank()
    return int(os.environ.get("RANK", 0)) if launched() else 0


def world_size() -> int:
    """The number of ranks of the default process group; 1 outside a distributed run (a single process)."""
    dist = _dist()
    if dist is not None:
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if launched() else 1


def local_rank() -> int:
    """This process's rank among those of its host (the GPU it uses under NCCL); 0 outside a run."""
    return int(os.environ.get("LOCAL_RANK", 0)) if launched() else 0


def launched() -> bool:
    """Whether this process is a rank started by torch's elastic agent or torchrun (its environment names
    the group)."""
    return all(os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def backend() -> str:
    """The backend init() chooses: NCCL where CUDA is available, else gloo."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def timeout_seconds(timeout: float | None = None) -> float:
    """The collectives' timeout: the one given, else $FLOWVM_DIST_TIMEOUT, else 30 minutes."""
    if timeout is None:
        text = os.environ.get(TIMEOUT_ENV)
        try:
            timeout = float(text) if text else DEFAULT_TIMEOUT
        except ValueError:
            raise ValueError(f"${TIMEOUT_ENV} must be a number of seconds, got {text!r}") from None
    if not timeout > 0:
        raise ValueError(f"the process group's timeout must be > 0 seconds, got {timeout!r}")
    return float(timeout)


def init(timeout: float | None = None, backend_name: str | None = None) -> bool:
    """Start the default process group from the launcher's environment, once (False: not launched, or
    already started).  A collective that waits longer than ``timeout`` seconds (default
    ``timeout_seconds()``) raises instead of waiting forever."""
    if not launched():
        return False
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    name = backend_name or backend()
    if name == "nccl":
        torch.cuda.set_device(local_rank())
    wait = datetime.timedelta(seconds=timeout_seconds(timeout))
    dist.init_process_group(name, store=_store(wait), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=wait)
    return True


def _store(timeout: datetime.timedelta):
    """The group's key-value store, under a prefix of its own for each start of the group: the agent's store
    outlives a restart, and the addresses the ranks of a failed start published there must not be read
    by the next (they would connect to dead processes)."""
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=not agent and os.environ["RANK"] == "0",
                          timeout=timeout, multi_tenant=not agent)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"flowvm/start-{attempt}/", store)


def shutdown() -> None:
    """End the default process group, if one was started."""
    dist = _dist()
    if dist is not None:
        dist.destroy_process_group()


def _device():
    import torch

    dist = _dist()
    if dist is not None and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(*flags: int) -> list[int]:
    """Each flag's largest value over the ranks (an all-reduce of a few integers: whether any rank asks to
    stop, to save, ...); the flags themselves outside a distributed run."""
    dist = _dist()
    if dist is None:
        return [int(f) for f in flags]
    import torch

    values = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=_device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [int(v) for v in values.tolist()]


def gather(obj: Any) -> list[Any]:
    """obj of every rank, in rank order (small picklable objects); [obj] outside a distributed run."""
    dist = _dist()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's obj, on every rank."""
    dist = _dist()
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait until every rank reaches this point (a no-op outside a distributed run)."""
    if _dist() is not None:
        agree(0)  # an all-reduce: gloo's barrier has no timeout of its own on every version


@stable("flowvm.distributed")
class AllRanksError(FlowError):
    """A refusal every rank reaches alike, at the same step (after an agreement): the launcher says it once a
    host, in one line, and exits with status 2 without restarting the group."""


@stable("flowvm.distributed")
class SaveFailed(AllRanksError, CheckpointError):
    """A coordinated checkpoint that could not be written (a full disk, a quota), raised on every rank alike:
    one line, status 2; the previous checkpoint stays the complete one."""

    def __init__(self, path: Any, reason: str):
        CheckpointError.__init__(self, path, reason)


@stable("flowvm.distributed")
class Rank0:
    """A function that runs on rank 0 only (printing, writing a file) and returns None on the other ranks;
    outside a distributed run it always runs.  ``CALL(rank0(print), reg("loss"))``."""

    def __init__(self, fn: Callable):
        if not callable(fn):
            raise TypeError(f"rank0: expected a function, got {type(fn).__name__} {fn!r:.40}")
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs) if rank() == 0 else None

    def __repr__(self) -> str:
        return f"rank0({getattr(self.fn, '__qualname__', self.fn)!r})"


def rank0(fn: Callable) -> Rank0:
    """fn, run on rank 0 only (see Rank0)."""
    return Rank0(fn)
