#!/usr/bin/env python
"""The plain torchrun baseline of bench_distributed.py: the same convolutional network, data, batches and
optimizer as its flowvm program, trained by a hand-written DDP loop.

    torchrun --nproc-per-node 2 bench/ddp_plain.py --channels 64 --batch-size 128 --steps 200 --out plain.json

Every rank runs torch on one thread, takes its shard of each epoch's seeded permutation (every world_size-th
sample from its rank, as flowvm.Batches does, whole batches only) and makes one update per batch: zero the
gradients, forward, cross-entropy, backward (DistributedDataParallel all-reduces the gradients when there
are several ranks), an SGD step, the loss as a float.  ``--warmup`` steps run first; then ``--steps`` steps
are timed on each rank, and rank 0 writes the seconds per step to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flowvm.programs import convnet  # noqa: E402  (the network and the data; nothing of flowvm's loop)


def shards(n: int, batch: int, seed: int, rank: int, world: int):
    """Index batches of this rank's shard of each epoch's permutation, forever."""
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(n)[rank::world]
        for start in range(0, len(order) - batch + 1, batch):
            yield torch.from_numpy(order[start:start + batch])
        epoch += 1


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train, _, shape, classes = convnet.images(None, 0.25, args.seed)
    x, y = convnet.tensors(train, shape)
    torch.manual_seed(args.seed)
    model = convnet.ConvNet(shape, args.channels, classes)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = shards(len(x), args.batch_size, args.seed, rank, world)

    def step() -> float:
        idx = next(batches)
        net.train()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    seconds = time.perf_counter() - start
    if rank == 0:
        Path(args.out).write_text(json.dumps({"step_s": seconds / args.steps, "steps": args.steps,
                                              "world_size": world, "loss": loss, "pid": os.getpid()}))
    # the DDP module holds the group: dropped before the group ends, not at the interpreter's exit (gloo's
    # threads, destroyed then, can abort the process after its work is done)
    del net, model, opt, step
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
