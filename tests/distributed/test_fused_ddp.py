"""fuse-torch under DDP on two ranks: a fused training step holding a DistributedDataParallel module stays
eager on every rank, says why, and trains exactly as the eager step does."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch.distributed")
from flowvm.distributed import launch  # noqa: E402

import progs_fused  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_a_fused_step_around_ddp_stays_eager_on_every_rank_and_trains_as_eager():
    eager = launch(progs_fused.build, nproc=2, options={"form": "eager"})
    fused = launch(progs_fused.build, nproc=2, options={"form": "compiled"})
    state, compiles, refused = fused.registers["status"].split("|", 2)
    assert (state, compiles) == ("eager", "0")
    assert "DistributedDataParallel communicates with the other ranks" in refused
    assert all(torch.equal(a, b) for a, b in zip(eager.registers["weights"], fused.registers["weights"]))
