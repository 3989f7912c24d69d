"""What the commands share: checkpoint locations and keys, refusing to overwrite a run, the Runner for a
checkpoint's format, the end of a run (its report, its model written with ``--output``), register summaries."""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from ..persist.location import Location
from ..persist.formats import MAGIC_BYTES
from ..machine.driver import Driver
from ..base.errors import UsageError, CheckpointError
from .targets import load_module
from .runner import Runner


KEY_ENV = "FLOWVM_CHECKPOINT_KEY"


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


def _shape(value: Any) -> tuple | None:
    """The shape of an array or tensor (not of the ndarray class itself), else None."""
    shape = None if isinstance(value, type) else getattr(value, "shape", None)
    try:
        return tuple(int(n) for n in shape) if shape is not None and not callable(shape) else None
    except (TypeError, ValueError):
        return None


def describe_value(value: Any) -> tuple[str, str]:
    """(type, detail) of a register value: shape and dtype for arrays, length for containers."""
    from ..program.printer import fmt

    kind = type(value).__name__
    shape = _shape(value)
    if shape is not None:
        dtype = str(getattr(value, "dtype", "")).replace("torch.", "")
        if shape == ():  # a scalar (a loss): its value
            try:
                scalar = value.detach() if hasattr(value, "detach") else value  # (torch warns on a graph's)
                return kind, f"{float(scalar):.6g} {dtype}".rstrip()
            except (TypeError, ValueError):
                pass
        return kind, f"shape {shape} {dtype}".rstrip()
    if isinstance(value, (list, tuple, dict)):
        inner = sorted({type(v).__name__ for v in (value.values() if isinstance(value, dict) else value)})
        what = f"{len(value)} item{'' if len(value) == 1 else 's'}" + (f" of {', '.join(inner[:3])}" if inner else "")
        if isinstance(value, dict):
            what += ": keys " + fmt(list(value)[:6], 50)
        return kind, what
    if isinstance(value, float):
        return kind, f"{value:.6g}"
    return kind, fmt(value, 60)


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def printable(text: str) -> str:
    """text with its control characters escaped (``\\x1b``, ``\\u202e``): a file's names and listing reach
    the terminal as text, never as escape sequences (line breaks and tabs are kept)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1] if m.group() != "\\" else m.group(), text)


def registers_summary(registers: dict) -> str:
    rows = []
    for name, value in registers.items():
        kind, detail = describe_value(value)
        rows.append(f"  {name:<16} {kind:<10} {detail}")
    return "registers:\n" + ("\n".join(rows) if rows else "  (none)")


# ------------------------------------------------------------------ commands
def key_of(args) -> str | None:
    return getattr(args, "key", None) or os.environ.get(KEY_ENV) or None


def trusted_header(args, path: Path | str) -> tuple[dict, str | None]:
    """The header of a saved run and the key to load it with, checked before anything is imported.

    A signed file is only read with its key (and stays signed); with a key the
    signature is checked first, since the header names the module to import.
    """
    key, read_header = key_of(args), Location.of(path).format.read_header
    header = read_header(path)
    if header.get("signed") and key is None:
        raise UsageError(f"{path} is signed: give its key with --key or ${KEY_ENV}")
    if key is not None:
        header = read_header(path, key=key)
    return header, key


def runner_for(args, drv: Driver, meta: dict, ckpt: Path | str | None) -> Runner:
    return Runner(drv, meta.get("show", []), ckpt, args.every, args.every_seconds, meta, key_of(args),
                args.progress, args.progress_every, getattr(args, "stop", None), args.history, args.tensorboard)


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


def checkpoint_location(text: str) -> Location:
    """A --checkpoint or resume/show argument, resolved once into the Location the command asks from then on
    (its format, whether a save can go there, what is there already: persist/location.py)."""
    return Location.of(text)


def check_checkpoint_path(loc: Location | None) -> None:
    """Refuse a --checkpoint that no save could go to, before the run starts: a directory, a missing
    directory; for a URL, a filesystem that is not installed, a bucket, or a store that does not answer (any
    problem but a missing object would fail every save: say so now, not after the first interval)."""
    if loc is None:
        return
    try:
        loc.check_target()
        if loc.url is not None:
            loc.read_start(MAGIC_BYTES, missing_ok=True)
    except CheckpointError as err:
        raise UsageError(f"--checkpoint {loc}: {err.reason}") from None


def refuse_to_overwrite(loc: Location | None, force: bool) -> None:
    """A run must not silently replace an unfinished run saved at its checkpoint place, nor a file that is
    no checkpoint of its format at all: the format says what is there (``Format.in_the_way``)."""
    if loc is None or force:
        return
    try:
        found = loc.format.in_the_way(loc)
    except CheckpointError as err:
        raise UsageError(f"--checkpoint {loc}: {err.reason}") from None
    if found is not None:
        what, text = found
        advice = (f"continue it with `flowvm resume {loc}`, or pass --force to start over" if what == "unfinished"
                  else "choose another --checkpoint path, or pass --force to replace it")
        raise UsageError(f"{text}; {advice}")


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
