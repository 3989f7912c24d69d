"""A command's run from start to end: the program built from its target and options (``start_program``), the
thread count, the Runner for its checkpoint, and its end (the report, or where it paused; the model written
with ``--output``, checked before the run starts)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

from ..base.errors import UsageError
from ..machine.driver import Driver
from .places import KEY_ENV, key_of
from .runner import Runner
from .targets import load_module
from .values import registers_summary


def check_output(path: str | None) -> None:
    from ..programs import MODEL_SUFFIXES

    if path is None:
        return
    if Path(path).suffix.lower() not in MODEL_SUFFIXES:
        raise UsageError(f"--output {path}: give a file ending in {', '.join(MODEL_SUFFIXES)}")
    folder = Path(path).parent
    if not folder.is_dir():
        raise UsageError(f"--output {path}: its folder {folder} does not exist")
    if Path(path).is_dir():
        raise UsageError(f"--output {path}: a folder, not a file")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--output {path}: its folder {folder} cannot be written")


def saving_as_recorded(args, meta: dict) -> dict:
    """A resume keeps saving as the run was told to (its recorded --every/--every-seconds), unless given anew:
    the meta to record then."""
    if args.every is None and args.every_seconds is None:
        args.every, args.every_seconds = meta.get("every"), meta.get("every_seconds")
        return meta
    return dict(meta, every=args.every, every_seconds=args.every_seconds)


def check_model(module: ModuleType | None, path: str | None) -> None:
    """--output: refused before the first step when the program gives no model."""
    if path is not None and module is not None and not callable(getattr(module, "model", None)):
        raise UsageError(f"--output {path}: the program gives no model (its module has no "
                         "model(registers) function)")


def write_model(drv: Driver, module: ModuleType | None, path: str | None) -> None:
    """--output: the finished run's model (its module's model(registers)) written to path."""
    if path is None or not drv.done:
        return
    check_model(module, path)
    if module is None:
        raise UsageError(f"--output {path}: the run does not record its program's module")
    from ..programs import save_model

    model = module.model(drv.registers)
    try:
        save_model(model, path)
    except (TypeError, ValueError, AttributeError) as err:
        raise UsageError(f"--output {path}: model(registers) gave a {type(model).__name__}, which cannot be written "
                         f"as a model ({type(err).__name__}: {err}); the run is finished and saved") from err
    print(f"model written to {path}")


def finish(drv: Driver, module: ModuleType | None, ckpt: Path | str | None, signed: bool = False,
           status: int = 0) -> None:
    """The end of a command's run: its report, or where it paused (a run stopped by a signal has said so)."""
    if not drv.done and status >= 128:
        return
    if not drv.done:
        hint = f"; continue with `flowvm resume {ckpt}`" if ckpt is not None else ""
        if hint and signed:
            hint += f" (signed: give the key with --key or ${KEY_ENV})"
        print(f"paused at step {drv.steps}{hint}")
        return
    report = getattr(module, "report", None) if module is not None else None
    print(f"finished after {drv.steps} steps")
    print(report(drv.registers) if report is not None else registers_summary(drv.registers))


def runner_for(args, drv: Driver, meta: dict, ckpt: Path | str | None) -> Runner:
    """The Runner of a command's run, with the page watching it when ``--watch`` asks for one (watch.py; the
    port is taken, or refused, before the first step)."""
    watch = None
    if getattr(args, "watch", None) is not None:
        from .watch import Watch, parse_address

        watch = Watch(*parse_address(args.watch), paused=getattr(args, "paused", False)).start()
    return Runner(drv, meta.get("show", []), ckpt, args.every, args.every_seconds, meta, key_of(args),
                  args.progress, args.progress_every, getattr(args, "stop", None), args.history, args.tensorboard,
                  watch)


def start_program(args):
    """The target's module and a started driver of its program, built with the --set options and --data's
    path as a value (recorded as given), under the thread count asked for or the program's own:
    (module, driver, values, threads)."""
    from .targets import build_program

    values = {"data": str(Path(args.data).resolve())} if args.data is not None else {}
    module = load_module(args.target)
    threads = args.threads if args.threads is not None else getattr(module, "THREADS", None)
    set_threads(threads)
    module, program = build_program(args.target, args.set, values)
    drv = program.start()
    if args.threads is not None:  # instead of what the program declares (with_process_settings)
        drv.resume_with(settings={"torch.threads": args.threads})
    return module, drv, values, threads


def set_threads(threads: int | None) -> None:
    """torch's intra-op thread count (before anything runs), when torch is used and a count is asked for."""
    if threads is not None and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def module_of(meta: dict) -> ModuleType | None:
    """Import the saved run's program module first, so that its objects unpickle."""
    try:
        if meta.get("target"):
            return load_module(meta["target"])
        if meta.get("module"):
            return importlib.import_module(meta["module"])
    except (UsageError, ImportError) as err:
        reason = str(err)
        print(f"flowvm: warning: cannot load the run's program ({reason}); going on without its SHOW and "
              "report() (objects defined there may fail to load)", file=sys.stderr)
    return None
