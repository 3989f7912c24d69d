"""Benchmark of POPEN, SPAWN and event-loop driving.

1. Round trip of a trivial SPAWN (submit, run a one-CALL fragment, merge back)
   on the default local process pool and on a Dask LocalCluster, next to the
   executor's own round trip (``executor.submit(abs, -1).result()``), so
   flowvm's share is visible.
2. Speed-up of two CPU-bound fragments woven as SPAWNs
   (``WEAVE(-1, [SPAWN(a), SPAWN(b)])``) against running them one after the
   other in this process; the issue's target is >= 1.7x on 2 cores.  The
   load average is recorded with it: on a shared machine the figure is only
   as good as the cores that were free.
3. CPU used by this process while ``arun()`` (and ``run()``) wait on a POPEN
   that sleeps, against a naive ``while drv.step() is INCOMPLETE`` loop.
4. Per-step cost of ``arun()`` (yielding to the event loop after every step,
   or every 100) against ``run()``.

Figures are measured and reported, never asserted: the script exits 0
whatever they are.  Results go to bench/results/processes.json.

    python bench/bench_processes.py            # full sizes (about 2 minutes)
    python bench/bench_processes.py --quick    # CI smoke run (well under 2 minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from time import perf_counter

REPO_ROOT = Path(__file__).resolve().parent.parent

import psutil  # noqa: E402

import flowvm  # noqa: E402
from flowvm import CALL, INCOMPLETE, POPEN, REPEAT, SEQ, SPAWN, WEAVE, Registers  # noqa: E402
from flowvm.processes.executors import default_executor, default_workers  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "processes.json"

# (full, quick)
SIZES = {
    "round_trips": (200, 40),
    "burn_n": (6_000_000, 2_000_000),   # iterations of the CPU-bound loop (about 0.25 s per million)
    "speedup_repeats": (3, 2),
    "sleep_s": (3.0, 1.0),
    "per_step": (200_000, 20_000),
}
TARGET_SPEEDUP = 1.7


def burn(n: int) -> int:
    """A CPU-bound pure-Python loop."""
    s = 0
    for i in range(n):
        s = (s + i * i) % 1_000_003
    return s


def timed_burn(n: int) -> tuple:
    """burn(n), with where it ran, its start and end times and the CPU time it got."""
    c0, t0 = time.process_time(), time.time()
    value = burn(n)
    return value, os.getpid(), t0, time.time(), time.process_time() - c0


def warm(executor, workers: int) -> None:
    """Start every worker of the pool (they start on demand)."""
    futures = [executor.submit(time.sleep, 0.3) for _ in range(workers)]
    for f in futures:
        f.result()


def cpu_seconds() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


# --------------------------------------------------------------------------- 1. round trips
def round_trip(executor, n: int) -> dict:
    reg = Registers(x=-1)
    prog = SPAWN(CALL(abs, reg("x"), store_to=reg("y")), executor=executor)
    raw, spawn = [], []
    for _ in range(n):  # interleaved, so drifts of the machine hit both alike
        t0 = perf_counter()
        (executor or default_executor()).submit(abs, -1).result()
        raw.append(perf_counter() - t0)
        t0 = perf_counter()
        prog.run()
        spawn.append(perf_counter() - t0)
    return {"n": n, "spawn_ms_median": statistics.median(spawn) * 1e3, "spawn_ms_best": min(spawn) * 1e3,
            "executor_ms_median": statistics.median(raw) * 1e3, "executor_ms_best": min(raw) * 1e3}


def dask_round_trip(n: int) -> dict | None:
    try:
        import distributed
    except ImportError:
        return None
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                       dashboard_address=None)
    client = distributed.Client(cluster)
    try:
        ex = client.get_executor()
        warm(ex, 2)
        row = round_trip(ex, n)
    finally:
        client.close()
        cluster.close()
    return row


# --------------------------------------------------------------------------- 2. speed-up
def speedup(n: int, repeats: int) -> dict:
    reg = Registers(n=n)
    a = CALL(timed_burn, reg("n"), store_to=reg("a"))
    b = CALL(timed_burn, reg("n"), store_to=reg("b"))
    sequential = SEQ([a, b])
    woven = WEAVE(-1, [SPAWN(a), SPAWN(b)])
    one_by_one = SEQ([SPAWN(a), SPAWN(b)])
    warm(default_executor(), default_workers())
    keys = ("sequential", "woven", "spawns_one_by_one")
    times: dict[str, list] = {k: [] for k in keys}
    outside: dict[str, list] = {k: [] for k in keys}
    load, shares, overlaps = [], [], []
    for _ in range(repeats):
        load.append(os.getloadavg()[0])
        for key, prog in zip(keys, (sequential, woven, one_by_one)):
            t0 = time.time()
            prog.run()
            total = time.time() - t0
            times[key].append(total)
            (_, _, sa, ea, ca), (_, _, sb, eb, cb) = reg["a"], reg["b"]
            # Time the program spent outside the fragments' own runs: submitting, polling, merging back.
            busy = (max(ea, eb) - min(sa, sb)) if key == "woven" else (ea - sa) + (eb - sb)
            outside[key].append(total - busy)
            if key == "woven":
                # CPU share: the part of a core each fragment got while it ran (1.0: a core of its own)
                shares.append([ca / (ea - sa), cb / (eb - sb)])
                overlaps.append(max(0.0, min(ea, eb) - max(sa, sb)) / max(ea - sa, eb - sb))
    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"burn_n": n, "seconds_best": best, "seconds_median": median, "seconds_all": times,
            "seconds_outside_fragments_median": {k: statistics.median(v) for k, v in outside.items()},
            "woven_cpu_share_per_fragment": shares, "woven_overlap_fraction": overlaps,
            "speedup": best["sequential"] / best["woven"],
            "speedup_median": median["sequential"] / median["woven"], "target": TARGET_SPEEDUP,
            "meets_target": best["sequential"] / best["woven"] >= TARGET_SPEEDUP,
            "load_average_1min": load, "cores": os.cpu_count(), "pool_workers": default_workers()}


# --------------------------------------------------------------------------- 3. CPU while waiting
def waiting_cpu(seconds: float) -> list[dict]:
    cmd = [sys.executable, "-c", f"import time; time.sleep({seconds})"]

    def measure(label, drive):
        drv = POPEN(cmd).start()
        c0, t0 = cpu_seconds(), perf_counter()
        drive(drv)
        wall, cpu = perf_counter() - t0, cpu_seconds() - c0
        return {"case": label, "wall_s": wall, "cpu_s": cpu, "cpu_percent": 100 * cpu / wall, "polls": drv.steps}

    def busy(drv):
        while drv.step() is INCOMPLETE:
            pass

    return [
        measure("await drv.arun()", lambda drv: asyncio.run(drv.arun())),
        measure("drv.run()", lambda drv: drv.run()),
        measure("while drv.step() is INCOMPLETE (busy loop)", busy),
    ]


# --------------------------------------------------------------------------- 4. arun per step
def f(x):
    return x


def per_step(n: int) -> list[dict]:
    """µs per step of a REPEAT of a SEQ of two CALLs: run() against arun() at two yield sizes."""

    def program():
        reg = Registers(x=0)
        return REPEAT(n // 2, SEQ([CALL(f, reg("x"), store_to=reg("y")), CALL(f, reg("y"), store_to=reg("x"))]))

    cases = [("drv.run()", lambda d: d.run()),
             ("await drv.arun() (steps_per_yield=1)", lambda d: asyncio.run(d.arun())),
             ("await drv.arun(steps_per_yield=100)", lambda d: asyncio.run(d.arun(steps_per_yield=100)))]
    rows = []
    for label, drive in cases:
        best = float("inf")
        for _ in range(3):
            drv = program().start()
            t0 = perf_counter()
            drive(drv)
            best = min(best, (perf_counter() - t0) / drv.steps)
        rows.append({"case": label, "steps": n, "us_per_step": best * 1e6})
    return rows


# --------------------------------------------------------------------------- report
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke test)")
    parser.add_argument("--no-dask", action="store_true", help="skip the Dask cluster")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    k = 1 if args.quick else 0
    sizes = {key: v[k] for key, v in SIZES.items()}
    started = perf_counter()

    warm(default_executor(), default_workers())
    trips = {"local pool": round_trip(None, sizes["round_trips"])}
    dask_row = None if args.no_dask else dask_round_trip(sizes["round_trips"])
    if dask_row is not None:
        trips["dask LocalCluster (2 workers)"] = dask_row
    print(f"\n1. Round trip of a trivial SPAWN (median of {sizes['round_trips']}, best in brackets)")
    print(f"{'executor':<32} {'SPAWN ms':>16} {'executor alone ms':>20}")
    for name, r in trips.items():
        print(f"{name:<32} {r['spawn_ms_median']:>8.2f} ({r['spawn_ms_best']:.2f}) "
              f"{r['executor_ms_median']:>12.2f} ({r['executor_ms_best']:.2f})")
    if dask_row is None and not args.no_dask:
        print("dask: not installed (pip install dask[distributed])")

    sp = speedup(sizes["burn_n"], sizes["speedup_repeats"])
    print(f"\n2. Two CPU-bound fragments (burn({sizes['burn_n']:,}) each), best of {sizes['speedup_repeats']}; "
          f"{sp['pool_workers']} pool workers, load average {', '.join(f'{x:.2f}' for x in sp['load_average_1min'])}")
    print(f"{'':<36} {'best s':>7} {'median s':>9} {'outside the fragments (median) ms':>35}")
    for key, label in (("sequential", "one after the other, in-process"), ("spawns_one_by_one", "SEQ of two SPAWNs"),
                       ("woven", "WEAVE(-1, [SPAWN(a), SPAWN(b)])")):
        print(f"{label:<36} {sp['seconds_best'][key]:>7.3f} {sp['seconds_median'][key]:>9.3f} "
              f"{sp['seconds_outside_fragments_median'][key] * 1e3:>35.1f}")
    print(f"speed-up (sequential / woven): {sp['speedup']:.2f}x best, {sp['speedup_median']:.2f}x median  "
          f"(target >= {TARGET_SPEEDUP}x: {'met' if sp['meets_target'] else 'NOT met'} by the best times)")
    shares = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in sp["woven_cpu_share_per_fragment"])
    overlaps = ", ".join(f"{o:.2f}" for o in sp["woven_overlap_fraction"])
    print(f"woven runs: overlap of the two fragments {overlaps}; CPU share of a core each got {shares} "
          "(below 1.0: other load took the cores)")

    waits = waiting_cpu(sizes["sleep_s"])
    print(f"\n3. CPU of this process while a POPEN sleeps {sizes['sleep_s']} s")
    print(f"{'driving loop':<44} {'wall s':>7} {'CPU s':>7} {'CPU %':>7} {'polls':>9}")
    for r in waits:
        print(f"{r['case']:<44} {r['wall_s']:>7.2f} {r['cpu_s']:>7.3f} {r['cpu_percent']:>6.1f}% {r['polls']:>9,}")

    steps = per_step(sizes["per_step"])
    print(f"\n4. Per-step cost of driving from asyncio (REPEAT of SEQ of two CALLs, {sizes['per_step']:,} steps)")
    for r in steps:
        print(f"{r['case']:<44} {r['us_per_step']:>7.2f} µs/step")

    result = {
        "benchmark": "processes", "quick": args.quick, "sizes": sizes,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform(), "flowvm": flowvm.__version__,
        "round_trip": trips, "speedup": sp, "waiting_cpu": waits, "per_step": steps, "seconds": perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out} ({result['seconds']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
