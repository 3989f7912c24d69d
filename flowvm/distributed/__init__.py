"""Data-parallel runs on torch.distributed: every rank runs the same program (SPMD) under torch's elastic
agent, ``Batches`` shards each epoch across the ranks, checkpoints are coordinated (one step boundary for
every rank, complete only when every rank's part is written) and resume bit for bit at the same world size;
the ranks' models are checked to stay one (flowvm.distributed.replicas).  See docs/distributed.md."""

from .group import (AllRanksError, Rank0, SaveFailed, agree, backend, barrier, broadcast, gather, init, launched, local_rank, rank, rank0,
                    shutdown, world_size)
from .coordinated import is_checkpoint, read_manifest
from .coordinated import load as load_checkpoint
from .coordinated import save as save_checkpoint
from .agent import Finished, RankError, launch
from .loop import DEFAULT_SYNC_EVERY, Synchronized
from .replicas import ReplicaError

__all__ = ["rank", "world_size", "local_rank", "launched", "init", "shutdown", "backend", "agree", "gather",
           "broadcast", "barrier", "rank0", "Rank0", "launch", "Finished", "RankError", "Synchronized", "DEFAULT_SYNC_EVERY",
           "save_checkpoint", "load_checkpoint", "is_checkpoint", "read_manifest", "ReplicaError", "AllRanksError",
           "SaveFailed"]
