#!/usr/bin/env python
"""Data preparation that keeps up with a model: flowvm.Batches(workers=2) against torch's
DataLoader(num_workers=2) and against Batches(workers=0), side by side in one run.

Run from the repository root::

    python bench/bench_data.py            # 5 rounds of 40 batches per pipeline, about a minute
    python bench/bench_data.py --quick    # 2 rounds of 8 batches (CI smoke test)

The pipeline: 4096 samples of 3x32x32 float32 images and an int label; each sample goes through a numpy
augmentation (a random crop with padding, a random flip, a random brightness and contrast, then a chain
of elementwise passes calibrated at start-up to about ``--sample-ms`` milliseconds of work in all);
batches of 64 feed a small torch convolutional network (one forward, backward and SGD step per batch).
Preparation dominates: about 64 ms of augmentation per batch against a few ms of training.

Each pipeline is started and warmed up (its workers running, a few batches taken) before it is timed;
a round times ``--batches`` training steps of each pipeline in turn (the order rotating between rounds),
and the figures are the medians over rounds of samples per second and of the CPU time per sample
spent by the main process and the pipeline's workers together (what the pipeline costs, whatever else
runs on the machine: on a loaded machine the throughputs say little, the CPU times still compare).  Every pipeline gives each sample the
same augmentation work; the DataLoader's workers keep running across epochs (persistent_workers) as
Batches' do.  torch runs one thread in the main process and in the workers (as DataLoader's workers do).

Figures are measured and reported, never asserted: the script exits 0 whatever they are.  They depend on
the machine and its load (report what else ran); compare the ratios, measured side by side in one run.
Results go to the terminal and to ``bench/results/data.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flowvm import Batches  # noqa: E402

N, SHAPE, BATCH = 4096, (3, 32, 32), 64
PASSES = [8]  # elementwise passes per sample; calibrated in main() (a list: the workers inherit it by fork)


def augment(sample, rng):
    """About --sample-ms of numpy work on one (image, label) sample, drawn from rng."""
    image, label = sample
    padded = np.pad(image, ((0, 0), (4, 4), (4, 4)), mode="reflect")
    top, left = rng.integers(0, 9, size=2)
    out = padded[:, top:top + 32, left:left + 32]
    if rng.random() < 0.5:
        out = out[:, :, ::-1]
    out = out * rng.uniform(0.8, 1.2) + rng.uniform(-0.1, 0.1)
    for _ in range(PASSES[0]):
        out = np.tanh(out * 1.01 + 0.01)
    return np.ascontiguousarray(out, dtype=np.float32), label


class Augmented(torch.utils.data.Dataset):
    """The same samples and augmentation as a torch Dataset (its generator seeded by epoch and index)."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels
        self.epoch = 0

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return augment((self.images[i], self.labels[i]), np.random.default_rng([0, self.epoch, i]))


def calibrate(images, target_ms: float) -> float:
    """Set PASSES so that one augmentation takes about target_ms of CPU time on this machine (the fastest of
    several measurements: other processes only slow a measurement down); the time per sample (ms)."""
    rng = np.random.default_rng(0)

    def per_sample() -> float:
        best = float("inf")
        for _ in range(7):
            start = time.process_time()
            for i in range(20):
                augment((images[i], 0), rng)
            best = min(best, (time.process_time() - start) / 20 * 1000)
        return best

    PASSES[0] = 1
    base = per_sample()
    PASSES[0] = 81
    slope = (per_sample() - base) / 80
    PASSES[0] = max(1, round(1 + (target_ms - base) / max(slope, 1e-6)))
    return per_sample()


def model_and_step():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.MaxPool2d(2), torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.MaxPool2d(4), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step(batch) -> float:
        x, y = batch
        x = torch.as_tensor(x)
        y = torch.as_tensor(y)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def pipelines(images, labels):
    """name -> (a function returning the next batch, a function returning its worker pids), each started."""
    out = {}
    for workers in (0, 2):
        data = Batches((images, labels), batch_size=BATCH, seed=0, transform=augment, workers=workers,
                       prefetch=2)
        out[f"Batches(workers={workers})"] = (data.next_batch, lambda data=data: data.worker_pids)
    ds = Augmented(images, labels)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2, prefetch_factor=2,
                                         persistent_workers=True)
    state = {"it": iter(loader)}

    def next_loader_batch():
        try:
            return next(state["it"])
        except StopIteration:
            state["it"] = iter(loader)
            return next(state["it"])

    out["DataLoader(num_workers=2)"] = (next_loader_batch,
                                        lambda: [w.pid for w in getattr(state["it"], "_workers", [])])
    return out


def cpu_seconds(pids) -> float:
    """CPU time used so far by this process and the processes pids (user and system; this process only
    without psutil, which the test extras install)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return time.process_time()
    total = time.process_time()
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:  # pragma: no cover
            pass
    return total


def timed(pipe, step, batches: int) -> tuple[float, float]:
    """(samples per second, CPU ms per sample in this process and the pipeline's workers)."""
    next_batch, pids = pipe
    workers = pids()
    cpu = cpu_seconds(workers)
    start = time.perf_counter()
    for _ in range(batches):
        step(next_batch())
    wall = time.perf_counter() - start
    while workers:  # let the workers fill their queues again, as they were at the start: count that work too
        before = cpu_seconds(workers) - time.process_time()
        time.sleep(0.05)
        if cpu_seconds(workers) - time.process_time() - before < 0.002:
            break
    return batches * BATCH / wall, (cpu_seconds(workers) - cpu) / (batches * BATCH) * 1000


def machine_load() -> str:
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        return "unknown"
    return "load average {:.2f} {:.2f} {:.2f}".format(*load)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 8 batches (CI smoke test)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--sample-ms", type=float, default=1.0)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "data.json"))
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    batches = args.batches or (8 if args.quick else 40)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((N,) + SHAPE, dtype=np.float32)
    labels = rng.integers(0, 10, N)
    sample_ms = calibrate(images, args.sample_ms)
    step = model_and_step()
    start = time.perf_counter()
    for i in range(5):
        step((torch.as_tensor(images[:BATCH]), torch.as_tensor(labels[:BATCH])))
    step_ms = (time.perf_counter() - start) / 5 * 1000
    load_before = machine_load()
    pipes = pipelines(images, labels)
    for next_batch, _ in pipes.values():  # warm up: workers started, queues full
        for _ in range(3):
            step(next_batch())
    time.sleep(0.5)
    results: dict[str, list[float]] = {name: [] for name in pipes}
    cpu: dict[str, list[float]] = {name: [] for name in pipes}
    names = list(pipes)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rate, cpu_ms = timed(pipes[name], step, batches)
            results[name].append(rate)
            cpu[name].append(cpu_ms)
    medians = {name: statistics.median(v) for name, v in results.items()}
    cpu_medians = {name: statistics.median(v) for name, v in cpu.items()}
    serial = medians["Batches(workers=0)"]
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "load_before": load_before, "load_after": machine_load()},
        "setup": {"samples": N, "shape": list(SHAPE), "batch_size": BATCH, "augment_ms_per_sample": sample_ms,
                  "train_step_ms": step_ms, "rounds": rounds, "batches_per_round": batches},
        "samples_per_s": {name: {"median": medians[name], "rounds": results[name],
                                 "vs_workers0": medians[name] / serial} for name in names},
        "cpu_ms_per_sample": {name: {"median": cpu_medians[name], "rounds": cpu[name]} for name in names},
    }
    print(f"augmentation {sample_ms:.2f} ms/sample, training step {step_ms:.1f} ms/batch of {BATCH}; "
          f"{rounds} rounds of {batches} batches; {load_before}")
    print(f"{'pipeline':28s} {'samples/s (median)':>19s} {'vs workers=0':>13s} {'CPU ms/sample':>14s}   rounds")
    for name in names:
        rounds_text = " ".join(f"{v:.0f}" for v in results[name])
        print(f"{name:28s} {medians[name]:19.0f} {medians[name] / serial:12.2f}x {cpu_medians[name]:14.2f}   "
              f"{rounds_text}")
    loader = medians["DataLoader(num_workers=2)"]
    print(f"Batches(workers=2) / DataLoader(num_workers=2): {medians['Batches(workers=2)'] / loader:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
