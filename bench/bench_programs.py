#!/usr/bin/env python
"""The bundled programs: run time, checkpoint size and save/load time; Batches against torch's DataLoader.

Run from the repository root::

    python bench/bench_programs.py            # every program at its defaults
    python bench/bench_programs.py --quick    # smaller runs, a few seconds

It prints two tables and writes every figure (and the environment) to
``bench/results/programs.json``:

1. each program at its defaults (torch programs on one thread, as the flowvm
   command runs them): steps, wall time, steps per second, and for a run
   paused half way, the checkpoint size and the time of ``flowvm.save`` and
   ``flowvm.load``;
2. the cost of one minibatch (batch 64 of a 2000 x 2 float32 tensor and its
   labels) from ``flowvm.Batches.next_batch()``, from plain tensor indexing
   with a permutation, and from iterating a shuffled
   ``torch.utils.data.DataLoader`` over a TensorDataset.

Figures are measured and reported, never asserted.  Timings depend on the
machine and its load: compare runs from one machine only.  The sweep is left
out (its time is the workers' start-up and its step count counts polls).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from time import perf_counter

REPO_ROOT = Path(__file__).resolve().parent.parent

import numpy as np  # noqa: E402
import torch  # noqa: E402

import flowvm  # noqa: E402
from flowvm.base.data import Batches  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "programs.json"
QUICK = {"pca": {"batches": 2}, "kmeans": {"samples": 2000}, "mlp": {"epochs": 4}, "rbm": {"epochs": 3},
         "lbfgs": {}}


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        t0 = perf_counter()
        fn()
        times.append(perf_counter() - t0)
    return min(times)


def bench_program(name: str, options: dict, repeats: int) -> dict:
    import importlib

    module = importlib.import_module(f"flowvm.programs.{name}")
    steps = {}

    def run():
        drv = module.build(**options).start()
        drv.run()
        steps["n"] = drv.steps

    wall = best_of(repeats, run)
    half = module.build(**options).start()
    half.run(max_steps=steps["n"] // 2)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "half.ckpt"
        save_s = best_of(repeats, lambda: flowvm.save(half, path))
        size = path.stat().st_size
        load_s = best_of(repeats, lambda: flowvm.load(path, restore_random=False))
    return {"program": name, "options": options, "steps": steps["n"], "wall_s": wall,
            "steps_per_s": steps["n"] / wall, "checkpoint_bytes": size, "save_s": save_s, "load_s": load_s}


def bench_batches(epochs: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2000, 2, generator=g), torch.randint(0, 3, (2000,), generator=g)
    per_epoch = (2000 + 63) // 64

    def flowvm_batches():
        data = Batches((x, y), batch_size=64, seed=0)
        for _ in range(epochs * per_epoch):
            data.next_batch()

    def plain_indexing():
        for e in range(epochs):
            order = torch.randperm(2000, generator=g)
            for i in range(0, 2000, 64):
                idx = order[i: i + 64]
                x[idx], y[idx]

    def dataloader():
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True,
                                             generator=torch.Generator().manual_seed(0))
        for _ in range(epochs):
            for _batch in loader:
                pass

    batches = epochs * per_epoch
    rows = {}
    for label, fn in (("flowvm.Batches.next_batch", flowvm_batches), ("tensor indexing + randperm", plain_indexing),
                      ("torch DataLoader (TensorDataset)", dataloader)):
        rows[label] = best_of(repeats, fn) / batches * 1e6
    return {"batches": batches, "us_per_batch": rows}


def environment() -> dict:
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "numpy": np.__version__, "flowvm": flowvm.__version__, "commit": commit,
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller runs (CI smoke test)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the best is kept")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as the flowvm command runs the bundled torch programs
    programs = [bench_program(name, QUICK[name] if args.quick else {}, args.repeats) for name in QUICK]
    print(f"{'program':<8} {'steps':>7} {'wall s':>8} {'steps/s':>9} {'ckpt KiB':>9} {'save ms':>8} {'load ms':>8}")
    for r in programs:
        print(f"{r['program']:<8} {r['steps']:>7} {r['wall_s']:>8.3f} {r['steps_per_s']:>9.0f} "
              f"{r['checkpoint_bytes'] / 1024:>9.1f} {r['save_s'] * 1e3:>8.2f} {r['load_s'] * 1e3:>8.2f}")
    batches = bench_batches(2 if args.quick else 10, args.repeats)
    print(f"\none minibatch of 64 (2000 x 2 float32 + labels), {batches['batches']} batches:")
    for label, us in batches["us_per_batch"].items():
        print(f"  {label:<34} {us:>8.1f} µs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"programs": programs, "batches": batches, "quick": args.quick,
                                    "repeats": args.repeats, "environment": environment()}, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
