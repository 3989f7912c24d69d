#!/usr/bin/env python
"""fuse-torch over whole runs: never slower than interpreted, compile time and imports included.

Run from the repository root::

    python bench/bench_fuse_runs.py            # full sizes (a few minutes)
    python bench/bench_fuse_runs.py --quick    # small sizes (CI smoke test)

Every run is a fresh process with an empty inductor cache (cold: the compiler's imports and every compile
counted), and records the time at which each iteration ends.  For each case it compares the optimized
program with the interpreted one, in interleaved rounds:

- the whole run's time, optimized / interpreted (target: at most 1.02 with the default options);
- the slowest 100 ms window of the optimized run: the interpreted run's median iterations per window over
  the optimized run's iterations in that window (target: at most 1.5), and how many windows exceed 1.5x
  (most in any round), next to how many of the interpreted run's own windows do (the machine's noise);
- what the fused step did (its header: compiled, or why it stayed eager).

Cases: the d2l MLP's training step (SGD) and its inference, 300 and 20,000 iterations, default options;
the 10-op elementwise chain and the MLP's training step with a compile forced to start at once
(``compile_after=0, payback=0``) over a long run, to show the program's pace while the compiler imports and
compiles in the background: in a child process (the default, "start-at-once") and on the compile thread
("at-once-thread", ``compile_in="thread"``), also for the same MLP written as a class with its own
forward ("own", compiled in the child under dynamo's guards); and the chain's steady state, compiled (forced, compiled before
timing) against interpreted (target: at least 2x).  ``--only train/start-at-once`` (case/mode, repeatable)
runs some rows only.
Figures are reported, never asserted; JSON goes to bench/results/fuse_runs.json.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "fuse_runs.json"
WINDOW = 0.1


def child(case: str, mode: str, n: int) -> dict:
    """One run in this (fresh) process: per-iteration end times and the fused steps' headers."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    import bench_fuse
    import flowvm
    from flowvm import CALL, REPEAT, SEQ
    from flowvm.program.paths import walk

    torch.set_num_threads(1)
    made = {"train": lambda: bench_fuse.train_case("sgd", "repeat"), "infer": bench_fuse.mlp_infer_case,
            "chain": bench_fuse.chain_case, "own": lambda: bench_fuse.train_case("sgd", "repeat", own=True)}[case]()
    stamps: list[float] = []
    program = REPEAT(n, SEQ([made["body"], CALL(lambda: stamps.append(time.perf_counter()))]))
    if mode == "default":
        program = flowvm.optimize(program)
    elif mode == "start-at-once":
        program = flowvm.optimize(program, options={"fuse-torch": {"compile_after": 0, "payback": 0}})
    elif mode == "at-once-thread":
        program = flowvm.optimize(program, options={"fuse-torch": {"compile_after": 0, "payback": 0,
                                                                   "compile_in": "thread"}})
    elif mode == "compiled":
        program = flowvm.optimize(program, options={"fuse-torch": {"form": "compiled", "background": False}})
        program.start().run(max_steps=len(made["body"].elements) + 2)  # compile before timing
        stamps.clear()
    t0 = time.perf_counter()
    program.run()
    total = time.perf_counter() - t0
    fused = [el for _, el in walk(program) if isinstance(el, flowvm.FUSED)]
    return {"total": total, "stamps": [s - t0 for s in stamps], "headers": [el.header_text() for el in fused],
            "compile_s": [round(s, 1) for el in fused for s in el.runtime().compile_seconds]}


def run_child(case: str, mode: str, n: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        # cold: no inductor cache, no cache of compiled packages (bench_fuse_cache.py measures that one)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, FLOWVM_CACHE_DIR="off")
        out = subprocess.run([sys.executable, __file__, "--child", case, mode, str(n)], capture_output=True,
                             text=True, env=env, check=True, timeout=1800)
    return json.loads(out.stdout.splitlines()[-1])


def windows(stamps: list[float]) -> list[int]:
    if not stamps:
        return []
    edges = [k * WINDOW for k in range(int(stamps[-1] / WINDOW))]
    return [bisect.bisect_left(stamps, e + WINDOW) - bisect.bisect_left(stamps, e) for e in edges]


def compare(case: str, mode: str, n: int, rounds: int) -> dict:
    totals, worst, over, headers, compiles, floor = [], [], [], [], [], []
    for _ in range(rounds):
        base = run_child(case, "interpreted", n)
        opt = run_child(case, mode, n)
        totals.append(opt["total"] / base["total"])
        per_window = statistics.median(windows(base["stamps"])) if windows(base["stamps"]) else None
        slow = [per_window / max(w, 1) for w in windows(opt["stamps"])] if per_window else []
        worst.append(max(slow) if slow else None)
        over.append(sum(s > 1.5 for s in slow))
        floor.append(sum(per_window / max(w, 1) > 1.5 for w in windows(base["stamps"])) if per_window else 0)
        headers = opt["headers"]
        compiles.append(opt["compile_s"])
    return {"case": case, "mode": mode, "iterations": n, "ratio": statistics.median(totals), "ratios": totals,
            "worst_window": max((w for w in worst if w is not None), default=None),
            "windows_over_1_5x": max(over) if over else 0, "headers": headers, "compile_s": compiles,
            "interpreted_windows_over_1_5x": max(floor) if floor else 0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, quick 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", action="append", default=[], metavar="CASE/MODE",
                        help="run only these rows (e.g. chain/start-at-once); repeatable")
    parser.add_argument("--child", nargs=3, metavar=("CASE", "MODE", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        case, mode, n = args.child
        print(json.dumps(child(case, mode, int(n))))
        return 0
    rounds = args.rounds or (1 if args.quick else 3)
    start = time.perf_counter()
    plan = ([("train", "default", 300), ("infer", "default", 300), ("chain", "compiled", 3000)] if args.quick else
            [("train", "default", 300), ("train", "default", 20000), ("infer", "default", 300),
             ("infer", "default", 20000), ("chain", "start-at-once", 1500000), ("chain", "at-once-thread", 1500000),
             ("chain", "compiled", 100000), ("train", "start-at-once", 100000), ("train", "at-once-thread", 100000),
             ("own", "start-at-once", 100000), ("own", "at-once-thread", 100000)])
    if args.only:
        plan = [row for row in plan if f"{row[0]}/{row[1]}" in args.only]
    rows = [compare(case, mode, n, rounds) for case, mode, n in plan]
    print(f"{'case':8s} {'options':14s} {'iterations':>10s} {'optimized/interpreted':>22s} "
          f"{'worst 100 ms window':>20s} {'windows > 1.5x':>15s} {'(interpreted run)':>18s}")
    for r in rows:
        worst = f"{r['worst_window']:.2f}x" if r["worst_window"] is not None else "-"
        print(f"{r['case']:8s} {r['mode']:14s} {r['iterations']:10d} {r['ratio']:22.3f} {worst:>20s} "
              f"{r['windows_over_1_5x']:15d} {r['interpreted_windows_over_1_5x']:18d}")
        for h in r["headers"]:
            print(f"    {h}")
        if any(r["compile_s"]):
            print(f"    compiles took (s, each round): {r['compile_s']}")
    result = {"benchmark": "fuse_runs", "quick": args.quick, "rounds": rounds, "window_s": WINDOW,
              "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                              "date": datetime.datetime.now().isoformat(timespec="seconds")},
              "rows": rows, "wall_s": time.perf_counter() - start}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
