#!/usr/bin/env python
"""@flowvm.program: the per-statement cost of a loop of scalar statements, against the same function run as
Python and against the same loop written as elements by hand.

Run from the repository root::

    python bench/bench_pyfunc.py            # full sizes (about half a minute)
    python bench/bench_pyfunc.py --quick    # small sizes (CI smoke test)

The function: a ``for`` over ``range(n)`` whose body is three scalar statements and an ``if`` with a
``continue`` (a linear congruential generator and a running sum).  Each round times, in this process, the
function as Python, the decorated function's program (``.run()``), and a hand-written program of the same
work (REPEAT of a SEQ of CALLs and a SWITCH); interleaved rounds, medians.  Reported: microseconds per
statement of the Python body (5 per iteration) and the ratios.  Figures are reported, never asserted; JSON
goes to bench/results/pyfunc.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowvm  # noqa: E402
from flowvm import CALL, REPEAT, SEQ, SWITCH, Registers  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pyfunc.json"
STATEMENTS = 5  # per iteration of the Python body: x =, y =, if, total +=, (the loop's own step)


@flowvm.program
def walk(n, seed):
    x = seed
    total = 0
    for i in range(n):
        x = (x * 1103515245 + 12345) % 2147483648
        y = x % 1000
        if y < 10:
            continue
        total += y
    return total


def _next(x):
    return (x * 1103515245 + 12345) % 2147483648


def _low(x):
    return x % 1000


def _small(y):
    return y < 10


def _add(total, y):
    return total + y


def by_hand(n, seed):
    reg = Registers(x=seed, total=0, y=0)
    body = SEQ([CALL(_next, reg("x"), store_to=reg("x")), CALL(_low, reg("x"), store_to=reg("y")),
                SWITCH(CALL(_small, reg("y")), {True: SEQ([])},
                       default=CALL(_add, reg("total"), reg("y"), store_to=reg("total")))])
    return SEQ([REPEAT(n, body, counter=reg("i")), CALL(lambda t: t, reg("total"))])


def timed(make, n) -> float:
    t0 = time.perf_counter()
    make(n)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7, quick 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    n = 2_000 if args.quick else 50_000
    rounds = args.rounds or (2 if args.quick else 7)
    want = walk.function(n, 7)
    assert walk(n, 7).run() == want == by_hand(n, 7).run()
    times: dict[str, list[float]] = {"python": [], "program": [], "elements": []}
    for _ in range(rounds):
        times["python"].append(timed(lambda k: walk.function(k, 7), n))
        times["program"].append(timed(lambda k: walk(k, 7).run(), n))
        times["elements"].append(timed(lambda k: by_hand(k, 7).run(), n))
    med = {k: statistics.median(v) for k, v in times.items()}
    per = {k: v / (n * STATEMENTS) * 1e6 for k, v in med.items()}
    steps = walk(n, 7).start()
    steps.run()
    print(f"{n} iterations, {rounds} rounds, medians")
    print(f"{'form':10s} {'us / statement':>15s} {'x python':>9s}")
    for k in times:
        print(f"{k:10s} {per[k]:15.3f} {med[k] / med['python']:9.1f}")
    print(f"the program's steps: {steps.steps} ({steps.steps / n:.1f} an iteration)")
    result = {"benchmark": "pyfunc", "quick": args.quick, "iterations": n, "rounds": rounds,
              "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                              "date": datetime.datetime.now().isoformat(timespec="seconds")},
              "seconds": times, "median_seconds": med, "us_per_statement": per,
              "ratio_to_python": {k: med[k] / med["python"] for k in med}, "steps": steps.steps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
