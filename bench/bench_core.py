#!/usr/bin/env python
"""Core flowvm benchmarks: per-step overhead and the size of a paused run.

Run from the repository root::

    python bench/bench_core.py            # full sizes (about a minute)
    python bench/bench_core.py --quick    # small sizes, a few seconds (CI smoke test)

It prints three tables and writes every figure (with the raw samples and
the environment) to ``bench/results/core.json``:

1. per-step overhead of flowvm against a plain Python loop and an ignite Engine;
2. pickle size and time of half-run drivers, for growing program size and depth;
3. ``flowvm.save`` / ``flowvm.load`` of the largest half-run driver.

Figures are measured and reported, never asserted: the script exits 0
whatever the numbers are.  See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from time import perf_counter

# Benchmark the checkout this script lives in, even if some other flowvm is installed.
REPO_ROOT = Path(__file__).resolve().parent.parent

import flowvm  # noqa: E402
from flowvm import CALL, INCOMPLETE, REPEAT, SEQ, Registers  # noqa: E402
from flowvm.program.paths import walk  # noqa: E402

try:  # optional: only the ignite comparison needs it (pip install -e .[bench])
    import ignite
    from ignite.engine import Engine
except ImportError:  # pragma: no cover - depends on the environment
    ignite = Engine = None

DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "core.json"

# Sizes: (full, quick).
SIZES = {
    "steps": (1_000_000, 100_000),        # leaf steps per per-step measurement
    "ignite_steps": (100_000, 10_000),    # ignite is ~100x slower per iteration: fewer of them
    "flat_repeats": ((5, 500, 50_000), (5, 500, 5_000)),  # k REPEATs -> 2k+1 elements
    "depths": ((10, 100), (10, 100)),     # nesting depths of the deep programs
    "min_sample_s": (0.05, 0.005),        # shortest timed sample for the pickle/save timings
}

# Issue targets for the per-step overhead, as a ratio to the plain loop.
TARGETS = {"run": 4.0, "step": 5.0}


def f(x):
    """The trivial leaf function.  Module-level, so standard pickle can store it by reference."""
    return x


# --------------------------------------------------------------------------- 1. per-step overhead
# Each case does its own (untimed) setup, times only the stepping, and returns
# (elapsed seconds, steps taken).  Steps are counted from the driver or engine
# rather than assumed, so a miscounting program cannot flatter the figure.

def case_plain(n):
    """What the flowvm program does, written by hand: read one dict entry, call f, write another."""
    R = {"x": 0}
    fn = f
    t0 = perf_counter()
    for _ in range(n):
        R["y"] = fn(R["x"])
    return perf_counter() - t0, n


def _repeat_program(n):
    reg = Registers(x=0)
    return REPEAT(n, CALL(f, reg("x"), store_to=reg("y")))


def case_run(n):
    """REPEAT of one CALL through Driver.run(): the REPEAT-of-a-leaf fast path."""
    drv = _repeat_program(n).start()
    t0 = perf_counter()
    drv.run()
    return perf_counter() - t0, drv.steps


def case_step(n):
    """The same program driven one Driver.step() call at a time from user code."""
    drv = _repeat_program(n).start()
    t0 = perf_counter()
    while drv.step() is INCOMPLETE:  # the loop as users write it (no hoisted method lookup)
        pass
    return perf_counter() - t0, drv.steps


def case_seq(n):
    """REPEAT of a SEQ of two CALLs through run(): the driver's loop over a SEQ of plain leaves."""
    reg = Registers(x=0)
    body = SEQ([CALL(f, reg("x"), store_to=reg("y")), CALL(f, reg("y"), store_to=reg("x"))])
    drv = REPEAT(n // 2, body).start()
    t0 = perf_counter()
    drv.run()
    return perf_counter() - t0, drv.steps


def case_general(n):
    """REPEAT of a SEQ holding a SEQ and a CALL: no fast path, every step pops, settles and pushes frames."""
    reg = Registers(x=0)
    body = SEQ([SEQ([CALL(f, reg("x"), store_to=reg("y"))]), CALL(f, reg("y"), store_to=reg("x"))])
    drv = REPEAT(n // 2, body).start()
    t0 = perf_counter()
    drv.run()
    return perf_counter() - t0, drv.steps


def case_ignite(n):
    """An ignite Engine whose process function does the plain loop's body, one epoch of n items."""
    R = {"x": 0}

    def process(engine, batch):
        R["y"] = f(R["x"])

    engine = Engine(process)
    data = list(range(n))
    t0 = perf_counter()
    engine.run(data, max_epochs=1)
    return perf_counter() - t0, engine.state.iteration


# (key, label, case, size key, target key)
STEP_CASES = [
    ("plain", "plain Python loop", case_plain, "steps", None),
    ("run", "flowvm run()", case_run, "steps", "run"),
    ("step", "flowvm step() loop", case_step, "steps", "step"),
    ("seq_run", "flowvm run(), REPEAT of a SEQ of 2 CALLs", case_seq, "steps", None),
    ("general_run", "flowvm run(), general path (nested SEQs)", case_general, "steps", None),
    ("ignite", "ignite Engine, per iteration", case_ignite, "ignite_steps", None),
]


def bench_per_step(sizes, repeats):
    cases = [c for c in STEP_CASES if c[0] != "ignite" or Engine is not None]
    samples = {key: [] for key, *_ in cases}
    steps = {}
    # Interleaved: round r runs every case once, so slow drifts of the machine
    # (frequency scaling, other load) hit all cases alike.  Best of `repeats`.
    for _ in range(repeats):
        for key, _label, case, size_key, _target in cases:
            gc.collect()
            gc.disable()  # as timeit does: no collector pauses inside a sample
            try:
                elapsed, n = case(sizes[size_key])
            finally:
                gc.enable()
            samples[key].append(elapsed / n)
            steps[key] = n
    plain = min(samples["plain"])
    rows = []
    for key, label, _case, _size_key, target_key in cases:
        best = min(samples[key])
        target = TARGETS.get(target_key)
        rows.append({
            "key": key, "label": label, "steps": steps[key],
            "us_per_step": best * 1e6, "samples_us_per_step": [s * 1e6 for s in samples[key]],
            "ratio_to_plain": best / plain,
            "target_ratio": target,
            "meets_target": None if target is None else best / plain <= target,
        })
    if Engine is None:
        rows.append({"key": "ignite", "label": "ignite Engine (not installed: pip install pytorch-ignite)",
                     "steps": 0, "us_per_step": None, "ratio_to_plain": None, "target_ratio": None,
                     "meets_target": None})
    return rows


# --------------------------------------------------------------------------- 2. pickled state
def flat_program(k):
    """SEQ of k REPEAT(2, CALL): 2k+1 elements, nesting depth 2, 2k steps."""
    reg = Registers(x=0)
    return SEQ([REPEAT(2, CALL(f, reg("x"), store_to=reg("x"))) for _ in range(k)])


def nested_program(depth):
    """depth nested SEQ([CALL, <inner>, CALL]) around one CALL: 3*depth+1 elements, 2*depth+1 steps.

    After `depth` steps the next leaf is the innermost CALL, so a driver
    paused there holds one frame per level (depth+1 frames).
    """
    reg = Registers(x=0)
    body = CALL(f, reg("x"), store_to=reg("x"))
    for _ in range(depth):
        body = SEQ([CALL(f, reg("x"), store_to=reg("x")), body, CALL(f, reg("x"), store_to=reg("x"))])
    return body


def best_time(fn, repeats, min_sample_s):
    """Seconds per call of fn: best of `repeats` samples, each looping fn long enough to last min_sample_s.

    Uses timeit, so the garbage collector is off inside a sample.
    """
    timer = timeit.Timer(fn)
    number = 1
    while True:
        t = timer.timeit(number)
        if t >= min_sample_s or number >= 1 << 20:
            break
        number *= 2 if t > min_sample_s / 10 else 10
    samples = [t] + timer.repeat(repeats - 1, number) if repeats > 1 else [t]
    return min(samples) / number


def half_run(prog, steps):
    """Start prog and run it for `steps` steps; returns (driver, seconds start() took)."""
    t0 = perf_counter()
    drv = prog.start()
    start_s = perf_counter() - t0
    drv.run(max_steps=steps)
    return drv, start_s


def program_shape(prog):
    """(number of elements, nesting depth = containers above the deepest leaf)."""
    n = depth = 0
    for path, _el in walk(prog):
        n += 1
        depth = max(depth, len(path))
    return n, depth


def pickle_row(name, prog, steps, repeats, min_sample_s):
    elements, depth = program_shape(prog)
    prog_bytes = len(pickle.dumps(prog, protocol=pickle.HIGHEST_PROTOCOL))
    drv, start_s = half_run(prog, steps)
    data = pickle.dumps(drv, protocol=pickle.HIGHEST_PROTOCOL)
    dumps_s = best_time(lambda: pickle.dumps(drv, protocol=pickle.HIGHEST_PROTOCOL), repeats, min_sample_s)
    loads_s = best_time(lambda: pickle.loads(data), repeats, min_sample_s)
    row = {
        "program": name, "elements": elements, "depth": depth,
        "steps_run": drv.steps, "frames": len(drv.frame_paths()),
        "program_bytes": prog_bytes, "driver_bytes": len(data), "state_bytes": len(data) - prog_bytes,
        "dumps_s": dumps_s, "loads_s": loads_s, "start_s": start_s,
    }
    return row, drv


def bench_pickle(flat_sizes, depths, repeats, min_sample_s):
    rows = []
    largest = None
    for k in flat_sizes:
        # Paused halfway: after k of its 2k steps.
        row, drv = pickle_row(f"flat SEQ of {k:,} REPEATs", flat_program(k), k, repeats, min_sample_s)
        rows.append(row)
        largest = drv
    for d in depths:
        row, _ = pickle_row(f"nested SEQs, depth {d}", nested_program(d), d, repeats, min_sample_s)
        rows.append(row)
    return rows, largest


# --------------------------------------------------------------------------- 3. checkpoint files
def bench_checkpoint(drv, repeats, min_sample_s):
    """flowvm.save / flowvm.load of drv to a temporary file (save fsyncs; both include the RNG states)."""
    with tempfile.TemporaryDirectory(prefix="flowvm-bench-") as tmp:
        path = os.path.join(tmp, "run.ckpt")
        flowvm.save(drv, path)
        file_bytes = os.path.getsize(path)
        save_s = best_time(lambda: flowvm.save(drv, path), repeats, min_sample_s)
        load_s = best_time(lambda: flowvm.load(path), repeats, min_sample_s)
    elements, _ = program_shape(drv.program)
    return {"elements": elements, "steps_run": drv.steps, "file_bytes": file_bytes,
            "save_s": save_s, "load_s": load_s}


# --------------------------------------------------------------------------- reporting
def fmt_time(s):
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def print_table(title, headers, rows, left=1):
    """Print rows (lists of str) under headers; the first `left` columns are left-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(f"\n{title}")
    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def report(results):
    sizes = results["sizes"]
    rows = []
    for r in results["per_step"]:
        if r["us_per_step"] is None:
            rows.append([r["label"], "-", "-", "-", ""])
            continue
        target = f"<= {r['target_ratio']:g}x" if r["target_ratio"] else "-"
        verdict = "" if r["meets_target"] is None else ("ok" if r["meets_target"] else "MISSED")
        rows.append([r["label"], f"{r['steps']:,}", f"{r['us_per_step']:.3f}", f"{r['ratio_to_plain']:.2f}x",
                     f"{target} {verdict}".strip()])
    print_table(f"1. Per-step overhead (best of {results['repeats']}, interleaved; "
                f"REPEAT(N, CALL(f, reg('x'), store_to=reg('y'))))",
                ["case", "steps", "µs/step", "vs plain", "issue target"], rows)

    rows = [[r["program"], f"{r['elements']:,}", str(r["depth"]), f"{r['steps_run']:,}", str(r["frames"]),
             f"{r['program_bytes']:,}", f"{r['driver_bytes']:,}", f"{r['state_bytes']:,}",
             fmt_time(r["dumps_s"]), fmt_time(r["loads_s"]), fmt_time(r["start_s"])]
            for r in results["pickle"]]
    print_table("2. Pickle of a half-run driver (standard pickle; state = driver bytes - program bytes)",
                ["program", "elements", "depth", "steps run", "frames", "program B", "driver B", "state B",
                 "dumps", "loads", "start() once"], rows)

    c = results["checkpoint"]
    print_table("3. Checkpoint file of the largest half-run driver (flowvm.save fsyncs; includes RNG states)",
                ["driver", "file B", "save", "load"],
                [[f"{c['elements']:,} elements, {c['steps_run']:,} steps run", f"{c['file_bytes']:,}",
                  fmt_time(c["save_s"]), fmt_time(c["load_s"])]])
    print(f"\n(sizes: {'quick' if results['quick'] else 'full'}; per-step N = {sizes['steps']:,}, "
          f"ignite N = {sizes['ignite_steps']:,})")


def environment():
    env = {
        "python": sys.version.split()[0], "implementation": platform.python_implementation(),
        "platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "flowvm": flowvm.__version__, "flowvm_path": str(Path(flowvm.__file__).parent),
        "ignite": getattr(ignite, "__version__", None),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:  # which code was measured; absent outside a git checkout
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                           text=True, check=True).stdout.strip()
        env["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--", "flowvm", "programs"], cwd=REPO_ROOT,
                                               capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return env


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a few seconds; CI smoke test)")
    parser.add_argument("--repeats", type=int, default=3, help="samples per figure; the best is kept (default 3)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    pick = 1 if args.quick else 0
    # Move everything imported so far (torch, via ignite, is large) to the GC's
    # permanent generation: the gc.collect() before each sample then takes
    # microseconds instead of ~0.2 s, and never scans the libraries' objects.
    gc.freeze()
    sizes = {name: value[pick] for name, value in SIZES.items()}
    t0 = perf_counter()
    per_step = bench_per_step(sizes, args.repeats)
    pickles, largest = bench_pickle(sizes["flat_repeats"], sizes["depths"], args.repeats, sizes["min_sample_s"])
    checkpoint = bench_checkpoint(largest, args.repeats, sizes["min_sample_s"])

    results = {
        "benchmark": "bench_core", "quick": args.quick, "repeats": args.repeats, "sizes": sizes,
        "targets_ratio_to_plain": TARGETS, "environment": environment(),
        "per_step": per_step, "pickle": pickles, "checkpoint": checkpoint,
        "wall_s": perf_counter() - t0,
    }
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out} ({results['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
