"""``for batch in batches:``: iterating a ``Batches`` gives the batches left in its current epoch, through an
iterator that a copy of the run keeps (a ``@flowvm.program`` loop holds it in a register): it holds the Batches
(shared with the program, as its other references are) and the epoch it iterates, nothing else."""

from __future__ import annotations

from typing import Any

from ..pickled import stable


@stable("flowvm.pickled")
class BatchesEpoch:
    """The batches of one epoch of a Batches, from its position on: each ``next()`` is its ``next_batch()``,
    until the Batches rolls over to its next epoch."""

    __slots__ = ("batches", "epoch")

    def __init__(self, batches: Any, epoch: int | None = None):
        self.batches, self.epoch = batches, batches.epoch if epoch is None else epoch

    def __iter__(self) -> "BatchesEpoch":
        return self

    def __next__(self) -> Any:
        if self.batches.epoch != self.epoch:
            raise StopIteration
        return self.batches.next_batch()

    def __length_hint__(self) -> int:
        return len(self.batches) - self.batches.position if self.batches.epoch == self.epoch else 0

    def __reduce__(self):
        return (BatchesEpoch, (self.batches, self.epoch))
