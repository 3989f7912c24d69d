"""Benchmark of POPEN, SPAWN and event-loop driving.

1. Round trip of a trivial SPAWN (submit, run a one-CALL fragment, merge back)
   on the default local process pool and on a Dask LocalCluster, next to the
   executor's own round trip (``executor.submit(abs, -1).result()``), so
   flowvm's share is visible.
2. Speed-up of two CPU-bound fragments of about 2 s each (0.5 s with
   --quick; the loop's size is calibrated on this machine) woven as SPAWNs
   (``WEAVE(-1, [SPAWN(a), SPAWN(b)])``) against running them one after the
   other in this process, side by side with the anchor: the same two calls
   submitted straight to a bare ``ProcessPoolExecutor`` (a fresh forkserver
   pool of two workers, and the default pool's own executor).  The cases
   run interleaved, round by round, each round in a rotated order; the
   table gives medians over the rounds, the speed-up of each case over the
   sequential one, and where the time outside the fragments goes: from the
   start of the case to the later fragment's start in its worker (submit,
   pickling, the worker picking it up), from the later fragment's end to
   the case's end (sending the result back, the parent noticing, merging),
   and the parent's own CPU time (its polling).  The target is >= 1.8x on
   2 cores.  The same comparison from a fresh interpreter ("cold": the pool
   and its workers start first) follows: the WEAVE as the program's first
   work, and after an in-process setup step of 1 s (loading data, say)
   while the pool starts in the background, each beside the older start
   (the pool started by the first SPAWN's first step, each worker importing
   flowvm itself) and a bare pool.  The load average is recorded:
   on a shared machine the figures are only as good as the cores that were
   free.
3. CPU used by this process while ``arun()`` (and ``run()``) wait on a POPEN
   that sleeps, against a naive ``while drv.step() is INCOMPLETE`` loop.
4. Per-step cost of ``arun()`` (yielding to the event loop after every step,
   or every 100) against ``run()``.

Figures are measured and reported, never asserted: the script exits 0
whatever they are.  Results go to bench/results/processes.json.

    python bench/bench_processes.py                  # full sizes (about 3 minutes)
    python bench/bench_processes.py --quick          # CI smoke run (well under 2 minutes)
    python bench/bench_processes.py --only speedup   # section 2 alone
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
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
    "fragment_s": (2.0, 0.5),           # seconds one CPU-bound fragment takes (the loop size is calibrated)
    "speedup_rounds": (7, 3),
    "cold_rounds": (5, 1),
    "setup_s": (1.0, 0.3),             # the in-process step before the SPAWNs in the cold "setup" cases
    "sleep_s": (3.0, 1.0),
    "per_step": (200_000, 20_000),
}
TARGET_SPEEDUP = 1.8


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


@contextlib.contextmanager
def dask_executor():
    """An executor on a Dask LocalCluster of two one-thread worker processes on 127.0.0.1 (None without
    Dask); the cluster closes after the block."""
    try:
        import distributed
    except ImportError:
        yield None
        return
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                       dashboard_address=None)
    client = distributed.Client(cluster)
    try:
        yield client.get_executor()
    finally:
        client.close()
        cluster.close()


def dask_round_trip(n: int) -> dict | None:
    with dask_executor() as ex:
        if ex is None:
            return None
        warm(ex, 2)
        return round_trip(ex, n)


# --------------------------------------------------------------------------- 2. speed-up
def calibrate(seconds: float) -> int:
    """Iterations of burn() that take about seconds on this machine (the fastest of three probes of about
    0.2 s, after one that lets the core's clock settle)."""
    n = 500_000
    n = max(n, int(n * 0.2 / _timed(burn, n)))
    best = min(_timed(burn, n) for _ in range(3))
    return max(100_000, int(n * seconds / best))


def _timed(fn, *args) -> float:
    t0 = perf_counter()
    fn(*args)
    return perf_counter() - t0


def _pair(executor, n: int) -> list:
    """The two fragments' calls submitted straight to executor (the anchor)."""
    futures = [executor.submit(timed_burn, n) for _ in range(2)]
    return [f.result() for f in futures]


SPEEDUP_CASES = {  # key: (label, runs in parallel)
    "sequential": ("one after the other, in-process", False),
    "woven": ("WEAVE(-1, [SPAWN(a), SPAWN(b)])", True),
    "bare_pool": ("bare ProcessPoolExecutor (2 workers)", True),
    "bare_default_pool": ("default pool's executor, submit x2", True),
    "spawns_one_by_one": ("SEQ([SPAWN(a), SPAWN(b)])", False),
}


def speedup(n: int, rounds: int) -> dict:
    import concurrent.futures as cf
    import multiprocessing

    reg = Registers(n=n)
    a = CALL(timed_burn, reg("n"), store_to=reg("a"))
    b = CALL(timed_burn, reg("n"), store_to=reg("b"))
    programs = {"sequential": SEQ([a, b]), "woven": WEAVE(-1, [SPAWN(a), SPAWN(b)]),
                "spawns_one_by_one": SEQ([SPAWN(a), SPAWN(b)])}
    methods = multiprocessing.get_all_start_methods()
    bare = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context(
        "forkserver" if "forkserver" in methods else "spawn"))
    pool = default_executor()
    warm(pool, default_workers())
    warm(bare, 2)
    for prog in programs.values():  # every path once, untimed (first-use imports)
        prog.run()

    def run_case(key: str) -> list:
        if key in programs:
            programs[key].run()
            return [reg["a"], reg["b"]]
        return _pair(bare if key == "bare_pool" else pool, n)

    keys = list(SPEEDUP_CASES)
    samples: dict[str, list] = {k: [] for k in keys}
    load = []
    for r in range(rounds):
        load.append(os.getloadavg()[0])
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotated: drifts hit every case alike
            c0, t0 = time.process_time(), time.time()  # this process's CPU time, all its threads
            frags = run_case(key)
            t1, cpu = time.time(), time.process_time() - c0
            (_, _, sa, ea, ca), (_, _, sb, eb, cb) = frags
            parallel = SPEEDUP_CASES[key][1]
            samples[key].append({
                "total_s": t1 - t0,
                # time outside the fragments' own runs: submitting, polling, merging back
                "outside_s": (t1 - t0) - ((max(ea, eb) - min(sa, sb)) if parallel else (ea - sa) + (eb - sb)),
                "start_lag_s": max(sa, sb) - t0 if parallel else None,
                "end_lag_s": t1 - max(ea, eb) if parallel else None,
                "parent_cpu_s": cpu - (ca + cb if key == "sequential" else 0.0),
                "fragment_cpu_s": (ca + cb) / 2,  # the CPU time one fragment took, where it ran
                # the part of a core each fragment got while it ran (1.0: a core of its own)
                "cpu_share": [ca / (ea - sa), cb / (eb - sb)],
                "overlap": max(0.0, min(ea, eb) - max(sa, sb)) / max(ea - sa, eb - sb),
            })
    bare.shutdown()

    def med(key, field):
        values = [x[field] for x in samples[key] if x[field] is not None]
        return statistics.median(values) if values else None

    seq = [x["total_s"] for x in samples["sequential"]]
    cases = {}
    for key in keys:
        totals = [x["total_s"] for x in samples[key]]
        cases[key] = {
            "label": SPEEDUP_CASES[key][0], "seconds_all": totals, "seconds_median": statistics.median(totals),
            "seconds_best": min(totals), "speedup_median": statistics.median(seq) / statistics.median(totals),
            # per round, against that round's sequential run
            "speedup_paired_median": statistics.median(s_ / t for s_, t in zip(seq, totals)),
            "outside_ms_median": med(key, "outside_s") * 1e3,
            "start_lag_ms_median": None if med(key, "start_lag_s") is None else med(key, "start_lag_s") * 1e3,
            "end_lag_ms_median": None if med(key, "end_lag_s") is None else med(key, "end_lag_s") * 1e3,
            "parent_cpu_ms_median": med(key, "parent_cpu_s") * 1e3,
            "fragment_cpu_s_median": med(key, "fragment_cpu_s"),
            "cpu_share_min_median": statistics.median(min(x["cpu_share"]) for x in samples[key]),
            "overlap_median": med(key, "overlap"),
        }
    woven, anchor = cases["woven"]["speedup_median"], cases["bare_pool"]["speedup_median"]
    same_workers = cases["bare_default_pool"]["speedup_median"]
    return {"burn_n": n, "rounds": rounds, "cases": cases, "samples": samples,
            "speedup_median": woven, "bare_pool_speedup_median": anchor, "woven_vs_bare_pool": woven / anchor,
            "default_pool_speedup_median": same_workers, "woven_vs_default_pool": woven / same_workers,
            "target": TARGET_SPEEDUP, "meets_target": woven >= TARGET_SPEEDUP,
            "load_average_1min": load, "cores": os.cpu_count(), "pool_workers": default_workers()}


COLD_CASES = {  # mode: (label, a setup step first, the pool started ahead and its forkserver preloading flowvm)
    "woven": ("WEAVE of 2 SPAWNs, first thing", False, True),
    "woven_before": ("  same, pool started by the first SPAWN", False, False),
    "setup_woven": ("setup step, then the WEAVE (WEAVE part)", True, True),
    "setup_woven_before": ("  same, pool started by the first SPAWN", True, False),
    "bare": ("bare ProcessPoolExecutor (2 workers)", False, None),
}


def setup_step(seconds: float) -> float:
    """A program's in-process work before its SPAWNs (loading data, say): seconds of CPU; returns when it ended."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        burn(10_000)
    return time.time()


def cold_child(mode: str, n: int, setup_s: float) -> None:
    """In a fresh interpreter: the two fragments as the first work of this process (pool start included),
    or after a setup step of setup_s seconds.  The "before" modes start the pool the older way, for comparison:
    at the first SPAWN's first step, each worker importing flowvm itself."""
    import concurrent.futures as cf
    import multiprocessing

    label, setup, ahead = COLD_CASES[mode]
    if ahead is False:
        from flowvm.processes import executors, leaves

        leaves.SPAWN.run_starts = lambda self: None
        executors._preload_flowvm = lambda ctx: None
    t0 = time.time()
    if ahead is None:
        methods = multiprocessing.get_all_start_methods()
        bare = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context(
            "forkserver" if "forkserver" in methods else "spawn"))
        frags, woven_from = _pair(bare, n), t0
    else:
        reg = Registers(n=n, t_setup=t0)
        weave = WEAVE(-1, [SPAWN(CALL(timed_burn, reg("n"), store_to=reg("a"))),
                           SPAWN(CALL(timed_burn, reg("n"), store_to=reg("b")))])
        prog = SEQ([CALL(setup_step, setup_s, store_to=reg("t_setup")), weave]) if setup else weave
        prog.run()
        frags, woven_from = [reg["a"], reg["b"]], reg["t_setup"]
    t1 = time.time()  # before the bare pool's shutdown (the default pool's is at exit too)
    print(json.dumps({"total_s": t1 - t0, "woven_s": t1 - woven_from, "start_lag_s": max(f[2] for f in frags) - woven_from,
                      "end_lag_s": t1 - max(f[3] for f in frags)}))


def cold(n: int, rounds: int, sequential_s: float, setup_s: float) -> dict:
    """Each case in a fresh interpreter, round by round; the speed-up of the part after the setup step (the
    whole run where there is none) over the sequential median of the warm section."""
    rows: dict[str, list] = {key: [] for key in COLD_CASES}
    load = []
    for r in range(rounds):
        load.append(os.getloadavg()[0])
        keys = list(COLD_CASES)
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            done = subprocess.run([sys.executable, __file__, "--cold-child", key, str(n), str(setup_s)],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                continue
            rows[key].append(json.loads(done.stdout.strip().splitlines()[-1]))
    out: dict = {"setup_s": setup_s, "load_average_1min": load, "cases": {}}
    for key, runs in rows.items():
        if not runs:
            continue
        woven = statistics.median(r["woven_s"] for r in runs)
        out["cases"][key] = {
            "label": COLD_CASES[key][0], "runs": runs, "seconds_median": statistics.median(r["total_s"] for r in runs),
            "woven_seconds_median": woven, "speedup_median": sequential_s / woven,
            "start_lag_ms_median": statistics.median(r["start_lag_s"] for r in runs) * 1e3,
            "end_lag_ms_median": statistics.median(r["end_lag_s"] for r in runs) * 1e3}
    return out


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
             ("await drv.arun() (time slices of 0.25 ms)", lambda d: asyncio.run(d.arun())),
             ("await drv.arun(steps_per_yield=1)", lambda d: asyncio.run(d.arun(steps_per_yield=1))),
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
    parser.add_argument("--only", choices=["speedup"], help="run one section only")
    parser.add_argument("--cold-child", nargs=3, metavar=("MODE", "N", "SETUP_S"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cold_child:
        cold_child(args.cold_child[0], int(args.cold_child[1]), float(args.cold_child[2]))
        return 0
    k = 1 if args.quick else 0
    sizes = {key: v[k] for key, v in SIZES.items()}
    started = perf_counter()

    everything = args.only is None
    trips = waits = steps = None
    if everything:
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

    n = calibrate(sizes["fragment_s"])
    sp = speedup(n, sizes["speedup_rounds"])
    print(f"\n2. Two CPU-bound fragments (burn({n:,}) each, about {sizes['fragment_s']:g} s), medians of "
          f"{sp['rounds']} interleaved rounds; {sp['pool_workers']} pool workers, load average "
          f"{', '.join(f'{x:.2f}' for x in sp['load_average_1min'])}")
    print(f"{'case':<38} {'median s':>8} {'best s':>7} {'speed-up':>8} {'paired':>7} {'outside ms':>10} "
          f"{'start lag':>9} {'end lag':>8} {'parent CPU':>10} {'frag CPU s':>10} {'CPU share':>9}")
    dash = "-"
    for key, c in sp["cases"].items():
        start = f"{c['start_lag_ms_median']:.1f}" if c["start_lag_ms_median"] is not None else dash
        end_ = f"{c['end_lag_ms_median']:.1f}" if c["end_lag_ms_median"] is not None else dash
        print(f"{c['label']:<38} {c['seconds_median']:>8.3f} {c['seconds_best']:>7.3f} "
              f"{c['speedup_median']:>7.2f}x {c['speedup_paired_median']:>6.2f}x {c['outside_ms_median']:>10.1f} "
              f"{start:>9} {end_:>8} {c['parent_cpu_ms_median']:>10.1f} {c['fragment_cpu_s_median']:>10.3f} "
              f"{c['cpu_share_min_median']:>9.2f}")
    print(f"speed-up over sequential (median times): woven SPAWNs {sp['speedup_median']:.2f}x, bare pool "
          f"{sp['bare_pool_speedup_median']:.2f}x (woven / bare: {sp['woven_vs_bare_pool']:.3f}), the default "
          f"pool's executor {sp['default_pool_speedup_median']:.2f}x (woven / it: "
          f"{sp['woven_vs_default_pool']:.3f}); target >= "
          f"{TARGET_SPEEDUP}x: {'met' if sp['meets_target'] else 'NOT met'}.  (ms columns: medians; CPU share: "
          "the lesser fragment's part of a core, below 1.0 when other load took the cores; frag CPU: the CPU "
          "time one fragment took where it ran, which differs from process to process)")

    seq_s = sp["cases"]["sequential"]["seconds_median"]
    cold_rows = cold(n, sizes["cold_rounds"], seq_s, sizes["setup_s"])
    print(f"\n2b. The same from a fresh interpreter (the pool and its workers start first), medians of "
          f"{sizes['cold_rounds']} interleaved rounds, load average "
          f"{', '.join(f'{x:.2f}' for x in cold_rows['load_average_1min'])}; speed-up: the sequential median "
          f"above ({seq_s:.3f} s) over the time from the WEAVE's start (after the {sizes['setup_s']:g} s setup "
          "step, where there is one) to the end")
    print(f"{'case':<42} {'whole s':>8} {'WEAVE s':>8} {'speed-up':>8} {'start lag ms':>12} {'end lag ms':>10}")
    for key, r in cold_rows["cases"].items():
        print(f"{r['label']:<42} {r['seconds_median']:>8.3f} {r['woven_seconds_median']:>8.3f} "
              f"{r['speedup_median']:>7.2f}x {r['start_lag_ms_median']:>12.1f} {r['end_lag_ms_median']:>10.1f}")
    sp["cold"] = cold_rows

    if everything:
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
