#!/usr/bin/env python
"""Checkpoint files of drivers holding large tensors and arrays: flowvm.save/load against torch.save/load.

Run from the repository root::

    python bench/bench_checkpoint.py            # full sizes (100-160 MB files), about two minutes
    python bench/bench_checkpoint.py --quick    # small sizes, about 20 s (CI smoke test)

Three cases, each a half-run driver (see ``CASES``):

- ``tensor``: a 100 MB float32 tensor in a register;
- ``model``: CALLs holding a 9.9M-parameter MLP and its Adam optimizer, after one training step
  (parameters, gradients and Adam's two moments: about 160 MB);
- ``numpy``: a 100 MB float64 array in a register.

For each case it prints and writes to ``bench/results/checkpoint.json``:

1. time, the median of ``--rounds`` rounds, each running flowvm's and torch's call once, in alternating
   order; the ratio is flowvm's median over torch's:

   - save: ``flowvm.save(driver, path)`` against ``torch.save`` of the same objects to an open file
     followed by ``flush`` and ``os.fsync`` (flowvm.save also renames the file into place and fsyncs
     the directory), in this process;
   - load: ``flowvm.load(path)`` against ``torch.load(path, weights_only=False)``, each in a fresh child
     process (after a small load of the same kind, so that imports are not timed), as a resume would:
     both read the file from the page cache into memory the process has not used before;
   - load again: the same loads repeated in this process, where the allocator hands out memory the
     previous load freed (no page faults): a load's own work only, the SHA-256 pass included.

2. memory: the peak resident set size during each call minus the resident set size just before it
   (Linux: the peak is reset by writing 5 to /proc/self/clear_refs and read from VmHWM in
   /proc/self/status), as a multiple of the file's size; loads are measured in their timing children,
   saves in one more child with glibc's mmap threshold fixed (so that every large buffer shows in the
   RSS).  A load's figure includes the objects it loads (about 1x the file size for both libraries);
   "left" is what the call left resident.  The page cache is not counted.

Figures are measured and reported, never asserted: the script exits 0 whatever they are.  Timings
depend on the machine, its disk and its load: compare the ratios, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from time import perf_counter

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "checkpoint.json"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import flowvm  # noqa: E402
from flowvm import CALL, REPEAT, SEQ, Registers  # noqa: E402

# (full, quick) sizes
SIZES = {
    "tensor_floats": (25_000_000, 250_000),            # float32: 100 MB / 1 MB
    "model_widths": ((1000, 3000, 2000, 450), (100, 300, 200, 45)),  # 9.9M / 0.1M parameters
    "array_floats": (12_500_000, 125_000),             # float64: 100 MB / 1 MB
}
TARGET_RATIO = 1.5
TARGET_MEMORY = 1.2


# ------------------------------------------------------------------ cases
def keep(x):
    return x


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def case_tensor(size):
    """(driver, the objects torch.save gets)."""
    g = torch.Generator().manual_seed(0)
    reg = Registers(w=torch.randn(size, generator=g))
    drv = SEQ([CALL(keep, reg("w"), store_to=reg("w")), CALL(keep, reg("w"), store_to=reg("w"))]).start()
    drv.run(max_steps=1)
    return drv, drv.registers["w"]


def case_model(widths):
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(widths) - 2 else [])
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    reg = Registers(x=torch.randn(64, widths[0]), y=torch.randn(64, widths[-1]))
    step = SEQ([CALL(opt.zero_grad), CALL(loss_of, model, reg("x"), reg("y"), store_to=reg("loss")),
                CALL(torch.Tensor.backward, reg("loss")), CALL(opt.step)])
    drv = REPEAT(10, step).start()
    drv.run(max_steps=4)  # one whole training step: gradients and Adam's state exist
    assert opt.state, "Adam has no state yet"
    # torch's pickling leaves out .grad, which the driver keeps: give torch.save the gradients too
    return drv, {"model": model, "optimizer": opt, "grads": [p.grad for p in model.parameters()]}


def case_numpy(size):
    reg = Registers(a=np.random.default_rng(0).standard_normal(size))
    drv = SEQ([CALL(keep, reg("a"), store_to=reg("a")), CALL(keep, reg("a"), store_to=reg("a"))]).start()
    drv.run(max_steps=1)
    return drv, drv.registers["a"]


CASES = {
    "tensor": (case_tensor, "tensor_floats", "a 100 MB float32 tensor in a register"),
    "model": (case_model, "model_widths", "9.9M-parameter MLP + Adam, after one step"),
    "numpy": (case_numpy, "array_floats", "a 100 MB float64 numpy array in a register"),
}


def build(name, quick):
    fn, size_key, _ = CASES[name]
    return fn(SIZES[size_key][1 if quick else 0])


# ------------------------------------------------------------------ operations
def torch_save(obj, path):
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(path):
    return torch.load(path, weights_only=False)


def save_operations(drv, objects, directory):
    fpath, tpath = Path(directory) / "run.ckpt", Path(directory) / "run.pt"
    return fpath, tpath, {"flowvm.save": lambda: flowvm.save(drv, fpath),
                          "torch.save": lambda: torch_save(objects, tpath)}


def load_operation(label, path):
    return (lambda: flowvm.load(path)) if label == "flowvm.load" else (lambda: torch_load(path))


def timed_rounds(ops, rounds):
    """{label: [seconds per round]}: every operation once per round, the order reversed every other round
    (so that neither always runs after the other's garbage)."""
    samples = {label: [] for label in ops}
    for r in range(rounds):
        for label in (list(ops) if r % 2 == 0 else list(ops)[::-1]):
            gc.collect()
            t0 = perf_counter()
            result = ops[label]()
            samples[label].append(perf_counter() - t0)
            del result
    return samples


def bench_case(name, quick, rounds, memory):
    drv, objects = build(name, quick)
    warm_drv, warm_objects = build(name, True)
    with tempfile.TemporaryDirectory() as tmp:
        fpath, tpath, saves = save_operations(drv, objects, tmp)
        warm = {"flowvm.load": Path(tmp) / "warm.ckpt", "torch.load": Path(tmp) / "warm.pt"}
        flowvm.save(warm_drv, warm["flowvm.load"])
        torch_save(warm_objects, warm["torch.load"])
        for op in saves.values():  # first calls: imports, first allocations
            op()
        samples = timed_rounds(saves, rounds)
        files = {"flowvm.load": fpath, "torch.load": tpath}
        # a resume loads in a fresh process: one child per load, timed there (after a small load of the
        # same kind, so that imports are not timed), with its peak memory
        fresh = {label: [] for label in files}
        for r in range(rounds):
            for label in (list(files) if r % 2 == 0 else list(files)[::-1]):
                fresh[label].append(run_child(["--child-load", label, str(files[label]), str(warm[label])]))
        samples.update({label: [c["seconds"] for c in fresh[label]] if None not in fresh[label] else []
                        for label in files})
        # the same loads repeated in this process: the allocator has the memory the last load freed
        again = timed_rounds({label: load_operation(label, path) for label, path in files.items()}, rounds)
        sizes = {"flowvm_file_bytes": fpath.stat().st_size, "torch_file_bytes": tpath.stat().st_size}
    medians = {label: statistics.median(s) if s else None for label, s in samples.items()}
    again_medians = {label: statistics.median(s) for label, s in again.items()}
    result = {"case": name, "description": CASES[name][2], **sizes, "median_s": medians, "samples_s": samples,
              "load_again_median_s": again_medians, "load_again_samples_s": again,
              "save_ratio": medians["flowvm.save"] / medians["torch.save"],
              "load_ratio": (medians["flowvm.load"] / medians["torch.load"]) if medians["torch.load"] else None,
              "load_again_ratio": again_medians["flowvm.load"] / again_medians["torch.load"]}
    result["memory"] = None
    if memory and _can_measure_memory() and all(None not in fresh[label] for label in files):
        mem = run_child(["--child-save-memory", name] + (["--quick"] if quick else []), fixed_mmap=True) or {}
        for label in files:
            mem[label] = {key: statistics.median([c[key] for c in fresh[label]])
                          for key in ("peak_over_before_bytes", "left_bytes")}
        for label in list(mem):
            size = sizes["flowvm_file_bytes"] if label.startswith("flowvm") else sizes["torch_file_bytes"]
            mem[label]["peak_over_file"] = mem[label]["peak_over_before_bytes"] / size
            mem[label]["left_over_file"] = mem[label]["left_bytes"] / size
        result["memory"] = mem
    return result


# ------------------------------------------------------------------ child processes
def _status_kib(field):
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def _can_measure_memory():
    return os.access("/proc/self/clear_refs", os.W_OK)


def measured(op):
    """(op's result, seconds, {peak RSS over the RSS before, RSS left}) where Linux lets us reset the peak."""
    gc.collect()
    memory = _can_measure_memory()
    if memory:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
        before = _status_kib("VmRSS")
    t0 = perf_counter()
    result = op()
    seconds = perf_counter() - t0
    if not memory:
        return result, seconds, {"peak_over_before_bytes": None, "left_bytes": None}
    peak, after = _status_kib("VmHWM"), _status_kib("VmRSS")
    return result, seconds, {"peak_over_before_bytes": (peak - before) * 1024, "left_bytes": (after - before) * 1024}


def child_load(label, path, warm_path):
    load_operation(label, Path(warm_path))()  # imports and first-time code paths, on a small file
    _, seconds, mem = measured(load_operation(label, Path(path)))
    return {"seconds": seconds, **mem}


def child_save_memory(name, quick):
    """The saves' peak memory, in a fresh process."""
    drv, objects = build(name, quick)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        _, _, ops = save_operations(drv, objects, tmp)
        for op in ops.values():  # first calls, as for the timings
            op()
        for label, op in ops.items():
            _, _, out[label] = measured(op)
    return out


def run_child(args, fixed_mmap=False):
    env = dict(os.environ)
    # the child measures the flowvm this process imported
    env["PYTHONPATH"] = os.pathsep.join([str(Path(flowvm.__file__).resolve().parent.parent),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if fixed_mmap:
        # glibc would otherwise serve a buffer allocated after a large free from its heap (its mmap
        # threshold grows with each large free), unseen by the RSS: with a fixed threshold every large
        # buffer is mapped when allocated
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                          env=env, timeout=600)
    if done.returncode != 0:
        print(f"child {' '.join(args)} failed:\n{done.stderr}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ report
def _ms(seconds):
    return f"{seconds * 1e3:>8.1f}ms" if seconds is not None else f"{'failed':>10}"


def _ratio(r):
    return f"{r:>5.2f}x" if r is not None else f"{'':>6}"


def report(results):
    print(f"Checkpoint save/load ({'quick' if results['quick'] else 'full'} sizes, median of {results['rounds']} "
          "rounds)\n  save: in this process; torch.save includes flush + os.fsync"
          "\n  load: in a fresh process per sample, as a resume would"
          "\n  load again: repeated in this process, where the allocator holds memory the last load freed")
    head = (f"{'case':<7} {'file MB':>7} | {'flowvm.save':>10} {'torch.save':>10} {'ratio':>6} | "
            f"{'flowvm.load':>10} {'torch.load':>10} {'ratio':>6} | {'load again':>10} {'torch':>10} {'ratio':>6}")
    print(head)
    print("-" * len(head))
    for r in results["cases"]:
        m, a = r["median_s"], r["load_again_median_s"]
        print(f"{r['case']:<7} {r['flowvm_file_bytes'] / 1e6:>7.1f} | {_ms(m['flowvm.save'])} {_ms(m['torch.save'])} "
              f"{_ratio(r['save_ratio'])} | {_ms(m['flowvm.load'])} {_ms(m['torch.load'])} {_ratio(r['load_ratio'])} | "
              f"{_ms(a['flowvm.load'])} {_ms(a['torch.load'])} {_ratio(r['load_again_ratio'])}")
    print(f"(target: ratios within {TARGET_RATIO}x; torch's files: "
          + ", ".join(f"{r['case']} {r['torch_file_bytes'] / 1e6:.1f} MB" for r in results["cases"]) + ")")
    print("\nPeak resident memory during the call over the RSS just before it, as a multiple of that library's file "
          "size\n(fresh processes; the peak is VmHWM after writing 5 to /proc/self/clear_refs; a load's peak includes "
          "the objects it loads,\n'left' is what stays resident after the call; the page cache is not counted)")
    head = (f"{'case':<7} | {'flowvm.save':>11} {'torch.save':>10} | {'flowvm.load':>11} {'(left)':>7} "
            f"{'torch.load':>10} {'(left)':>7}")
    print(head)
    print("-" * len(head))
    for r in results["cases"]:
        mem = r.get("memory")
        if not mem or any(label not in mem for label in ("flowvm.save", "torch.save", "flowvm.load", "torch.load")):
            print(f"{r['case']:<7} | not measured (needs Linux and a writable /proc/self/clear_refs)")
            continue
        print(f"{r['case']:<7} | {mem['flowvm.save']['peak_over_file']:>10.2f}x "
              f"{mem['torch.save']['peak_over_file']:>9.2f}x | {mem['flowvm.load']['peak_over_file']:>10.2f}x "
              f"{mem['flowvm.load']['left_over_file']:>6.2f}x {mem['torch.load']['peak_over_file']:>9.2f}x "
              f"{mem['torch.load']['left_over_file']:>6.2f}x")
    print(f"(target: flowvm's extra peak memory at most {TARGET_MEMORY}x the file size)")


def environment() -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
           "torch": torch.__version__, "numpy": np.__version__, "flowvm": flowvm.__version__,
           "flowvm_path": str(Path(flowvm.__file__).parent),
           "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:  # which code was measured; absent outside a git checkout
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                           text=True, timeout=10).stdout.strip()
        env["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--", "flowvm", "programs"], cwd=REPO_ROOT,
                                               capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (CI smoke test)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per case; the median is kept "
                                                            "(default 5, 1 with --quick)")
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurement of the saves")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--child-load", nargs=3, metavar=("LABEL", "FILE", "WARM_FILE"), help=argparse.SUPPRESS)
    p.add_argument("--child-save-memory", metavar="CASE", choices=list(CASES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as the flowvm command runs torch programs; the same for both libraries
    if args.child_load:
        print(json.dumps(child_load(*args.child_load)))
        return 0
    if args.child_save_memory:
        print(json.dumps(child_save_memory(args.child_save_memory, args.quick)))
        return 0
    rounds = args.rounds or (1 if args.quick else 5)
    if rounds < 1:
        p.error("--rounds must be >= 1")
    t0 = perf_counter()
    cases = [bench_case(name, args.quick, rounds, not args.no_memory) for name in args.cases]
    results = {"benchmark": "bench_checkpoint", "quick": args.quick, "rounds": rounds, "cases": cases,
               "target_ratio": TARGET_RATIO, "target_memory_over_file": TARGET_MEMORY,
               "environment": environment(), "wall_s": perf_counter() - t0}
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out} ({results['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
