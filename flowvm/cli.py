"""The flowvm command: run, resume, show, verify and list programs.

    flowvm run pca --set batches=20 --checkpoint run.ckpt --every 1000
    flowvm resume run.ckpt
    flowvm show run.ckpt
    flowvm verify programs/pca.py
    flowvm list

A *program module* has ``build(**options)`` returning a program; optionally
``SHOW`` (register names to show while running) and ``report(registers)``
(a summary printed at the end).  A target is a bundled program name
(``pca``), a module name (``mypkg.train``) or a path to a .py file.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import os
import pkgutil
import signal
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from . import checkpoint
from .driver import Driver
from .errors import CheckpointError, FlowError


# ------------------------------------------------------------------ targets
def load_module(target: str) -> ModuleType:
    """Import a program module from a bundled name, a module name or a .py path."""
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = Path(target).resolve()
        if not path.is_file():
            raise SystemExit(f"flowvm: no such program file: {target}")
        bundled = _bundled_path(path.stem)
        if bundled is not None and bundled == path:
            return importlib.import_module(f"flowvm.programs.{path.stem}")
        directory = str(path.parent)
        if directory not in sys.path:
            sys.path.insert(0, directory)
        return importlib.import_module(path.stem)
    for name in (f"flowvm.programs.{target}", target):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is None or not name.startswith(err.name):
                raise
    raise SystemExit(f"flowvm: no program {target!r} (try `flowvm list`, a module name or a .py file)")


def _bundled_path(stem: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(f"flowvm.programs.{stem}")
    except ModuleNotFoundError:
        return None
    return Path(spec.origin).resolve() if spec is not None and spec.origin else None


def parse_sets(pairs: list[str], build) -> dict[str, Any]:
    params = inspect.signature(build).parameters
    options = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"flowvm: --set expects name=value, got {pair!r}")
        if name not in params:
            raise SystemExit(f"flowvm: the program has no option {name!r}; options: {', '.join(params)}")
        try:
            options[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[name] = text
    return options


def build_program(target: str, sets: list[str]):
    module = load_module(target)
    if not callable(getattr(module, "build", None)):
        raise SystemExit(f"flowvm: {module.__name__} has no build() function")
    return module, module.build(**parse_sets(sets, module.build))


# ------------------------------------------------------------------ running
class _Stop:
    """Turns SIGINT/SIGTERM into a request to checkpoint and stop at the next step boundary."""

    def __init__(self):
        self.signal: int | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _shown(drv: Driver, names: list[str]) -> str:
    from .printer import fmt

    parts = []
    for name in names:
        if name in drv.registers:
            parts.append(f"{name}={fmt(drv.registers[name], 50)}")
    return " ".join(parts)


def drive(drv: Driver, show: list[str], ckpt: Path | None, every: int | None, every_seconds: float | None,
          meta: dict, key: str | None, max_steps: int | None = None) -> int:
    """Run drv with progress output and periodic checkpoints; return the exit status."""
    tty = sys.stderr.isatty()
    bar = None
    if tty:
        from tqdm import tqdm

        bar = tqdm(initial=drv.steps, unit="step", dynamic_ncols=True, file=sys.stderr)
    last_save_step, last_save_time = drv.steps, time.monotonic()
    last_line = time.monotonic()
    chunk = 1
    limit = None if max_steps is None else drv.steps + max_steps

    def save():
        nonlocal last_save_step, last_save_time
        if ckpt is not None:
            checkpoint.save(drv, ckpt, key=key, meta=meta)
            last_save_step, last_save_time = drv.steps, time.monotonic()

    with _Stop() as stop:
        while not drv.done and stop.signal is None and (limit is None or drv.steps < limit):
            n = chunk
            if every is not None:
                n = max(1, min(n, last_save_step + every - drv.steps))
            if limit is not None:
                n = min(n, limit - drv.steps)
            t0 = time.monotonic()
            before = drv.steps
            drv.run(max_steps=n)
            took = time.monotonic() - t0
            # aim for chunks of about 50 ms so that signals and output stay responsive
            chunk = max(1, min(chunk * 2, int(chunk * 0.05 / took) if took > 0 else chunk * 2))
            now = time.monotonic()
            if bar is not None:
                bar.update(drv.steps - before)
                bar.set_postfix_str(_shown(drv, show), refresh=False)
            elif now - last_line >= 2.0:
                print(f"step {drv.steps} {_shown(drv, show)}".rstrip(), flush=True)
                last_line = now
            if ckpt is not None and not drv.done and (
                    (every is not None and drv.steps - last_save_step >= every)
                    or (every_seconds is not None and now - last_save_time >= every_seconds)):
                save()
        if bar is not None:
            bar.close()
        if drv.done:
            if ckpt is not None:
                save()
            return 0
        save()
        if stop.signal is not None:
            name = signal.Signals(stop.signal).name
            where = f"; saved to {ckpt}, continue with `flowvm resume {ckpt}`" if ckpt else ""
            print(f"flowvm: stopped by {name} at step {drv.steps}{where}", file=sys.stderr)
            return 128 + stop.signal
        return 0


def _finish(drv: Driver, module: ModuleType | None) -> None:
    if not drv.done:
        print(f"paused at step {drv.steps}")
        return
    report = getattr(module, "report", None) if module is not None else None
    print(f"finished after {drv.steps} steps")
    print(report(drv.registers) if report is not None else registers_summary(drv.registers))


def registers_summary(registers: dict) -> str:
    from .printer import fmt

    rows = []
    for name, value in registers.items():
        shape = getattr(value, "shape", None)
        kind = type(value).__name__
        detail = f"shape {tuple(shape)}, {getattr(value, 'dtype', '')}" if shape is not None else fmt(value, 60)
        rows.append(f"  {name:<16} {kind:<10} {detail}")
    return "registers:\n" + ("\n".join(rows) if rows else "  (none)")


# ------------------------------------------------------------------ commands
def cmd_run(args) -> int:
    module, program = build_program(args.target, args.set)
    drv = program.start()
    meta = {"target": args.target, "module": module.__name__, "show": list(getattr(module, "SHOW", []))}
    status = drive(drv, meta["show"], args.checkpoint, args.every, args.every_seconds, meta, args.key,
                   args.max_steps)
    _finish(drv, module)
    return status


def cmd_resume(args) -> int:
    header = checkpoint.read_header(args.path)
    meta = header.get("meta") or {}
    module = None
    if meta.get("module"):
        try:
            module = load_module(meta["target"]) if meta.get("target") else importlib.import_module(meta["module"])
        except (SystemExit, ImportError):
            module = None
    drv = checkpoint.load(args.path, key=args.key)
    target = args.checkpoint if args.checkpoint is not None else Path(args.path)
    status = drive(drv, meta.get("show", []), target, args.every, args.every_seconds, meta, args.key,
                   args.max_steps)
    _finish(drv, module)
    return status


def cmd_show(args) -> int:
    header = checkpoint.read_header(args.path)
    meta = header.get("meta") or {}
    if meta.get("target"):
        try:
            load_module(meta["target"])
        except (SystemExit, ImportError):
            pass
    drv = checkpoint.load(args.path, key=args.key, restore_random=False)
    print(f"# {args.path}: written by flowvm {header['flowvm']} (Python {header['python']}) at {header['created']}")
    print(drv)
    print(registers_summary(drv.registers))
    return 0


def cmd_verify(args) -> int:
    from .verify import verify

    _, program = build_program(args.target, args.set)
    verify(program)
    print(program)
    print(f"# {args.target}: verified")
    return 0


def cmd_list(args) -> int:
    from . import programs

    for info in sorted(pkgutil.iter_modules(programs.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"flowvm.programs.{info.name}")
        doc = (module.__doc__ or "").strip().splitlines()
        print(f"{info.name:<12} {doc[0] if doc else ''}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowvm", description="Run learning algorithms written as flowvm programs.")
    sub = p.add_subparsers(dest="command", required=True)

    def saving(sp):
        sp.add_argument("--checkpoint", type=Path, help="save the run to this file (atomically)")
        sp.add_argument("--every", type=int, help="save every N steps")
        sp.add_argument("--every-seconds", type=float, help="save every S seconds")
        sp.add_argument("--max-steps", type=int, help="pause (and save) after this many more steps")
        sp.add_argument("--key", help="sign checkpoints with this key (and require it on load)")

    run = sub.add_parser("run", help="run a program")
    run.add_argument("target", help="bundled program name, module name or .py file")
    run.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a build() option")
    saving(run)
    run.set_defaults(func=cmd_run)

    resume = sub.add_parser("resume", help="continue a saved run")
    resume.add_argument("path", type=Path)
    saving(resume)
    resume.set_defaults(func=cmd_resume)

    show = sub.add_parser("show", help="print a saved run: program, position, registers")
    show.add_argument("path", type=Path)
    show.add_argument("--key")
    show.set_defaults(func=cmd_show)

    verify = sub.add_parser("verify", help="check a program")
    verify.add_argument("target")
    verify.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    verify.set_defaults(func=cmd_verify)

    lst = sub.add_parser("list", help="list the bundled programs")
    lst.set_defaults(func=cmd_list)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if getattr(args, "every", None) is not None and args.every < 1:
        raise SystemExit("flowvm: --every must be >= 1")
    try:
        return args.func(args)
    except (CheckpointError, FlowError) as err:
        print(f"flowvm: {err}", file=sys.stderr)
        return 2
