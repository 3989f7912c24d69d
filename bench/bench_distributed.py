#!/usr/bin/env python
"""Data-parallel training: 2 ranks against 1 on a compute-bound model, and flowvm's per-step cost against
the same model trained by a plain torchrun DDP script (bench/ddp_plain.py), side by side in one run.

Run from the repository root::

    python bench/bench_distributed.py            # 5 rounds of 300 timed steps per case, a few minutes
    python bench/bench_distributed.py --quick    # 1 round of 30 timed steps (CI smoke test)

The model: the bundled convnet's network with 64 channels (95k parameters) on scikit-learn's digits, batches
of 128 per rank (whole batches only), SGD with momentum, torch on one thread per rank; a step is about 20 ms
of compute on one core, against an all-reduce of 0.4 MB of gradients.  Four cases run in each round, their
order rotating between rounds:

- ``flowvm 1`` and ``flowvm 2``: a flowvm program (one CALL for the batch from ``flowvm.Batches``, one for
  the update, ``--warmup`` updates, then ``--steps`` timed ones between two CALLs of the clock), started by
  ``flowvm.distributed.launch`` on 1 and 2 ranks: torch's elastic agent, the default process group, the
  network in DistributedDataParallel on 2 ranks, the ranks' periodic agreement (``sync_every``);
- ``plain 1`` and ``plain 2``: ``torchrun --nproc-per-node N bench/ddp_plain.py``, a hand-written loop over
  the same network, data and optimizer.

Each case reports the seconds per step of rank 0 over its timed steps (start-up excluded).  The figures are
the medians over rounds: the throughput of 2 ranks over 1 (samples per second: each rank takes a batch per
step; target >= 1.7x on two cores) for flowvm and for the plain script, and flowvm's step time over the plain
script's at the same world size (target within 5%).  Figures are measured and reported, never asserted: the
script exits 0 whatever they are.  They depend on the machine and its load (the 1-minute load average is
recorded before and after: two ranks need both cores).  Results go to the terminal and to
``bench/results/distributed.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
CASES = [("flowvm", 1), ("flowvm", 2), ("plain", 1), ("plain", 2)]


def build(channels: int = 64, batch_size: int = 128, warmup: int = 20, steps: int = 300, seed: int = 0):
    """The flowvm side: warmup updates, the clock, steps updates, the clock (each rank runs it)."""
    import torch

    from flowvm import CALL, REPEAT, SEQ, Batches, Registers
    from flowvm.programs import convnet

    train, _, shape, classes = convnet.images(None, 0.25, seed)
    x, y = convnet.tensors(train, shape)
    torch.manual_seed(seed)
    network = convnet.ConvNet(shape, channels, classes)
    trainer = convnet.Trainer(network, torch.optim.SGD(network.parameters(), lr=0.05, momentum=0.9))
    batches = Batches((x, y), batch_size=batch_size, seed=seed, drop_last=True)
    reg = Registers(start=None, end=None, loss=None)

    def updates(n):
        return REPEAT(n, SEQ([CALL(batches.next_batch, store_to=reg("batch")),
                              CALL(trainer.train_step, reg("batch"), store_to=reg("loss"))]))

    return SEQ([updates(warmup), CALL(time.perf_counter, store_to=reg("start")), updates(steps),
                CALL(time.perf_counter, store_to=reg("end"))]).with_process_settings({"torch.threads": 1})


def flowvm_case(nproc: int, options: dict, out: str) -> None:
    """Run build() on nproc ranks with flowvm.distributed.launch; rank 0's seconds per step to out."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(BENCH))
    import bench_distributed  # by its module name: the ranks import build() from it
    from flowvm.distributed import launch

    drv = launch(bench_distributed.build, nproc=nproc, options=options)
    regs = drv.registers
    Path(out).write_text(json.dumps({"step_s": (regs["end"] - regs["start"]) / options["steps"],
                                     "steps": options["steps"], "world_size": nproc, "loss": regs["loss"]}))


def run_case(kind: str, nproc: int, options: dict, timeout: float) -> dict:
    """One case in a fresh process (its start-up untimed): rank 0's figures."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(BENCH), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "case.json")
        if kind == "flowvm":
            cmd = [sys.executable, str(Path(__file__).resolve()), "--case", str(nproc), "--case-out", out,
                   "--options", json.dumps(options)]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(BENCH / "ddp_plain.py"),
                   "--channels", str(options["channels"]), "--batch-size", str(options["batch_size"]),
                   "--warmup", str(options["warmup"]), "--steps", str(options["steps"]), "--out", out]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
        if done.returncode != 0 or not Path(out).exists():
            raise RuntimeError(f"{kind} {nproc}: exit status {done.returncode}\n{done.stderr[-3000:]}")
        return json.loads(Path(out).read_text())


def load() -> float:
    return os.getloadavg()[0]


def summarize(samples: dict, batch: int) -> dict:
    """Medians per case, and the ratios the targets name."""
    med = {case: statistics.median(times) for case, times in samples.items()}
    figures = {"step_ms": {case: 1000 * t for case, t in med.items()}}
    for kind in ("flowvm", "plain"):
        one, two = med[f"{kind} 1"], med[f"{kind} 2"]
        figures[f"{kind}_speedup_2_vs_1"] = (2 * batch / two) / (batch / one)
    for n in (1, 2):
        figures[f"flowvm_over_plain_{n}"] = med[f"flowvm {n}"] / med[f"plain {n}"]
    figures["samples_per_s"] = {case: batch * int(case.split()[1]) / t for case, t in med.items()}
    return figures


def table(figures: dict, samples: dict) -> str:
    lines = [f"{'case':<10} {'ms/step':>9} {'samples/s':>10}  rounds (ms/step)"]
    for case in samples:
        rounds = " ".join(f"{1000 * t:.2f}" for t in samples[case])
        lines.append(f"{case:<10} {figures['step_ms'][case]:>9.2f} {figures['samples_per_s'][case]:>10.0f}  {rounds}")
    lines += ["",
              f"2 ranks vs 1, throughput: flowvm {figures['flowvm_speedup_2_vs_1']:.2f}x, "
              f"plain {figures['plain_speedup_2_vs_1']:.2f}x (target >= 1.7x)",
              f"flowvm / plain step time: 1 rank {figures['flowvm_over_plain_1']:.3f}, "
              f"2 ranks {figures['flowvm_over_plain_2']:.3f} (target <= 1.05)"]
    return "\n".join(lines)


def environment() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpus": os.cpu_count(), "commit": commit}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 30 timed steps (CI smoke test)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=str(BENCH / "results" / "distributed.json"))
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)  # internal: one flowvm case
    parser.add_argument("--case-out", help=argparse.SUPPRESS)
    parser.add_argument("--options", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        return flowvm_case(args.case, json.loads(args.options), args.case_out)
    rounds = args.rounds or (1 if args.quick else 5)
    options = {"channels": 64, "batch_size": 128, "warmup": 5 if args.quick else 20,
               "steps": args.steps or (30 if args.quick else 300), "seed": 0}
    samples: dict[str, list[float]] = {f"{kind} {n}": [] for kind, n in CASES}
    before = load()
    print(f"load average before: {before:.2f}; {rounds} round(s) of {options['steps']} timed steps per case",
          flush=True)
    for r in range(rounds):
        for kind, n in CASES[r % len(CASES):] + CASES[:r % len(CASES)]:
            got = run_case(kind, n, options, timeout=600)
            samples[f"{kind} {n}"].append(got["step_s"])
            print(f"  round {r + 1}: {kind} {n}: {1000 * got['step_s']:.2f} ms/step", flush=True)
    figures = summarize(samples, options["batch_size"])
    after = load()
    print(table(figures, samples))
    print(f"load average after: {after:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"figures": figures, "samples_s": samples, "options": options,
                                          "rounds": rounds, "load_before": before, "load_after": after,
                                          "environment": environment()}, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
