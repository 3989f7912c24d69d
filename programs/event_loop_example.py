"""Train while an asyncio loop also serves a timer, a watched file and checkpoint requests.

The training program is plain SGD on a linear model over a seeded stream
(``build``).  ``main`` drives it with ``await drv.arun()`` and, in the same
event loop, runs three other tasks:

- a timer that prints progress every ``report_every`` seconds;
- a watcher for files appearing in the work directory: ``CHECKPOINT``
  (save a checkpoint now) and ``STOP`` (save and stop);
- a SIGUSR1 handler that also asks for a checkpoint (``kill -USR1 <pid>``).

``arun`` gives the event loop control about every quarter millisecond, always
between two steps, so every other task sees the driver between two steps and
may save it, print it or stop it.  Started
again in the same directory, ``main`` resumes from the checkpoint.

    python -m flowvm.programs.event_loop_example /tmp/run          # touch /tmp/run/STOP to stop
    python -m flowvm.programs.event_loop_example /tmp/run --demo   # makes the requests itself
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import numpy as np

import flowvm
from flowvm import CALL, REPEAT, SEQ, Registers

SHOW = ["step", "loss"]


class LinearStream:
    """Batches (x, y) with y = x @ w_true + noise; its position is its generator state (plain data)."""

    def __init__(self, dim: int = 8, batch: int = 32, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.w_true = self.rng.standard_normal(dim)
        self.batch = batch

    def next(self):
        x = self.rng.standard_normal((self.batch, self.w_true.size))
        return x, x @ self.w_true + 0.01 * self.rng.standard_normal(self.batch)

    def state_dict(self) -> dict:
        """The stream's position: its generator's state (w_true is rebuilt from the seed)."""
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]


def sgd_step(w: np.ndarray, batch, lr: float):
    """One SGD step on the squared error; returns the new weights and the batch loss."""
    x, y = batch
    err = x @ w - y
    return w - lr * (x.T @ err) / len(y), float(np.mean(err ** 2))


def weights_of(update):
    return update[0]


def loss_of(update):
    return update[1]


def build(steps: int = 100000, dim: int = 8, lr: float = 0.05, seed: int = 0):
    reg = Registers(w=np.zeros(dim), lr=lr)
    stream = LinearStream(dim, seed=seed)
    return REPEAT(steps, SEQ([
        CALL(stream.next, store_to=reg("batch")),
        CALL(sgd_step, reg("w"), reg("batch"), reg("lr"), store_to=reg("update")),
        CALL(weights_of, reg("update"), store_to=reg("w")),
        CALL(loss_of, reg("update"), store_to=reg("loss")),
    ]), counter=reg("step"))


async def watch_files(workdir: Path, wanted: asyncio.Event, training: asyncio.Task, stopped_by: list) -> None:
    """A CHECKPOINT file in workdir asks for a checkpoint; a STOP file stops the training."""
    while True:
        await asyncio.sleep(0.05)
        if (workdir / "CHECKPOINT").exists():
            (workdir / "CHECKPOINT").unlink()
            wanted.set()
        if (workdir / "STOP").exists():
            (workdir / "STOP").unlink()
            stopped_by[0] = "stop file"
            training.cancel()
            return


async def demo_requests(workdir: Path) -> None:
    """What --demo does: ask for a checkpoint, then stop."""
    await asyncio.sleep(0.3)
    (workdir / "CHECKPOINT").touch()
    await asyncio.sleep(0.3)
    (workdir / "STOP").touch()


async def main(workdir: str | Path, steps: int = 100000, report_every: float = 0.5, demo: bool = False,
               log=print) -> flowvm.Driver:
    """Train in workdir until done or until a STOP file appears; return the driver."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = workdir / "train.ckpt"
    drv = flowvm.load(ckpt) if ckpt.exists() else build(steps=steps).start()
    log(f"{'resuming at' if drv.steps else 'starting,'} step {drv.steps}")
    training = asyncio.create_task(drv.arun())
    wanted = asyncio.Event()  # a checkpoint was asked for

    def save(why: str) -> None:
        flowvm.save(drv, ckpt)  # safe: other tasks only ever run between two steps
        log(f"checkpoint at step {drv.steps} ({why})")

    async def timer():
        while True:
            await asyncio.sleep(report_every)
            log(f"step {drv.steps}: loss {drv.registers.get('loss', float('nan')):.5f}")

    stopped_by = ["interrupted"]

    async def serve_requests():
        while True:
            await wanted.wait()
            wanted.clear()
            save("requested")

    loop = asyncio.get_running_loop()
    if hasattr(signal, "SIGUSR1"):
        loop.add_signal_handler(signal.SIGUSR1, wanted.set)
    helpers = [asyncio.create_task(timer()), asyncio.create_task(serve_requests()),
               asyncio.create_task(watch_files(workdir, wanted, training, stopped_by))]
    if demo:
        helpers.append(asyncio.create_task(demo_requests(workdir)))
    try:
        await training
        log(f"finished after {drv.steps} steps: loss {drv.registers['loss']:.6f}")
        ckpt.unlink(missing_ok=True)
    except asyncio.CancelledError:  # the STOP file, or the program itself cancelled (Ctrl-C)
        save(stopped_by[0])
    finally:
        for task in helpers:
            task.cancel()
        if hasattr(signal, "SIGUSR1"):
            loop.remove_signal_handler(signal.SIGUSR1)
    return drv


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir")
    parser.add_argument("--steps", type=int, default=100000, help="SGD steps (4 driver steps each)")
    parser.add_argument("--demo", action="store_true", help="ask for a checkpoint, then stop, by itself")
    args = parser.parse_args()
    asyncio.run(main(args.workdir, args.steps, demo=args.demo))
    sys.exit(0)
