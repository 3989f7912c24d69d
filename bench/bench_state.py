#!/usr/bin/env python
"""State checkpoints (flowvm.save_state/load_state) against safetensors and torch.save/torch.load of the same
state dicts.

Run from the repository root::

    python bench/bench_state.py            # full sizes (100-260 MB files), about a minute
    python bench/bench_state.py --quick    # small sizes, a few seconds (CI smoke test)

Three cases, each a half-run driver (see ``CASES``):

- ``tensor``: a 100 MB float32 tensor in a register;
- ``model``: CALLs holding a 9.9M-parameter MLP and its Adam optimizer, after one training step
  (parameters, gradients and Adam's two moments: about 160 MB);
- ``both``: the model and the 100 MB tensor in one driver.

Timed, each the median of ``--rounds`` rounds (every operation once per round, the order reversed every other
round, after os.sync() so that an operation does not pay for the last one's writeback), in this process:

- save: ``flowvm.save_state(driver, path)`` (the state collected, SHA-256 hash list on all cores, written by
  safetensors into a private directory beside the target, fsync, permissions, rename, directory fsync; the
  file it replaces is freed by a background thread, which finishes before the next operation starts)
  against ``safetensors.torch.save_file`` of the same tensors followed by an fsync of the file, and
  ``torch.save`` of the same state dicts to an open file followed by flush and fsync;
- load: ``flowvm.load_state(path, program)`` into a program built beforehand (the file checked, every tensor
  copied into memory of its own and hashed, the states restored with ``load_state_dict``) against
  safetensors' ``safe_open`` + ``get_tensor`` of every tensor followed by the same restore (each tensor cloned
  into memory of its own, then ``load_state_dict`` into the model and the optimizer, the gradients set), and
  ``torch.load(weights_only=True)`` followed by the same restore; "safetensors, lazy" is ``load_file`` alone,
  which maps the file and reads nothing until the tensors are used.

The target is a save within 1.2x of safetensors' own time.  On a machine whose page cache takes large writes
erratically (the same 260 MB write taking 50 or 700 ms, whatever writes it), compare the medians and the
best-of-rounds ratios, both printed.  Figures are measured and reported, never asserted:
the script exits 0 whatever they are.  Timings depend on the machine, its disk and its load: compare the
ratios, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from time import perf_counter

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "state.json"
sys.path.insert(0, str(REPO_ROOT))  # this checkout's flowvm, installed or not

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import flowvm  # noqa: E402
from flowvm import CALL, REPEAT, SEQ, Registers  # noqa: E402
from flowvm.persist import storage  # noqa: E402

SIZES = {  # (full, quick)
    "tensor_floats": (25_000_000, 250_000),  # float32: 100 MB / 1 MB
    "model_widths": ((1000, 3000, 2000, 450), (100, 300, 200, 45)),  # 9.9M / 0.1M parameters
}
TARGET_RATIO = 1.2


# ------------------------------------------------------------------ cases
def keep(x):
    return x


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def build(name: str, quick: bool):
    """(program, driver run to mid-run, the state dicts of the same run)."""
    k = 1 if quick else 0
    torch.manual_seed(0)
    reg = Registers()
    steps, parts, objects = [], {}, {}
    if name in ("tensor", "both"):
        reg["w"] = torch.randn(SIZES["tensor_floats"][k])
        steps.append(CALL(keep, reg("w"), store_to=reg("w")))
    if name in ("model", "both"):
        widths = SIZES["model_widths"][k]
        layers = []
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(widths) - 2 else [])
        model = torch.nn.Sequential(*layers)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        reg["x"], reg["y"] = torch.randn(64, widths[0]), torch.randn(64, widths[-1])
        steps += [CALL(opt.zero_grad), CALL(loss_of, model, reg("x"), reg("y"), store_to=reg("loss")),
                  CALL(torch.Tensor.backward, reg("loss")), CALL(opt.step)]
        objects.update(model=model, optimizer=opt)
    program = REPEAT(10, SEQ(steps))
    drv = program.start()
    drv.run(max_steps=len(steps))  # one whole iteration: gradients and Adam's state exist
    if "w" in reg:
        parts["w"] = drv.registers["w"]
    if objects:
        model, opt = objects["model"], objects["optimizer"]
        parts.update(model=model.state_dict(), optimizer=opt.state_dict(),
                     grads={n: p.grad for n, p in model.named_parameters()})
        drv.registers.pop("loss")  # (its autograd graph: a tensor between two steps would not hold one)
    return program, drv, parts, objects


def flat(parts: dict) -> tuple[dict, dict]:
    """The state dicts as one dict of tensors for safetensors, and the JSON metadata it needs besides."""
    tensors, meta = {}, {}
    if "w" in parts:
        tensors["w"] = parts["w"]
    if "model" in parts:
        tensors.update({f"model.{k}": v for k, v in parts["model"].items()})
        tensors.update({f"grad.{k}": v for k, v in parts["grads"].items()})
        for i, state in parts["optimizer"]["state"].items():
            tensors.update({f"optimizer.{i}.{k}": v for k, v in state.items()})
        meta["param_groups"] = json.dumps(parts["optimizer"]["param_groups"])
    return tensors, meta


def restore(tensors: dict, meta: dict, objects: dict) -> dict:
    """What a resume does with the tensors of the baselines: own memory, then the model's and the optimizer's
    load_state_dict and the gradients (the register tensor is returned)."""
    out = {}
    if "w" in tensors:
        out["w"] = tensors["w"].clone()
    if objects:
        model, opt = objects["model"], objects["optimizer"]
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        state: dict = {}
        for k, v in tensors.items():
            if k.startswith("optimizer."):
                _, i, name = k.split(".", 2)
                state.setdefault(int(i), {})[name] = v.clone()
        opt.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
        for n, p in model.named_parameters():
            p.grad = tensors[f"grad.{n}"].clone()
    return out


def torch_restore(parts: dict, objects: dict) -> dict:
    out = {}
    if "w" in parts:
        out["w"] = parts["w"]
    if objects:
        objects["model"].load_state_dict(parts["model"])
        objects["optimizer"].load_state_dict(parts["optimizer"])
        for n, p in objects["model"].named_parameters():
            p.grad = parts["grads"][n]
    return out


def fsync_file(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def operations(name: str, quick: bool, directory: Path) -> tuple[dict, dict, dict]:
    _, drv, parts, _ = build(name, quick)
    program, _, _, objects = build(name, quick)  # what the loads restore into (drivers of one program share
    # its register file: loading into the saved run's own program would change what the saves write)
    paths = {"flowvm": directory / f"{name}.state.safetensors", "safetensors": directory / f"{name}.safetensors",
             "torch": directory / f"{name}.pt"}
    tensors, meta = flat(parts)

    def torch_save():
        with open(paths["torch"], "wb") as f:
            torch.save(parts, f)
            f.flush()
            os.fsync(f.fileno())

    def safetensors_save():
        save_file(tensors, paths["safetensors"], metadata=meta)
        fsync_file(paths["safetensors"])

    saves = {"flowvm.save_state": lambda: flowvm.save_state(drv, paths["flowvm"]),
             "safetensors.save_file": safetensors_save, "torch.save": torch_save}

    def safetensors_load():
        with safe_open(str(paths["safetensors"]), framework="pt") as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata() or {}
        return restore(got, metadata, objects)

    loads = {"flowvm.load_state": lambda: flowvm.load_state(paths["flowvm"], program),
             "safetensors + restore": safetensors_load,
             "torch.load + restore": lambda: torch_restore(torch.load(paths["torch"], weights_only=True), objects),
             "safetensors, lazy": lambda: load_file(paths["safetensors"])}
    return saves, loads, paths


def timed_rounds(ops: dict, rounds: int) -> dict:
    samples = {label: [] for label in ops}
    for r in range(rounds):
        for label in (list(ops) if r % 2 == 0 else list(ops)[::-1]):
            gc.collect()
            storage.freed()  # the file the last save replaced is freed (flowvm does it in the background)
            os.sync()  # the last operation's dirty pages go to disk now, not during the next one
            t0 = perf_counter()
            result = ops[label]()
            samples[label].append(perf_counter() - t0)
            del result
    return samples


def bench_case(name: str, quick: bool, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(dir=REPO_ROOT / "bench" / "results") as tmp:
        saves, loads, paths = operations(name, quick, Path(tmp))
        for op in (*saves.values(), *loads.values()):  # first calls: imports, first allocations
            op()
        samples = {**timed_rounds(saves, rounds), **timed_rounds(loads, rounds)}
        sizes = {label: p.stat().st_size for label, p in paths.items()}
    med = {label: statistics.median(s) for label, s in samples.items()}
    best = {label: min(s) for label, s in samples.items()}
    return {"case": name, "file_bytes": sizes, "median_s": med, "min_s": best, "samples_s": samples,
            "save_ratio_safetensors_min": best["flowvm.save_state"] / best["safetensors.save_file"],
            "load_ratio_safetensors_min": best["flowvm.load_state"] / best["safetensors + restore"],
            "save_ratio_safetensors": med["flowvm.save_state"] / med["safetensors.save_file"],
            "save_ratio_torch": med["flowvm.save_state"] / med["torch.save"],
            "load_ratio_safetensors": med["flowvm.load_state"] / med["safetensors + restore"],
            "load_ratio_torch": med["flowvm.load_state"] / med["torch.load + restore"]}


def report(results: dict) -> None:
    print(f"State checkpoints ({'quick' if results['quick'] else 'full'} sizes, median of {results['rounds']} "
          f"rounds, in this process; saves include fsync)")
    head = (f"{'case':<7} {'MB':>6} | {'save_state':>10} {'st.save':>9} {'ratio':>6} {'torch':>9} {'ratio':>6} | "
            f"{'load_state':>10} {'st+rest.':>9} {'ratio':>6} {'torch':>9} {'ratio':>6} {'st lazy':>9}")
    print(head)
    print("-" * len(head))
    for r in results["cases"]:
        m = r["median_s"]
        ms = lambda s: f"{s * 1e3:>7.1f}ms"  # noqa: E731
        print(f"{r['case']:<7} {r['file_bytes']['flowvm'] / 1e6:>6.1f} | {ms(m['flowvm.save_state']):>10} "
              f"{ms(m['safetensors.save_file'])} {r['save_ratio_safetensors']:>5.2f}x {ms(m['torch.save'])} "
              f"{r['save_ratio_torch']:>5.2f}x | {ms(m['flowvm.load_state']):>10} {ms(m['safetensors + restore'])} "
              f"{r['load_ratio_safetensors']:>5.2f}x {ms(m['torch.load + restore'])} {r['load_ratio_torch']:>5.2f}x "
              f"{ms(m['safetensors, lazy'])}")
    print(f"(target: save_state within {TARGET_RATIO}x of safetensors.save_file; st+rest.: safe_open, each "
          "tensor cloned, load_state_dict; st lazy: load_file alone, which reads nothing yet)")
    print("best of the rounds, save_state / safetensors: " + ", ".join(
        f"{r['case']} save {r['save_ratio_safetensors_min']:.2f}x load {r['load_ratio_safetensors_min']:.2f}x"
        for r in results["cases"]))


def environment() -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
           "torch": torch.__version__, "numpy": np.__version__, "safetensors": safetensors.__version__,
           "flowvm": flowvm.__version__, "flowvm_path": str(Path(flowvm.__file__).parent),
           "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                           text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (CI smoke test)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7, 1 with --quick)")
    p.add_argument("--cases", nargs="+", choices=("tensor", "model", "both"), default=["tensor", "model", "both"])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rounds = args.rounds or (1 if args.quick else 7)
    (REPO_ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    t0 = perf_counter()
    results = {"benchmark": "bench_state", "quick": args.quick, "rounds": rounds,
               "cases": [bench_case(name, args.quick, rounds) for name in args.cases],
               "target_ratio": TARGET_RATIO, "environment": environment()}
    results["wall_s"] = perf_counter() - t0
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out} ({results['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
