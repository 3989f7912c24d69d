#!/usr/bin/env python
"""Editing benchmarks: find, program edits, hot patches, Depends, pictures and source.

Run from the repository root::

    python bench/bench_edit.py            # up to 100,000 elements (about a minute)
    python bench/bench_edit.py --quick    # small sizes, a few seconds (CI smoke test)

It prints two tables and writes the figures to ``bench/results/edit.json``:

1. for programs of growing size: ``find`` over the whole program, a program
   edit of every match, a hot patch of a half-run driver, ``to_dot`` and
   ``to_source`` (times in milliseconds, the best of a few runs);
2. per-step time of a CALL with a plain argument (on the REPEAT fast path,
   and inside a SEQ, off it) against the same CALL with a ``Depends``
   argument (with and without an override; such a CALL runs through the leaf
   protocol, off the fast path), and a plain Python loop.

Figures are measured and reported, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import timeit
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

import flowvm  # noqa: E402
from flowvm import CALL, REPEAT, SEQ, Depends, Registers  # noqa: E402
from flowvm.program.paths import walk  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "edit.json"


def update(w, x):
    return w + x


def hook(w):
    return w


def provide():
    return 1


def other():
    return 2


def program(k: int):
    """k REPEATs of a two-CALL body: 5k + 1 elements."""
    reg = Registers(w=0)
    body = [REPEAT(3, SEQ([CALL(update, reg("w"), i, store_to=reg("w")), CALL(hook, reg("w"))]))
            for i in range(k)]
    return SEQ(body), reg


def best_ms(fn, repeat: int) -> float:
    return min(timeit.repeat(fn, number=1, repeat=repeat)) * 1000


def table_sizes(sizes, repeat):
    rows = []
    for k in sizes:
        prog, reg = program(k)
        n = sum(1 for _ in walk(prog))
        pattern = CALL(update, reg("w"), k // 2)
        t_find = best_ms(lambda: prog.find(pattern), repeat)
        t_edit = best_ms(lambda: prog.find(hook).insert_after(CALL(hook, reg("w"))), repeat)

        def patch():
            drv = prog.start()
            drv.run(max_steps=3 * k)  # half-way
            return drv

        drivers = [patch() for _ in range(repeat)]
        times = []
        for drv in drivers:
            times.append(timeit.timeit(lambda d=drv: d.find(pattern).insert_after(CALL(hook, d.registers("w"))),
                                       number=1) * 1000)
        t_dot = best_ms(lambda: flowvm.to_dot(prog), repeat)
        t_src = best_ms(lambda: flowvm.to_source(prog), repeat)
        rows.append({"elements": n, "find_ms": t_find, "edit_all_ms": t_edit, "hot_patch_ms": min(times),
                     "to_dot_ms": t_dot, "to_source_ms": t_src})
    return rows


def table_depends(steps):
    reg = Registers(w=0)
    plain = REPEAT(steps, CALL(update, reg("w"), 1, store_to=reg("w")))
    slow = REPEAT(steps, SEQ([CALL(update, reg("w"), 1, store_to=reg("w"))]))  # no fast path
    late = REPEAT(steps, CALL(update, reg("w"), Depends(provide), store_to=reg("w")))
    overridden = REPEAT(steps, CALL(update, reg("w"), Depends(provide), store_to=reg("w")))
    overridden.dependency_overrides[provide] = other

    def loop():
        w = 0
        for _ in range(steps):
            w = update(w, provide())
        return w

    rows = []
    for name, fn in (("plain Python loop", loop), ("CALL(update, w, 1)", plain.run),
                     ("the same CALL inside a SEQ (no fast path)", slow.run),
                     ("CALL(update, w, Depends(provide))", late.run),
                     ("... with dependency_overrides", overridden.run)):
        t = min(timeit.repeat(fn, number=1, repeat=3))
        rows.append({"case": name, "steps": steps, "ns_per_step": t / steps * 1e9})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    sizes = (2, 200, 2_000) if args.quick else (2, 200, 2_000, 20_000)
    steps = 20_000 if args.quick else 300_000
    repeat = 3
    sized = table_sizes(sizes, repeat)
    print(f"{'elements':>9} {'find':>9} {'edit all':>9} {'hot patch':>10} {'to_dot':>9} {'to_source':>10}  (ms)")
    for r in sized:
        print(f"{r['elements']:>9} {r['find_ms']:>9.2f} {r['edit_all_ms']:>9.2f} {r['hot_patch_ms']:>10.2f} "
              f"{r['to_dot_ms']:>9.2f} {r['to_source_ms']:>10.2f}")
    dep = table_depends(steps)
    print()
    base = dep[1]["ns_per_step"]
    for r in dep:
        print(f"{r['case']:<42} {r['ns_per_step']:>8.0f} ns/step  ({r['ns_per_step'] / base:.2f}x plain CALL)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(), "quick": args.quick,
        "python": platform.python_version(), "machine": platform.machine(), "sizes": sized, "depends": dep,
    }, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
