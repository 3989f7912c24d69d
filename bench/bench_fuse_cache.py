#!/usr/bin/env python
"""fuse-torch with the persistent cache of compiled steps: whole runs, cold and warm, against interpreted.

Run from the repository root::

    python bench/bench_fuse_cache.py            # full sizes (about 15 minutes here)
    python bench/bench_fuse_cache.py --quick    # small sizes (CI smoke test)
    python bench/bench_fuse_cache.py --cases train --no-pace   # the MLP's whole runs only

Cases: the 10-op elementwise chain and the d2l MLP's training step (SGD), each ``REPEAT``ed 300, 5,000 and
50,000 times with the default options.  Every run is a fresh process with its own empty inductor cache; in
interleaved rounds, each size runs

- interpreted (the program as written: ``REPEAT(n, case)``);
- optimized with a cold cache (an empty ``FLOWVM_CACHE_DIR``): what a first run costs (target: at most 1.02
  of interpreted);
- optimized with a warm cache (``FLOWVM_CACHE_DIR`` holding the step's package, put there once beforehand
  by a run that compiled it): what every later run gets (targets: the chain at least 2x faster than
  interpreted, the MLP never slower).

Then, the program's pace while a cold child compile runs: the same cases, each iteration followed by a CALL
that notes its end time, with the compile forced to start at once (``compile_after=0, payback=0``) and an
empty cache, long enough to cover the compile, counting the
100 ms windows in which the program made less than 1/1.5 of the interpreted run's median progress, next to
the interpreted run's own count (the machine's noise).
Figures are reported, never asserted; JSON goes to bench/results/fuse_cache.json.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fuse_runs import windows  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "fuse_cache.json"


def child(case: str, mode: str, n: int) -> dict:
    """One run in this (fresh) process: per-iteration end times and the fused steps' headers.  Mode
    "prime" runs the body with a compile started at once until the step is compiled and timed against eager
    (filling the cache with the package and the decision measured)."""
    import torch

    import bench_fuse
    import flowvm
    from flowvm import CALL, LOOP, REPEAT, SEQ
    from flowvm.program.paths import walk

    torch.set_num_threads(1)
    made = {"train": lambda: bench_fuse.train_case("sgd", "repeat"), "chain": bench_fuse.chain_case}[case]()
    stamps: list[float] = []
    # the runs timed for the pace count their iterations' end times; the whole runs time the case as it is
    # (a CALL more in the loop would make the interpreted program take the driver's general path)
    paced = mode in ("paced", "start-at-once")
    body = SEQ([made["body"], CALL(lambda: stamps.append(time.perf_counter()))]) if paced else made["body"]
    if mode == "prime":
        program = flowvm.optimize(LOOP(body), options={"fuse-torch": {"compile_after": 0, "payback": 0}})
        fused = [el for _, el in walk(program) if isinstance(el, flowvm.FUSED)]
        drv, deadline = program.start(), time.monotonic() + 600
        while time.monotonic() < deadline and any(el.runtime().state in ("new", "proving", "compiling")
                                                  for el in fused):
            drv.run(max_steps=200)
        while time.monotonic() < deadline and any(el.runtime().measured is None for el in fused):
            drv.run(max_steps=2000)  # the first calls, checked against eager, and the trial: kept with the entry
        return {"headers": [el.header_text() for el in fused],
                "compile_s": [round(s, 1) for el in fused for s in el.runtime().compile_seconds]}
    program = REPEAT(n, body)
    if mode == "optimized":
        program = flowvm.optimize(program)
    elif mode == "start-at-once":
        program = flowvm.optimize(program, options={"fuse-torch": {"compile_after": 0, "payback": 0}})
    t0 = time.perf_counter()
    program.run()
    total = time.perf_counter() - t0
    fused = [el for _, el in walk(program) if isinstance(el, flowvm.FUSED)]
    return {"total": total, "stamps": [s - t0 for s in stamps], "headers": [el.header_text() for el in fused],
            "hits": sum(el.runtime().hits for el in fused),
            "compile_s": [round(s, 1) for el in fused for s in el.runtime().compile_seconds]}


def run_child(case: str, mode: str, n: int, cache: str) -> dict:
    with tempfile.TemporaryDirectory() as inductor:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, FLOWVM_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, __file__, "--child", case, mode, str(n)], capture_output=True,
                             text=True, env=env, check=True, timeout=1800)
    return json.loads(out.stdout.splitlines()[-1])


def sizes_row(case: str, n: int, rounds: int, warm: str) -> dict:
    cold, hot, hits = [], [], []
    headers: dict[str, list[str]] = {}
    for _ in range(rounds):
        base = run_child(case, "interpreted", n, "off")
        with tempfile.TemporaryDirectory() as empty:
            first = run_child(case, "optimized", n, empty)
        later = run_child(case, "optimized", n, warm)
        cold.append(first["total"] / base["total"])
        hot.append(later["total"] / base["total"])
        hits.append(later["hits"])
        headers = {"cold": first["headers"], "warm": later["headers"]}
    return {"case": case, "iterations": n, "cold": statistics.median(cold), "warm": statistics.median(hot),
            "cold_ratios": cold, "warm_ratios": hot, "warm_compiled_calls": hits, "headers": headers}


def pace_row(case: str, n: int, rounds: int) -> dict:
    over, floor, shares, base_shares, compiles = [], [], [], [], []
    for _ in range(rounds):
        base = run_child(case, "paced", n, "off")
        with tempfile.TemporaryDirectory() as empty:
            opt = run_child(case, "start-at-once", n, empty)
        per_window = statistics.median(windows(base["stamps"]))
        slow = [per_window / max(w, 1) > 1.5 for w in windows(opt["stamps"])]
        own = [per_window / max(w, 1) > 1.5 for w in windows(base["stamps"])]
        over.append(sum(slow))
        floor.append(sum(own))
        shares.append(sum(slow) / max(len(slow), 1))
        base_shares.append(sum(own) / max(len(own), 1))
        compiles.append(opt["compile_s"])
    return {"case": case, "iterations": n, "share_over_1_5x": max(shares), "windows_over_1_5x": over,
            "interpreted_share_over_1_5x": max(base_shares), "interpreted_windows_over_1_5x": floor,
            "compile_s": compiles}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, quick 1)")
    parser.add_argument("--cases", default="chain,train", help="which cases (default chain,train; quick: chain)")
    parser.add_argument("--no-pace", action="store_true", help="leave out the pace during a cold compile")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--child", nargs=3, metavar=("CASE", "MODE", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        case, mode, n = args.child
        print(json.dumps(child(case, mode, int(n))))
        return 0
    rounds = args.rounds or (1 if args.quick else 3)
    start = time.perf_counter()
    cases = ["chain"] if args.quick else args.cases.split(",")
    sizes = [300] if args.quick else [300, 5000, 50000]
    pace = {} if args.quick or args.no_pace else {c: {"chain": 1500000, "train": 50000}[c] for c in cases}
    rows, primes, paces = [], {}, []
    with tempfile.TemporaryDirectory() as warm:
        for case in cases:
            primes[case] = run_child(case, "prime", 0, warm)
            rows += [sizes_row(case, n, rounds, warm) for n in sizes]
    paces = [pace_row(case, n, rounds) for case, n in pace.items()]
    print(f"{'case':6s} {'iterations':>10s} {'cold cache / interpreted':>25s} {'warm cache / interpreted':>25s}")
    for r in rows:
        print(f"{r['case']:6s} {r['iterations']:10d} {r['cold']:25.3f} {r['warm']:25.3f}")
        for h in r["headers"]["warm"]:
            print(f"    warm: {h}")
    for case, p in primes.items():
        print(f"cache filled for {case}: compile took {p['compile_s']} s; {p['headers']}")
    if paces:
        print(f"\n{'case':6s} {'iterations':>10s} {'windows > 1.5x, cold compile':>30s} {'interpreted run':>16s}")
        for p in paces:
            print(f"{p['case']:6s} {p['iterations']:10d} {p['share_over_1_5x']:29.1%} "
                  f"{p['interpreted_share_over_1_5x']:15.1%}   (counts {p['windows_over_1_5x']} vs "
                  f"{p['interpreted_windows_over_1_5x']}; compiles {p['compile_s']} s)")
    result = {"benchmark": "fuse_cache", "quick": args.quick, "rounds": rounds,
              "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                              "date": datetime.datetime.now().isoformat(timespec="seconds")},
              "rows": rows, "primes": primes, "pace": paces, "wall_s": time.perf_counter() - start}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
