"""Benchmark of what shipping SPAWN fragments' code costs (flowvm.processes.shipping).

1. The default local pool must pay nothing: the round trip of a trivial SPAWN on it (submit, run a one-CALL
   fragment, merge back), measured with this checkout's flowvm and with another revision's (``--against``,
   by default the last commit before fragments were shipped), each in child processes started alternately,
   round by round, so that drifts of the machine hit both alike.  The table gives each side's median of its
   rounds' medians and the ratio; the target is within 5%.
2. What shipping costs where it applies, in this process: writing a fragment's payload for another executor
   (code by value, the manifest of versions) against the default pool's payload, for a fragment whose
   function is local code (shipped by value) and one calling numpy (by name), including the first call
   (which reads every installed distribution's metadata); and the round trip of a SPAWN whose code is
   shipped on a Dask LocalCluster of two workers, next to the executor's own ``submit(abs, -1)``.

Figures are measured and reported, never asserted.  Results go to bench/results/shipping.json.

    python bench/bench_shipping.py            # full sizes (about 2 minutes)
    python bench/bench_shipping.py --quick    # CI smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from time import perf_counter

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # sections 2a and 2b measure this checkout's flowvm, installed or not
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "shipping.json"
BEFORE_SHIPPING = "e923619"  # the last commit whose SPAWNs pickled every fragment by reference

# (full, quick)
SIZES = {"trips": (500, 60), "rounds": (11, 3), "payloads": (2000, 300), "dask_trips": (200, 40)}

CHILD = """
import json, statistics, sys
from time import perf_counter
import flowvm
from flowvm import CALL, SPAWN, Registers
from flowvm.processes.executors import default_executor, default_workers

n = int(sys.argv[1])
pool = default_executor()
for f in [pool.submit(abs, -1) for _ in range(4 * default_workers())]:
    f.result()
reg = Registers(x=-1)
prog = SPAWN(CALL(abs, reg("x"), store_to=reg("y")))
for _ in range(20):
    prog.run()
times = []
for _ in range(n):
    t0 = perf_counter()
    prog.run()
    times.append(perf_counter() - t0)
print(json.dumps({"median_ms": statistics.median(times) * 1e3, "best_ms": min(times) * 1e3,
                  "flowvm": flowvm.__file__}))
"""


def local_pool(against: str, trips: int, rounds: int) -> dict | None:
    """Section 1: this checkout against the revision ``against``, in alternating child processes."""
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        made = subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(old), against],
                              capture_output=True, text=True)
        if made.returncode != 0:
            print(f"cannot check out {against}: {made.stderr.strip()}")
            return None
        try:
            sides = {"this checkout": REPO_ROOT, f"{against} (before shipping)": old / "src" if (old / "src").is_dir() else old}
            samples: dict[str, list] = {k: [] for k in sides}
            for r in range(rounds):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for name in order:
                    env = {"PYTHONPATH": str(sides[name]), "PATH": "/usr/bin:/bin"}
                    out = subprocess.run([sys.executable, "-c", CHILD, str(trips)], env=env, capture_output=True,
                                         text=True, timeout=300, cwd=tmp)
                    if out.returncode != 0:
                        print(out.stderr[-2000:])
                        return None
                    samples[name].append(json.loads(out.stdout.splitlines()[-1]))
        finally:
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(old)],
                           capture_output=True)
    rows = {name: {"median_ms": statistics.median(s["median_ms"] for s in runs),
                   "best_ms": min(s["best_ms"] for s in runs), "rounds": [s["median_ms"] for s in runs]}
            for name, runs in samples.items()}
    new, base = rows.values()
    paired = [a["median_ms"] / b["median_ms"] for a, b in zip(*samples.values())]
    return {"against": against, "trips": trips, "rounds": rounds, "sides": rows,
            "ratio": new["median_ms"] / base["median_ms"], "paired_ratio_median": statistics.median(paired)}


def local_code(x):
    return x + 1


def payloads(n: int) -> list[dict]:
    """Section 2a: µs to write a fragment's payload, shipped (another executor) and plain (the default pool)."""
    import numpy as np

    from flowvm import CALL, Registers
    from flowvm.processes import job

    reg = Registers(x=np.arange(3.0))
    rows = []
    for label, fn in (("local function (by value)", local_code), ("numpy.sum (by name)", np.sum)):
        frag = CALL(fn, reg("x"), store_to=reg("y"))
        t0 = perf_counter()
        job.shipped_payload(frag, reg, ["x"], b"12345678", "error")
        first = perf_counter() - t0
        shipped, plain = [], []
        for _ in range(n):
            t0 = perf_counter()
            job.shipped_payload(frag, reg, ["x"], b"12345678", "error")
            t1 = perf_counter()
            job.job_payload(frag, reg, ["x"], b"12345678")
            plain.append(perf_counter() - t1)
            shipped.append(t1 - t0)
        rows.append({"fragment": label, "first_shipped_ms": first * 1e3,
                     "shipped_us": statistics.median(shipped) * 1e6, "plain_us": statistics.median(plain) * 1e6})
    return rows


def dask_trip(n: int) -> dict | None:
    """Section 2b: SPAWN round trip with its code shipped, on a Dask LocalCluster."""
    from bench_processes import dask_executor
    from flowvm import CALL, SPAWN, Registers

    with dask_executor() as ex:
        if ex is None:
            return None
        reg = Registers(x=-1)
        prog = SPAWN(CALL(local_code, reg("x"), store_to=reg("y")), executor=ex)
        for _ in range(10):
            prog.run()
            ex.submit(abs, -1).result()
        spawn, raw = [], []
        for _ in range(n):
            t0 = perf_counter()
            ex.submit(abs, -1).result()
            raw.append(perf_counter() - t0)
            t0 = perf_counter()
            prog.run()
            spawn.append(perf_counter() - t0)
    return {"n": n, "spawn_ms_median": statistics.median(spawn) * 1e3,
            "executor_ms_median": statistics.median(raw) * 1e3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke test)")
    parser.add_argument("--against", default=BEFORE_SHIPPING, help="the revision section 1 compares with")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    sizes = {k: v[1 if args.quick else 0] for k, v in SIZES.items()}
    started = perf_counter()

    local = local_pool(args.against, sizes["trips"], sizes["rounds"])
    print(f"\n1. Default-pool SPAWN round trip, medians of {sizes['rounds']} alternating child processes of "
          f"{sizes['trips']} trips each")
    if local is not None:
        for name, row in local["sides"].items():
            print(f"{name:<34} {row['median_ms']:>8.3f} ms  (best {row['best_ms']:.3f}; rounds "
                  f"{', '.join(f'{x:.3f}' for x in row['rounds'])})")
        print(f"ratio this / before: {local['ratio']:.3f} of the medians, {local['paired_ratio_median']:.3f} the "
              f"median of the rounds' ratios (target within 5%: "
              f"{'met' if abs(local['paired_ratio_median'] - 1) <= 0.05 else 'NOT met'})")

    rows = payloads(sizes["payloads"])
    print(f"\n2a. Writing a fragment's payload (median of {sizes['payloads']})")
    print(f"{'fragment':<28} {'first shipped ms':>16} {'shipped µs':>11} {'plain µs':>9}")
    for r in rows:
        print(f"{r['fragment']:<28} {r['first_shipped_ms']:>16.1f} {r['shipped_us']:>11.1f} {r['plain_us']:>9.1f}")

    dask = dask_trip(sizes["dask_trips"])
    if dask is not None:
        print(f"\n2b. Dask LocalCluster (2 workers), median of {dask['n']}: SPAWN with shipped code "
              f"{dask['spawn_ms_median']:.2f} ms, executor.submit(abs, -1) alone {dask['executor_ms_median']:.2f} ms")

    result = {"benchmark": "shipping", "quick": args.quick, "sizes": sizes,
              "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "python": platform.python_version(), "platform": platform.platform(),
              "local_pool": local, "payloads": rows, "dask": dask, "seconds": perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten to {args.out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
