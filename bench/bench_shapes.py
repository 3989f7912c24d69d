#!/usr/bin/env python
"""Real program shapes: WEAVEs around training loops and deep nests, asyncio driving, step() in a loop.

Run from the repository root::

    python bench/bench_shapes.py            # full sizes (about a minute)
    python bench/bench_shapes.py --quick    # small sizes (CI smoke test)

Each row is measured against its anchor in the same run, in interleaved rounds (anchor, case, anchor,
case, ...), and reports the median of the rounds' ratios:

1. a training loop (the event-loop example's SGD: a REPEAT of a SEQ of four CALLs) woven with a
   low-weight logging LOOP, against the same loop alone (target <= 1.1x);
2. a deep nest of REPEATs and SEQs woven with a low-weight LOOP, against the nest alone (target <= 2x),
   for a nest of tight loops and for one of nested SEQs (the general path); and two nests in an
   unweighted WEAVE (a turn per step) against the same two one after the other;
3. ``await drv.arun()`` against ``drv.run()`` per step (target <= 2x), with the longest gap an
   ``asyncio.sleep(0.001)`` heartbeat saw beside it (target: the loop gets control at least every ms);
4. ``while drv.step() is INCOMPLETE`` against a plain Python loop doing the same register reads, calls and
   writes (target <= 5x).

Figures are reported, never asserted; the JSON (bench/results/shapes.json) holds every round.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path
from time import monotonic, perf_counter

from flowvm import CALL, INCOMPLETE, LOOP, REPEAT, SEQ, WEAVE, Registers
from flowvm.programs.event_loop_example import build as sgd_program

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "shapes.json"


def noop(x=None):
    return x


def inc(x):
    return x + 1


def woven(program, weight=0.01):
    return WEAVE(1, [program, LOOP(CALL(noop, 1))], weights=[1, weight])


# ------------------------------------------------------------------ the shapes
def training(n):
    return sgd_program(steps=n)


def training_woven(n):
    return woven(sgd_program(steps=n))


def tight_nest(reg, n, r="a"):
    """REPEATs of SEQs four deep, the innermost a REPEAT of two CALLs (the fast paths' shape)."""
    return REPEAT(n, SEQ([
        REPEAT(10, SEQ([REPEAT(10, SEQ([CALL(inc, reg(r), store_to=reg(r)), CALL(inc, reg(r), store_to=reg(r))])),
                        CALL(inc, reg(r), store_to=reg(r))])),
        CALL(inc, reg(r), store_to=reg(r))]))


def seq_nest(reg, n, r="a"):
    """SEQs six deep inside a REPEAT: every step through the general path."""
    body = CALL(inc, reg(r), store_to=reg(r))
    for _ in range(6):
        body = SEQ([body, CALL(inc, reg(r), store_to=reg(r))])
    return REPEAT(n, body)


def nest_alone(shape):
    return lambda n: shape(Registers(a=0), n)


def nest_woven(shape):
    return lambda n: woven(shape(Registers(a=0), n))


def two_nests_in_turn(shape):
    def build(n):
        reg = Registers(a=0, b=0)
        return SEQ([shape(reg, n // 2, "a"), shape(reg, n // 2, "b")])
    return build


def two_nests_woven(shape):
    def build(n):
        reg = Registers(a=0, b=0)
        return WEAVE(-1, [shape(reg, n // 2, "a"), shape(reg, n // 2, "b")])
    return build


def timed_run(build, n) -> tuple[float, int]:
    drv = build(n).start()
    t0 = perf_counter()
    drv.run()
    return perf_counter() - t0, drv.steps


def pair(label, anchor_label, anchor, case, n, rounds, target) -> dict:
    """Interleaved rounds of anchor and case; the median of the per-round ratios of µs per step."""
    ratios, a_us, c_us = [], [], []
    for _ in range(rounds):
        ta, sa = timed_run(anchor, n)
        tc, sc = timed_run(case, n)
        a_us.append(ta / sa * 1e6)
        c_us.append(tc / sc * 1e6)
        ratios.append(c_us[-1] / a_us[-1])
    ratio = statistics.median(ratios)
    return {"case": label, "anchor": anchor_label, "n": n, "us_per_step": statistics.median(c_us),
            "anchor_us_per_step": statistics.median(a_us), "ratio": ratio, "target": target,
            "meets_target": None if target is None else ratio <= target, "ratios": ratios}


# ------------------------------------------------------------------ asyncio
def counting(n):
    reg = Registers(x=0)
    return REPEAT(n // 2, SEQ([CALL(noop, reg("x"), store_to=reg("y")), CALL(noop, reg("y"), store_to=reg("x"))]))


def arun_rounds(n, rounds) -> list[dict]:
    rows = {"run": [], "arun": [], "arun1": []}
    gaps = []

    async def with_heartbeat(drv):
        worst = [0.0]

        async def heartbeat():
            while not drv.done:
                t = monotonic()
                await asyncio.sleep(0.001)
                worst[0] = max(worst[0], monotonic() - t - 0.001)

        beat = asyncio.create_task(heartbeat())
        await drv.arun()
        await beat
        return worst[0]

    for _ in range(rounds):
        drv = counting(n).start()
        t0 = perf_counter()
        drv.run()
        rows["run"].append((perf_counter() - t0) / drv.steps * 1e6)
        drv = counting(n).start()
        t0 = perf_counter()
        gaps.append(asyncio.run(with_heartbeat(drv)) * 1e3)
        rows["arun"].append((perf_counter() - t0) / drv.steps * 1e6)
        drv = counting(n // 10).start()
        t0 = perf_counter()
        asyncio.run(drv.arun(steps_per_yield=1))
        rows["arun1"].append((perf_counter() - t0) / drv.steps * 1e6)
    run_us = statistics.median(rows["run"])
    out = [{"case": "drv.run()", "us_per_step": run_us, "ratio": 1.0}]
    for key, label, target in (("arun", "await drv.arun() (default time slices) beside a 1 ms heartbeat", 2.0),
                               ("arun1", "await drv.arun(steps_per_yield=1)", None)):
        ratios = [a / r for a, r in zip(rows[key], rows["run"])]
        ratio = statistics.median(ratios)
        out.append({"case": label, "us_per_step": statistics.median(rows[key]), "ratio": ratio, "target": target,
                    "meets_target": None if target is None else ratio <= target, "ratios": ratios})
    out[1]["heartbeat_longest_gap_ms"] = max(gaps)
    out[1]["heartbeat_gaps_ms"] = gaps
    return out


# ------------------------------------------------------------------ step() in a loop
def step_rounds(n, rounds) -> dict:
    """The anchor does by hand what the program's leaf does: read a register, call, write a register (as
    bench_core.py's plain loop)."""
    ratios, plain_us, step_us = [], [], []
    for _ in range(rounds):
        regs = {"x": 0}
        fn = noop
        t0 = perf_counter()
        for _ in range(n):
            regs["y"] = fn(regs["x"])
        plain_us.append((perf_counter() - t0) / n * 1e6)
        reg = Registers(x=0)
        drv = REPEAT(n, CALL(noop, reg("x"), store_to=reg("y"))).start()
        t0 = perf_counter()
        while drv.step() is INCOMPLETE:  # the loop as users write it
            pass
        step_us.append((perf_counter() - t0) / n * 1e6)
        ratios.append(step_us[-1] / plain_us[-1])
    ratio = statistics.median(ratios)
    return {"case": "while drv.step() is INCOMPLETE", "anchor": "plain Python loop, same reads and writes",
            "n": n, "us_per_step": statistics.median(step_us), "anchor_us_per_step": statistics.median(plain_us),
            "ratio": ratio, "target": 5.0, "meets_target": ratio <= 5.0, "ratios": ratios}


# ------------------------------------------------------------------ report
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per row (default 7, quick 3)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    scale = 10 if args.quick else 1
    start = perf_counter()

    rows = [
        pair("training loop in a WEAVE with a logging LOOP (weight 0.01)", "the loop alone",
             training, training_woven, 5000 // scale, rounds, 1.1),
        pair("deep nest of tight loops in a WEAVE with a LOOP (weight 0.01)", "the nest alone",
             nest_alone(tight_nest), nest_woven(tight_nest), 200 // scale, rounds, 2.0),
        pair("deep nest of SEQs in a WEAVE with a LOOP (weight 0.01)", "the nest alone",
             nest_alone(seq_nest), nest_woven(seq_nest), 20000 // scale, rounds, 2.0),
        pair("two nests of tight loops in an unweighted WEAVE (a turn per step)", "one after the other",
             two_nests_in_turn(tight_nest), two_nests_woven(tight_nest), 200 // scale, rounds, None),
    ]
    async_rows = arun_rounds(400_000 // scale, rounds)
    step_row = step_rounds(1_000_000 // scale, rounds)

    print(f"{'shape':70s} {'us/step':>8s} {'anchor':>8s} {'ratio':>6s} {'target':>7s}")
    for r in rows + [step_row]:
        target = f"<= {r['target']:g}" if r["target"] else ""
        print(f"{r['case']:70s} {r['us_per_step']:8.3f} {r['anchor_us_per_step']:8.3f} {r['ratio']:6.2f} {target:>7s}")
    print()
    print(f"{'asyncio (trivial steps)':70s} {'us/step':>8s} {'x run()':>8s}")
    for r in async_rows:
        print(f"{r['case']:70s} {r['us_per_step']:8.3f} {r['ratio']:8.2f}")
    print(f"longest heartbeat gap beside arun(): {async_rows[1]['heartbeat_longest_gap_ms']:.2f} ms "
          f"(target: under 1 ms)")

    result = {
        "benchmark": "shapes", "quick": args.quick, "rounds": rounds,
        "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                        "date": datetime.datetime.now().isoformat(timespec="seconds")},
        "woven": rows, "asyncio": async_rows, "step_loop": step_row, "wall_s": perf_counter() - start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({result['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
