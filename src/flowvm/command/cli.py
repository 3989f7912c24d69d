"""The flowvm command: run, resume, show, verify and list programs.

    flowvm run mlp --set optimizer=sgd --checkpoint run.ckpt --every 500
    flowvm resume run.ckpt
    flowvm show run.ckpt
    flowvm verify my_program.py
    flowvm list --options

A *program module* has ``build(**options)`` returning a program; optionally
``SHOW`` (register names shown while it runs), ``report(registers)`` (a
summary printed at the end) and ``THREADS`` (the torch intra-op threads it
runs best with; small models run fastest on one).  A target is a bundled program name (``pca``),
a module name (``mypkg.train``) or a path to a .py file.

Crash safety: with ``--checkpoint`` the run is saved atomically (temporary
file, fsync, rename; on an object store such as S3, an upload that completes
or leaves nothing) every ``--every`` steps or ``--every-seconds`` seconds
(every 60 s when neither is given), on SIGINT/SIGTERM, when a step raises,
at ``--max-steps`` and at the end.  A SIGKILL loses only the steps since the
last save, and ``flowvm resume`` continues bit for bit, saving as often as
the run was told to unless given a new interval.  ``--key`` signs
checkpoints; a signed file is only resumed or shown with its key.

A checkpoint path ending in ``.safetensors`` holds the run's state only, no code (flowvm.persist.state):
``run`` writes it with save_state, ``resume`` builds the program again from the target and ``--set`` options
the file records (or ``--program``/``--set`` given) and loads the state into it, ``show`` reads it without
importing anything (see the section "state checkpoints" below).

Checkpoint locations are local paths or fsspec URLs (``s3://bucket/run.ckpt``,
``memory://...``; see flowvm.persist.storage): a URL is kept as a str, since a Path
would collapse its ``//``, and is read and checked through flowvm.persist.storage.
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

from ..persist import checkpoint
from ..persist import storage
from ..persist import state
from ..machine.driver import Driver
from ..program.elements import Element
from ..base.errors import CheckpointError, FlowError
from .runner import DEFAULT_EVERY_SECONDS, Runner, Stop, StoppedDuringStartup, static_steps

KEY_ENV = "FLOWVM_CHECKPOINT_KEY"


# ------------------------------------------------------------------ targets
def load_module(target: str) -> ModuleType:
    """Import a program module from a bundled name, a module name or a .py path."""
    if target.endswith(".py") or os.sep in target or "/" in target:
        return _load_file(Path(target))
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # a module in the current directory, as `python -m` would find it
    for name in (f"flowvm.programs.{target}", target):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
                raise SystemExit(_missing(name, err)) from err
    raise SystemExit(f"flowvm: no program {target!r} (try `flowvm list`, a module name or a .py file)")


def _missing(program: str, err: ModuleNotFoundError) -> str:
    """The message for a program whose own imports fail."""
    hint = "pip install 'flowvm[torch]'" if err.name == "torch" else f"install the package that provides {err.name}"
    return f"flowvm: {program} needs the module {err.name!r}, which is not installed ({hint})"


def _load_file(path: Path) -> ModuleType:
    """A program file, imported under its file name so that its objects pickle by reference."""
    path = path.resolve()
    if not path.is_file():
        raise SystemExit(f"flowvm: no such program file: {path}")
    bundled = _bundled_path(path.stem)
    if bundled is not None and bundled == path:
        return importlib.import_module(f"flowvm.programs.{path.stem}")
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
            return loaded
        raise SystemExit(f"flowvm: cannot load {path}: a module named {name!r} is already imported from "
                         f"{getattr(loaded, '__file__', 'elsewhere')}; rename the file")
    directory = str(path.parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)  # so that the file's own imports of its neighbours work
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        del sys.modules[name]
        raise SystemExit(_missing(str(path), err)) from err
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _bundled_path(stem: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(f"flowvm.programs.{stem}")
    except ModuleNotFoundError:
        return None
    return Path(spec.origin).resolve() if spec is not None and spec.origin else None


def parse_sets(pairs: list[str], build) -> dict[str, Any]:
    """``name=value`` pairs as build() options; values are Python literals, else strings.

    A value must suit the option's default: an int option takes an int, a
    float option an int or a float, a str option any text (quoted or not:
    ``optimizer=sgd`` and ``optimizer="'sgd'"`` are the same).
    """
    every = inspect.signature(build).parameters
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = {n: p for n, p in every.items() if p.kind in kinds}  # the options, by name
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in every.values())  # build(**options)
    options = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"flowvm: --set expects name=value, got {pair!r}")
        if not name.isidentifier():
            raise SystemExit(f"flowvm: --set expects name=value with a Python name, got {pair!r}")
        if name not in params and not takes_any:
            raise SystemExit(f"flowvm: the program has no option {name!r}; options: {', '.join(params) or 'none'}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        default = params[name].default if name in params else None  # through **options: taken as written
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise SystemExit(f"flowvm: option {name!r} is True or False, got {text!r}")
        elif isinstance(default, int) and (isinstance(value, bool) or not isinstance(value, int)):
            raise SystemExit(f"flowvm: option {name!r} takes an int (default {default}), got {text!r}")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SystemExit(f"flowvm: option {name!r} takes a number (default {default}), got {text!r}")
            value = float(value)
        elif isinstance(default, str):
            value = value if isinstance(value, str) else text  # 'adam' (a quoted literal) or adam
        options[name] = value
    return options


def build_program(target: str, sets: list[str]):
    module = load_module(target)
    if not callable(getattr(module, "build", None)):
        raise SystemExit(f"flowvm: {module.__name__} has no build() function")
    options = parse_sets(sets, module.build)
    try:
        program = module.build(**options)
    except (TypeError, ValueError) as err:
        where = getattr(module, "__file__", None) or module.__name__
        given = " ".join(f"--set {s}" for s in sets) or "its defaults"
        raise SystemExit(f"flowvm: build() in {where} rejected {given}: {type(err).__name__}: {err}") from err
    if not isinstance(program, Element):
        where = getattr(module, "__file__", None) or module.__name__
        raise SystemExit(f"flowvm: build() in {where} returned {type(program).__name__} {program!r:.60}, "
                         "not a flowvm program (an element such as SEQ([...]))")
    return module, program


def _check_output(path: str | None) -> None:
    from ..programs import MODEL_SUFFIXES

    if path is not None and Path(path).suffix.lower() not in MODEL_SUFFIXES:
        raise SystemExit(f"flowvm: --output {path}: give a file ending in {', '.join(MODEL_SUFFIXES)}")


def _write_model(drv: Driver, module: ModuleType | None, path: str | None) -> None:
    """--output: the finished run's model (its module's model(registers)) written to path."""
    if path is None or not drv.done:
        return
    model_of = getattr(module, "model", None) if module is not None else None
    if model_of is None:
        raise SystemExit(f"flowvm: --output {path}: the program gives no model (its module has no "
                         "model(registers) function)")
    from ..programs import save_model

    save_model(model_of(drv.registers), path)
    print(f"model written to {path}")


def _finish(drv: Driver, module: ModuleType | None, ckpt: Path | str | None, signed: bool = False) -> None:
    if not drv.done:
        hint = f"; continue with `flowvm resume {ckpt}`" if ckpt is not None else ""
        if hint and signed:
            hint += f" (signed: give the key with --key or ${KEY_ENV})"
        print(f"paused at step {drv.steps}{hint}")
        return
    report = getattr(module, "report", None) if module is not None else None
    print(f"finished after {drv.steps} steps")
    print(report(drv.registers) if report is not None else registers_summary(drv.registers))


def describe_value(value: Any) -> tuple[str, str]:
    """(type, detail) of a register value: shape and dtype for arrays, length for containers."""
    from ..program.printer import fmt

    kind = type(value).__name__
    shape = None if isinstance(value, type) else getattr(value, "shape", None)  # not the ndarray class itself
    try:
        shape = tuple(int(n) for n in shape) if shape is not None and not callable(shape) else None
    except (TypeError, ValueError):
        shape = None
    if shape is not None:
        dtype = str(getattr(value, "dtype", "")).replace("torch.", "")
        if shape == ():  # a scalar (a loss): its value
            try:
                return kind, f"{float(value):.6g} {dtype}".rstrip()
            except (TypeError, ValueError):
                pass
        return kind, f"shape {shape} {dtype}".rstrip()
    if isinstance(value, (list, tuple, dict)):
        inner = sorted({type(v).__name__ for v in (value.values() if isinstance(value, dict) else value)})
        what = f"{len(value)} items" + (f" of {', '.join(inner[:3])}" if inner else "")
        if isinstance(value, dict):
            what += ": keys " + fmt(list(value)[:6], 50)
        return kind, what
    if isinstance(value, float):
        return kind, f"{value:.6g}"
    return kind, fmt(value, 60)


def registers_summary(registers: dict) -> str:
    rows = []
    for name, value in registers.items():
        kind, detail = describe_value(value)
        rows.append(f"  {name:<16} {kind:<10} {detail}")
    return "registers:\n" + ("\n".join(rows) if rows else "  (none)")


# ------------------------------------------------------------------ commands
def _key(args) -> str | None:
    return getattr(args, "key", None) or os.environ.get(KEY_ENV) or None


def _trusted_header(args, path: Path | str) -> tuple[dict, str | None]:
    """The header of a saved run and the key to load it with, checked before anything is imported.

    A signed file is only read with its key (and stays signed); with a key the
    signature is checked first, since the header names the module to import.
    """
    key = _key(args)
    header = checkpoint.read_header(path)
    if header.get("signed") and key is None:
        raise SystemExit(f"flowvm: {path} is signed: give its key with --key or ${KEY_ENV}")
    if key is not None:
        header = checkpoint.read_header(path, key=key)
    return header, key


def _runner(args, drv: Driver, meta: dict, ckpt: Path | str | None) -> Runner:
    kind = StateRunner if is_state(ckpt) else Runner
    return kind(drv, meta.get("show", []), ckpt, args.every, args.every_seconds, meta, _key(args),
                args.progress, args.progress_every, getattr(args, "stop", None), args.history, args.tensorboard)


def set_threads(threads: int | None) -> None:
    """torch's intra-op thread count (before anything runs), when torch is used and a count is asked for."""
    if threads is not None and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def checkpoint_location(text: str) -> Path | str:
    """A --checkpoint or resume/show argument: a URL stays a str (a Path would collapse its ``//``); a
    ``file://`` URL and a plain path become a Path."""
    return text if storage.is_url(text) else storage.local_path(text)


def _check_checkpoint_path(path: Path | str | None) -> None:
    if isinstance(path, str):
        # A URL: its filesystem is installed, it names an object, and the store answers.  Any problem but a
        # missing object (no bucket, access denied, no credentials, an unreachable store) would fail every
        # save: say so now, not after the first interval.
        try:
            storage.check_target(path)
            storage.read_start(path, len(checkpoint.MAGIC), missing_ok=True)
        except CheckpointError as err:
            raise SystemExit(f"flowvm: --checkpoint {path}: {err.reason}") from None
        return
    if path is not None:
        if path.is_dir():
            raise SystemExit(f"flowvm: --checkpoint {path} is a directory; give a file name")
        if not path.parent.resolve().is_dir():
            raise SystemExit(f"flowvm: --checkpoint {path}: no directory {path.parent}")


def _refuse_to_overwrite(path: Path | str | None, force: bool) -> None:
    """A run must not silently replace an unfinished run saved at its checkpoint path, nor a file that is
    no checkpoint at all."""
    if path is None or force:
        return
    if is_state(path):
        return _refuse_to_overwrite_state(path)
    if isinstance(path, str):  # a URL: read through the store (_check_checkpoint_path named its problems)
        try:
            start = storage.read_start(path, len(checkpoint.MAGIC), missing_ok=True)
        except CheckpointError as err:
            raise SystemExit(f"flowvm: --checkpoint {path}: {err.reason}") from None
        if start is None:
            return
    else:
        if not path.exists():
            return
        try:
            with open(path, "rb") as f:
                start = f.read(len(checkpoint.MAGIC))
        except OSError:
            return  # a directory or an unreadable path: saving names the problem
    if start and not checkpoint.MAGIC.startswith(start[:len(checkpoint.MAGIC)]):
        raise SystemExit(f"flowvm: {path} exists and is not a flowvm checkpoint; choose another --checkpoint "
                         "path, or pass --force to replace it")
    try:
        header = checkpoint.read_header(path)
    except CheckpointError:
        return  # a damaged checkpoint: nothing to lose
    if not header.get("done"):
        target = (header.get("meta") or {}).get("target") or header.get("program")
        raise SystemExit(f"flowvm: {path} holds an unfinished run ({target}, step {header.get('steps')}); "
                         f"continue it with `flowvm resume {path}`, or pass --force to start over")


def cmd_run(args) -> int:
    _check_checkpoint_path(args.checkpoint)
    _refuse_to_overwrite(args.checkpoint, args.force)
    _check_output(args.output)
    if args.data is not None:  # an option like the others, so that it is recorded with them
        args.set.append(f"data={str(Path(args.data).resolve())!r}")
    module = load_module(args.target)
    threads = args.threads if args.threads is not None else getattr(module, "THREADS", None)
    set_threads(threads)
    module, program = build_program(args.target, args.set)
    drv = program.start()
    if args.threads is not None:  # instead of what the program declares (with_process_settings)
        drv.resume_with(settings={"torch.threads": args.threads})
    if is_state(args.checkpoint):
        state.collect(drv, args.checkpoint)  # a program whose state a file cannot hold is refused before it runs
    target = args.target
    if target.endswith(".py") or os.sep in target or "/" in target:
        target = str(Path(target).resolve())  # so that `flowvm resume` finds it from any directory
    meta = {"target": target, "module": module.__name__, "sets": list(args.set),
            "show": list(getattr(module, "SHOW", [])), "threads": threads,
            "every": args.every, "every_seconds": args.every_seconds}
    status = _runner(args, drv, meta, args.checkpoint).run(args.max_steps)
    _finish(drv, module, args.checkpoint, _key(args) is not None)
    _write_model(drv, module, args.output)
    return status


def _module_of(meta: dict) -> ModuleType | None:
    """Import the saved run's program module first, so that its objects unpickle."""
    try:
        if meta.get("target"):
            return load_module(meta["target"])
        if meta.get("module"):
            return importlib.import_module(meta["module"])
    except (SystemExit, ImportError) as err:
        reason = str(err.code if isinstance(err, SystemExit) else err).removeprefix("flowvm: ")
        print(f"flowvm: warning: cannot load the run's program ({reason}); going on without its SHOW and "
              "report() (objects defined there may fail to load)", file=sys.stderr)
    return None


def cmd_resume(args) -> int:
    if is_state(args.path):
        return cmd_resume_state(args)
    if args.program is not None or args.set:
        raise SystemExit("flowvm: --program and --set resume state checkpoints (.safetensors) only")
    _check_checkpoint_path(args.checkpoint)
    header, key = _trusted_header(args, args.path)
    meta = header.get("meta") or {}
    module = _module_of(meta)
    if meta.get("executor") == "dask":  # a sweep's trials ran on a Dask cluster: one again, under that name
        _start_dask()
    set_threads(args.threads)
    if args.every is None and args.every_seconds is None:  # keep saving as the run was told to
        args.every, args.every_seconds = meta.get("every"), meta.get("every_seconds")
    else:
        meta = dict(meta, every=args.every, every_seconds=args.every_seconds)
    drv = checkpoint.load(args.path, key=key, restore_settings=not args.keep_settings)
    if args.threads is not None:
        drv.resume_with(settings={"torch.threads": args.threads})
    target = args.checkpoint if args.checkpoint is not None else args.path
    _check_output(args.output)
    status = _runner(args, drv, meta, target).run(args.max_steps)
    _finish(drv, None if meta.get("search") else module, target, key is not None)
    if meta.get("search") and drv.done:
        print(module.search_report(drv.registers))
    _write_model(drv, module, args.output)
    return status


def cmd_show(args) -> int:
    if is_state(args.path):
        return cmd_show_state(args)
    header, key = _trusted_header(args, args.path)
    meta = header.get("meta") or {}
    _module_of(meta)
    drv = checkpoint.load(args.path, key=key, restore_random=False)
    what = f" {meta['target']}" + "".join(f" --set {s}" for s in meta.get("sets", [])) + "," \
        if meta.get("target") else ""
    print(f"# {args.path}:{what} written by flowvm {header['flowvm']} (Python {header['python']}) "
          f"at {header['created']}")
    print(drv)  # the listing, headed by the step count and marked at the position
    print(registers_summary(drv.registers))
    return 0


# ------------------------------------------------------------------ state checkpoints (.safetensors)
def is_state(path: Path | str | None) -> bool:
    """Whether a checkpoint location holds a state checkpoint (its suffix chooses the format)."""
    return path is not None and str(path).endswith(state.SUFFIX)


class StateRunner(Runner):
    """A Runner whose checkpoints are state files (save_state)."""

    def save(self) -> None:
        if self.ckpt is not None:
            state.save_state(self.drv, self.ckpt, key=self.key, meta=self.meta)
            self.saved_step, self.saved_time = self.drv.steps, time.monotonic()


def _refuse_to_overwrite_state(path: Path | str) -> None:
    """As _refuse_to_overwrite, for a state file: replace only a finished run or a damaged flowvm state file."""
    try:
        header = state.read_state_header(path)
    except CheckpointError as err:
        if err.reason in ("no such file", "no such object"):
            return
        if not err.reason.startswith(("corrupted", "refused")):  # not recognizably a flowvm state file
            raise SystemExit(f"flowvm: {path} exists and is not a flowvm state checkpoint ({err.reason}); choose "
                             "another --checkpoint path, or pass --force to replace it") from None
        return
    if not header.get("done"):
        target = (header.get("meta") or {}).get("target") or header.get("program")
        raise SystemExit(f"flowvm: {path} holds an unfinished run ({target}, step {header.get('steps')}); "
                         f"continue it with `flowvm resume {path}`, or pass --force to start over")


def _state_header(args) -> tuple[dict, str | None]:
    """The checked header of a state file and the key to load it with (a signed file needs its key)."""
    key = _key(args)
    header = state.read_state_header(args.path)
    if header.get("signed") and key is None:
        raise SystemExit(f"flowvm: {args.path} is signed: give its key with --key or ${KEY_ENV}")
    if key is not None:
        header = state.read_state_header(args.path, key=key)
    return header, key


def cmd_resume_state(args) -> int:
    """Build the program again (the recorded target and options, or --program; --set adds options) and
    load the saved state into it."""
    _check_checkpoint_path(args.checkpoint)
    header, key = _state_header(args)
    meta = dict(header.get("meta") or {})
    target = args.program or meta.get("target")
    if not target:
        raise SystemExit(f"flowvm: {args.path} does not record which program it ran; give it with --program TARGET")
    if args.program is not None and (target.endswith(".py") or os.sep in target or "/" in target):
        target = str(Path(target).resolve())  # as run records it: found again from any directory
    sets = (list(meta.get("sets", [])) if args.program is None else []) + list(args.set)
    module, program = build_program(target, sets)
    set_threads(args.threads)
    if args.every is None and args.every_seconds is None:  # keep saving as the run was told to
        args.every, args.every_seconds = meta.get("every"), meta.get("every_seconds")
    meta.update(target=target, module=module.__name__, sets=sets, every=args.every, every_seconds=args.every_seconds,
                show=list(getattr(module, "SHOW", meta.get("show", []))))
    classes = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]
    drv = state.load_state(args.path, program, key=key, restore_settings=not args.keep_settings,
                           classes=classes)  # the program module's own classes: results its run made
    if args.threads is not None:
        drv.resume_with(settings={"torch.threads": args.threads})
    ckpt = args.checkpoint if args.checkpoint is not None else args.path
    _check_output(args.output)
    status = _runner(args, drv, meta, ckpt).run(args.max_steps)
    _finish(drv, module, ckpt, key is not None)
    _write_model(drv, module, args.output)
    return status


def cmd_show_state(args) -> int:
    """Print a state file's run: its saved listing with the position, and its registers; imports nothing."""
    _, key = _state_header(args)
    header, listing, registers = state.show_state(args.path, key=key)
    meta = header.get("meta") or {}
    what = f" {meta['target']}" + "".join(f" --set {s}" for s in meta.get("sets", [])) + "," \
        if meta.get("target") else ""
    print(f"# {args.path}:{what} state checkpoint written by flowvm {header['flowvm']} (Python {header['python']}) "
          f"at {header['created']}")
    print(listing)
    print(registers_summary(registers))
    return 0


def _start_dask() -> Any:
    """A Dask cluster on this machine (a worker process per core), registered as the executor "dask"."""
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise SystemExit("flowvm: --executor dask needs dask.distributed (pip install 'flowvm[dask]')") from None
    from .. import register_executor

    client = Client(LocalCluster(n_workers=os.cpu_count() or 1, threads_per_worker=1, processes=True,
                                 dashboard_address=None))
    register_executor("dask", client)
    return client


def cmd_sweep(args) -> int:
    """A random search over a program's options, each trial a SPAWN; the best trial's model is kept."""
    from ..programs import sweep

    _check_checkpoint_path(args.checkpoint)
    _refuse_to_overwrite(args.checkpoint, args.force)
    _check_output(args.output)
    if is_state(args.checkpoint):
        raise SystemExit("flowvm: a sweep saves pickle checkpoints (.ckpt): its trials' results hold models")
    module = load_module(args.target)
    fixed = parse_sets(args.set, module.build)
    if args.data is not None:
        fixed["data"] = str(Path(args.data).resolve())
    if args.executor not in (None, "dask"):
        raise SystemExit("flowvm: --executor takes dask (a cluster on this machine); the default is a local pool")
    if args.executor == "dask":
        _start_dask()
    try:
        program = sweep.search(module.__name__.removeprefix("flowvm.programs."), args.space, args.trials, args.metric,
                               args.minimize, fixed, args.executor, args.seed)
    except (ValueError, TypeError, ImportError) as err:
        raise SystemExit(f"flowvm: sweep: {err}") from err
    drv = program.start()
    meta = {"target": "sweep", "module": sweep.__name__, "search": {"program": args.target, "space": args.space,
            "metric": args.metric, "minimize": args.minimize, "sets": list(args.set), "trials": args.trials},
            "executor": args.executor, "show": ["best_metric"], "every": args.every,
            "every_seconds": args.every_seconds}
    status = _runner(args, drv, meta, args.checkpoint).run(args.max_steps)
    _finish(drv, None, args.checkpoint, _key(args) is not None)
    if drv.done:
        print(sweep.search_report(drv.registers))
    _write_model(drv, sweep, args.output)
    return status


def cmd_plot(args) -> int:
    """Draw the history a run recorded (read from the checkpoint's header: nothing is unpickled)."""
    from .history import plot_history

    key = _key(args)
    header = state.read_state_header(args.path, key) if is_state(args.path) else checkpoint.read_header(args.path, key)
    meta = header.get("meta") or {}
    history = meta.get("history") or {}
    names = args.names or [n for n in history.get("names", []) if history.get("points", {}).get(n)]
    if not names:
        raise SystemExit(f"flowvm: {args.path} holds no history (runs of the flowvm command record their SHOW "
                         "registers, and those named with --history)")
    target = meta.get("target", "")
    plot_history(history, names, args.output, title=f"{Path(str(target)).stem or target} ({args.path})")
    print(f"wrote {args.output}: {', '.join(names)} over {header.get('steps')} steps")
    return 0


def cmd_verify(args) -> int:
    from ..program.verify import verify

    _, program = build_program(args.target, args.set)
    verify(program)
    print(program)
    total = static_steps(program)
    print(f"# {args.target}: verified" + (f"; it takes {total} steps" if total is not None else ""))
    return 0


def bundled_programs() -> list[tuple[str, str, str]]:
    """(name, first docstring line, build options) of each bundled program, read without importing it."""
    from .. import programs

    out = []
    for info in sorted(pkgutil.iter_modules(programs.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        spec = importlib.util.find_spec(f"flowvm.programs.{info.name}")
        tree = ast.parse(Path(spec.origin).read_text())
        build = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build"), None)
        if build is None:
            continue
        args = build.args.args[-len(build.args.defaults):] if build.args.defaults else []
        options = " ".join(f"{a.arg}={ast.unparse(d)}" for a, d in zip(args, build.args.defaults))
        doc = (ast.get_docstring(tree) or "").strip().splitlines()
        out.append((info.name, doc[0] if doc else "", options))
    return out


def cmd_list(args) -> int:
    found = bundled_programs()
    width = max([10] + [len(name) for name, _, _ in found])
    for name, doc, options in found:
        print(f"{name:<{width}} {doc}")
        if args.options:
            print(f"{'':<{width}} options: {options}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowvm", description="Run learning algorithms written as flowvm programs.")
    sub = p.add_subparsers(dest="command", required=True)

    def running(sp):
        sp.add_argument("--history", action="append", default=[], metavar="NAME",
                        help="also record this register's history (the program's SHOW registers always are)")
        sp.add_argument("--tensorboard", metavar="DIR", help="write the history as TensorBoard scalars to DIR")
        sp.add_argument("--output", metavar="PATH", help="when the run finishes, write its fitted model (the "
                        "program's model(registers)): .npz (its attributes by name), .pt or .safetensors")
        sp.add_argument("--checkpoint", type=checkpoint_location,
                        help="save the run to this file or fsspec URL (s3://bucket/key), atomically")
        sp.add_argument("--every", type=int, metavar="N", help="save every N steps")
        sp.add_argument("--every-seconds", type=float, metavar="S",
                        help=f"save every S seconds (default {DEFAULT_EVERY_SECONDS:g} with --checkpoint and "
                             "no --every)")
        sp.add_argument("--max-steps", type=int, metavar="N", help="pause (and save) after N more steps")
        sp.add_argument("--key", help=f"sign checkpoints with this key and require it on load "
                                      f"(default: ${KEY_ENV})")
        sp.add_argument("--progress", choices=["auto", "bar", "lines", "none"], default="auto",
                        help="a progress bar on a terminal, plain lines otherwise (auto)")
        sp.add_argument("--progress-every", type=float, default=2.0, metavar="S",
                        help="seconds between plain progress lines (default 2)")
        sp.add_argument("--threads", type=int, metavar="N",
                        help="torch intra-op threads (default: what the program declares, else torch's own; "
                             "on resume: what the run was saved with)")

    run = sub.add_parser("run", help="run a program")
    run.add_argument("target", help="bundled program name, module name or .py file")
    run.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a build() option")
    run.add_argument("--data", metavar="PATH", help="the program's data: a .npy, .npz or .csv file (build(data=...))")
    run.add_argument("--force", action="store_true",
                     help="start over even if --checkpoint holds an unfinished run (which is replaced)")
    running(run)
    run.set_defaults(func=cmd_run)

    resume = sub.add_parser("resume", help="continue a saved run")
    resume.add_argument("path", type=checkpoint_location, help="a checkpoint file or fsspec URL")
    resume.add_argument("--program", metavar="TARGET",
                        help="state checkpoints: resume into this program (bundled name, module or .py file) "
                             "instead of the one the file records")
    resume.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="state checkpoints: a build() option, over those the file records (a new setting)")
    resume.add_argument("--keep-settings", action="store_true",
                        help="keep this process's settings (torch threads, deterministic algorithms, ...) "
                             "instead of those the run was saved with")
    running(resume)
    resume.set_defaults(func=cmd_resume)

    show = sub.add_parser("show", help="print a saved run: program, position, registers")
    show.add_argument("path", type=checkpoint_location, help="a checkpoint file or fsspec URL")
    show.add_argument("--key")
    show.set_defaults(func=cmd_show)

    verify = sub.add_parser("verify", help="check a program")
    verify.add_argument("target")
    verify.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    verify.set_defaults(func=cmd_verify)

    sweep = sub.add_parser("sweep", help="random search over a program's options, trials in parallel")
    sweep.add_argument("target", help="bundled program name or module name")
    sweep.add_argument("--trials", type=int, default=8, help="configurations to try (default 8)")
    sweep.add_argument("--space", action="append", default=[], metavar="NAME=KIND:ARGS", required=True,
                       help="a searched option: loguniform:LOW:HIGH, uniform:LOW:HIGH, int:LOW:HIGH or choice:A,B")
    sweep.add_argument("--metric", default="accuracy", help="the register trials are ranked by (default accuracy)")
    sweep.add_argument("--minimize", action="store_true", help="the lowest metric wins (default: the highest)")
    sweep.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a fixed build() option")
    sweep.add_argument("--data", metavar="PATH", help="the program's data (a fixed data= option)")
    sweep.add_argument("--executor", help="dask: run the trials on a Dask cluster on this machine")
    sweep.add_argument("--seed", type=int, default=0, help="seed of the configurations' draws")
    sweep.add_argument("--force", action="store_true", help="replace an unfinished run saved at --checkpoint")
    running(sweep)
    sweep.set_defaults(func=cmd_sweep)

    plot = sub.add_parser("plot", help="draw the history of a saved run's metrics")
    plot.add_argument("path", type=checkpoint_location, help="a checkpoint file or fsspec URL")
    plot.add_argument("names", nargs="*", metavar="NAME", help="metrics to draw (default: every one recorded)")
    plot.add_argument("-o", "--output", default="curves.png", metavar="FILE", help="the picture (default curves.png)")
    plot.add_argument("--key", help="the key of a signed checkpoint (or $FLOWVM_CHECKPOINT_KEY)")
    plot.set_defaults(func=cmd_plot)

    lst = sub.add_parser("list", help="list the bundled programs")
    lst.add_argument("--options", action="store_true", help="also print each program's build() options")
    lst.set_defaults(func=cmd_list)
    return p


def main(argv: list[str] | None = None, early_signals: list[int] | None = None) -> int:
    """The flowvm command.  From its first line SIGINT and SIGTERM stop a run at a step boundary, save it
    and say so (early_signals: those the entry point, flowvm_cli, saw while flowvm was being imported)."""
    with Stop(early_signals) as stop:
        try:
            if stop.signal is not None:
                raise StoppedDuringStartup(stop.signal)
            args = parser().parse_args(argv)
        except StoppedDuringStartup as stopped:
            return _stopped_during_startup(stopped.signum)
        args.stop = stop
        if args.command not in ("run", "resume", "sweep"):  # nothing to stop at a step boundary
            stop.restore()
        for name in ("every", "max_steps", "threads"):
            value = getattr(args, name, None)
            least = 0 if name == "max_steps" else 1
            if value is not None and value < least:
                raise SystemExit(f"flowvm: --{name.replace('_', '-')} must be >= {least}")
        if getattr(args, "every_seconds", None) is not None and not args.every_seconds > 0:
            raise SystemExit("flowvm: --every-seconds must be > 0")
        if args.command == "run" and args.checkpoint is None and (args.every or args.every_seconds):
            raise SystemExit("flowvm: --every and --every-seconds need --checkpoint PATH (where to save)")
        try:
            return args.func(args)
        except StoppedDuringStartup as stopped:
            return _stopped_during_startup(stopped.signum)
        except (CheckpointError, FlowError) as err:
            print(f"flowvm: {err}", file=sys.stderr)
            return 2
        except BrokenPipeError:  # `flowvm show run.ckpt | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        except KeyboardInterrupt as err:  # raised by the program, or a second Ctrl-C
            notes = "".join(f"\n{note}" for note in getattr(err, "__notes__", ()))
            print(f"flowvm: interrupted (KeyboardInterrupt){notes}", file=sys.stderr)
            return 128 + signal.SIGINT
        except SystemExit as err:  # the program called sys.exit(): exit as it asked, once saved
            for note in getattr(err, "__notes__", ()):
                print(note, file=sys.stderr)
            raise


def _stopped_during_startup(signum: int) -> int:
    print(f"flowvm: stopped by {signal.Signals(signum).name} during start-up, before the run's first step "
          "(nothing ran; no checkpoint written or changed)", file=sys.stderr)
    return 128 + signum
