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

Checkpoint places are local paths or fsspec URLs (``s3://bucket/run.ckpt``, ``memory://...``; see
flowvm.persist.storage).  The parser resolves each into a ``Location`` once (persist/location.py), about which
the commands ask from then on the format registry (what resume and show do, ``RESUME``/``SHOW``; what of a
file already there must not be replaced), the storage (whether a save can go there) and the lock.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
import os
import signal
import sys

from ..persist.formats import PICKLE, format_of
from ..base.errors import UsageError, CheckpointError, FlowError, StoppedDuringStartup
from ..base.tracebacks import format_user_error
from .targets import build_program, bundled_programs, recorded
from .places import KEY_ENV, check_checkpoint_path, checkpoint_location, key_of, refuse_to_overwrite, trusted_header
from .runs import check_model, check_output, finish, module_of, runner_for, saving_as_recorded, set_threads, start_program, write_model
from .values import registers_summary
from .runner import DEFAULT_EVERY_SECONDS, Stop, static_steps
from .state_commands import cmd_resume_state, cmd_show_checkpoint, cmd_show_state
from .sweeps import cmd_plot, cmd_sweep, start_dask
from . import launch, outputs


def cmd_run(args) -> int:
    if launch.wanted(args) and args.watch is not None:
        raise UsageError("--watch watches a run of one process; a data-parallel run (--nproc, --nnodes) has none")
    if launch.wanted(args):  # data-parallel: launch the ranks, or be one (docs/distributed.md)
        return launch.cmd_run(args)
    check_checkpoint_path(args.checkpoint)
    refuse_to_overwrite(args.checkpoint, args.force)
    check_output(args.output)
    module, drv, values, threads = start_program(args)
    check_model(module, args.output)  # before the first step, not after the run
    if args.checkpoint is not None:  # a run the format cannot hold (a function in a state file) is refused now
        format_of(args.checkpoint).check(drv, args.checkpoint)
    target = recorded(args.target)  # so that `flowvm resume` finds it from any directory
    meta = {"target": target, "module": module.__name__, "sets": list(args.set), **values,
            "show": list(getattr(module, "SHOW", [])), "threads": threads,
            "every": args.every, "every_seconds": args.every_seconds}
    meta = outputs.record(args, meta)
    status = runner_for(args, drv, meta, args.checkpoint).run(args.max_steps)
    finish(drv, module, args.checkpoint, key_of(args) is not None, status)
    write_model(drv, module, args.output)
    return status


def cmd_resume(args) -> int:
    if launch.wanted(args):
        if args.watch is not None:
            raise UsageError("--watch watches a run of one process; a data-parallel run's checkpoint has several")
        return launch.cmd_resume(args)
    return RESUME[format_of(args.path).name](args)


def cmd_resume_pickle(args) -> int:
    if args.program is not None or args.set:
        raise UsageError("--program and --set resume state checkpoints (.safetensors) only")
    check_checkpoint_path(args.checkpoint)
    header, key = trusted_header(args, args.path)
    meta = header.get("meta") or {}
    module = module_of(meta)
    if meta.get("executor") == "dask":  # a sweep's trials ran on a Dask cluster: one again, under that name
        start_dask(meta.get("scheduler"), meta.get("versions") or "error")
    set_threads(args.threads if args.threads is not None else meta.get("threads"))  # as the run had it
    meta = saving_as_recorded(args, meta)
    drv = PICKLE.load(args.path, key=key, restore_settings=not args.keep_settings)
    if args.threads is not None:
        drv.resume_with(settings={"torch.threads": args.threads})
    target = args.checkpoint if args.checkpoint is not None else args.path
    meta = outputs.resume(args, meta)  # --tensorboard, --output: where the run wrote, unless given anew
    check_output(args.output)
    check_model(None if meta.get("search") else module, args.output)
    status = runner_for(args, drv, meta, target).run(args.max_steps)
    finish(drv, None if meta.get("search") else module, target, key is not None, status)
    if meta.get("search") and drv.done:
        print(module.search_report(drv.registers))
    write_model(drv, module, args.output)
    return status


def cmd_show(args) -> int:
    launch.complete_step(args)  # a data-parallel run's folder: its complete step
    return SHOW[format_of(args.path).name](args)


# What resume and show do, by the format of the file given (persist/formats.py): a pickle checkpoint holds the
# program; a state file's program is built again from the target and options it records
RESUME = {"pickle": cmd_resume_pickle, "state": cmd_resume_state}
SHOW = {"pickle": cmd_show_checkpoint, "state": cmd_show_state}


def cmd_verify(args) -> int:
    from ..program.verify import verify

    _, program = build_program(args.target, args.set)
    verify(program)
    print(program)
    total = static_steps(program)
    print(f"# {args.target}: verified" + (f"; it takes {total} steps" if total is not None else ""))
    return 0


def cmd_optimize(args) -> int:
    """Print the program after flowvm.optimize, and with --explain why each run of torch CALLs was fused or
    not (flowvm.passes.explain)."""
    from ..passes.registry import optimize

    _, program = build_program(args.target, args.set)
    fast = optimize(program)
    print(fast)
    if args.explain:
        from ..passes.explain import explain_fusion

        print("\n# why (fuse-torch):")
        print(explain_fusion(program))
    return 0


def cmd_list(args) -> int:
    found = bundled_programs()
    width = max([10] + [len(name) for name, _, _ in found])
    for name, doc, options in found:
        print(f"{name:<{width}} {doc}")
        if args.options:
            print(f"{'':<{width}} options: {options}")
    return 0


TARGET_HELP = "the program: a bundled program's name (flowvm list), a module name (mypkg.train) or a .py file"
SET_HELP = ("a build() option, NAME=VALUE with VALUE a Python literal (--set epochs=5 --set optimizer=sgd); "
            "repeatable")


def parser() -> argparse.ArgumentParser:
    from ..base.version import __version__

    p = argparse.ArgumentParser(prog="flowvm", description="Run learning algorithms written as flowvm programs.")
    p.add_argument("--version", action="version", version=f"flowvm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_run_parser, _resume_parser, _watch_parser, _show_parser, _verify_parser, _sweep_parser, _plot_parser,
                _list_parser):
        add(sub)
    return p


def running(sp) -> None:
    """The options of the commands that run: run, resume, sweep."""
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
    sp.add_argument("--watch", metavar="[HOST:]PORT",
                    help="serve a live page of the run, with its controls, at this address (127.0.0.1 unless a "
                         "host is given; elsewhere the URL carries a token); needs flowvm[watch]")
    sp.add_argument("--threads", type=int, metavar="N",
                    help="torch intra-op threads (default: what the program declares, else torch's own; "
                         "on resume: what the run was saved with)")


def _run_parser(sub) -> None:
    run = sub.add_parser("run", help="run a program")
    run.add_argument("target", help=TARGET_HELP)
    run.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help=SET_HELP)
    run.add_argument("--data", metavar="PATH", help="the program's data: a .npy, .npz or .csv file (build(data=...))")
    run.add_argument("--force", action="store_true",
                     help="start over even if --checkpoint holds an unfinished run (which is replaced)")
    running(run)
    launch.add_options(run)
    run.set_defaults(func=cmd_run)


def _resume_parser(sub) -> None:
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
    launch.add_options(resume)
    resume.set_defaults(func=cmd_resume)


def cmd_watch(args) -> int:
    """``flowvm watch CHECKPOINT``: the saved run, paused, in a live page (its controls run, step, fork it)."""
    args.paused = True
    return cmd_resume(args)


def _watch_parser(sub) -> None:
    watch = sub.add_parser("watch", help="open a saved run in a live page, paused: run it, step it, fork it")
    watch.add_argument("path", type=checkpoint_location, help="a checkpoint file or fsspec URL")
    watch.add_argument("--keep-settings", action="store_true", help="as for resume")
    running(watch)
    launch.add_options(watch)
    watch.set_defaults(func=cmd_watch, program=None, set=[], watch="127.0.0.1:8765")


def _show_parser(sub) -> None:
    show = sub.add_parser("show", help="print a saved run: program, position, registers")
    show.add_argument("path", type=checkpoint_location, help="a checkpoint file or fsspec URL")
    show.add_argument("--key", help="the key of a signed checkpoint (default: $FLOWVM_CHECKPOINT_KEY)")
    show.add_argument("--trust", action="store_true",
                      help="pickle checkpoints: load an unsigned file to show its registers (runs code the file "
                           "chooses: only for files from a source you trust)")
    show.set_defaults(func=cmd_show)


def _verify_parser(sub) -> None:
    verify = sub.add_parser("verify", help="check a program without running it, and print it")
    verify.add_argument("target", help=TARGET_HELP)
    verify.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help=SET_HELP)
    verify.set_defaults(func=cmd_verify)
    optimize = sub.add_parser("optimize", help="print a program as flowvm.optimize rewrites it (fused torch steps)")
    optimize.add_argument("target", help=TARGET_HELP)
    optimize.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help=SET_HELP)
    optimize.add_argument("--explain", action="store_true",
                          help="say for each SEQ why its CALLs were fused into one step, or why not")
    optimize.set_defaults(func=cmd_optimize)


def _sweep_parser(sub) -> None:
    sweep = sub.add_parser("sweep", help="random search over a program's options, trials in parallel")
    sweep.add_argument("target", help=TARGET_HELP)
    sweep.add_argument("--trials", type=int, default=8, help="configurations to try (default 8)")
    sweep.add_argument("--space", action="append", default=[], metavar="NAME=KIND:ARGS", required=True,
                       help="a searched option: loguniform:LOW:HIGH, uniform:LOW:HIGH, int:LOW:HIGH or choice:A,B")
    sweep.add_argument("--metric", default="accuracy", help="the register trials are ranked by (default accuracy)")
    sweep.add_argument("--minimize", action="store_true", help="the lowest metric wins (default: the highest)")
    sweep.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                       help="a build() option every trial gets (NAME=VALUE, VALUE a Python literal); repeatable")
    sweep.add_argument("--data", metavar="PATH", help="the program's data (a fixed data= option)")
    sweep.add_argument("--executor", metavar="dask|ADDRESS",
                       help="dask: run the trials on a Dask cluster on this machine; tcp://HOST:PORT: on the "
                            "cluster of that Dask scheduler (the trials' code is shipped to its workers)")
    sweep.add_argument("--versions", choices=("error", "warn"), default="error",
                       help="when a worker's package versions differ from this process's: refuse the trial "
                            "(error, the default) or run it with a warning")
    sweep.add_argument("--seed", type=int, default=0, help="seed of the configurations' draws")
    sweep.add_argument("--force", action="store_true", help="replace an unfinished run saved at --checkpoint")
    running(sweep)
    sweep.set_defaults(func=cmd_sweep)


def _plot_parser(sub) -> None:
    plot = sub.add_parser("plot", help="draw the history of a saved run's metrics")
    plot.add_argument("path", type=checkpoint_location, help="a checkpoint file or fsspec URL")
    plot.add_argument("names", nargs="*", metavar="NAME", help="metrics to draw (default: every one recorded)")
    plot.add_argument("-o", "--output", default="curves.png", metavar="FILE", help="the picture (default curves.png)")
    plot.add_argument("--log", action="store_true", help="a logarithmic y axis (a loss; values <= 0 are left out)")
    plot.add_argument("--key", help="the key of a signed checkpoint (or $FLOWVM_CHECKPOINT_KEY)")
    plot.set_defaults(func=cmd_plot)


def _list_parser(sub) -> None:
    lst = sub.add_parser("list", help="list the bundled programs")
    lst.add_argument("--options", action="store_true", help="also print each program's build() options")
    lst.set_defaults(func=cmd_list)


def main(argv: list[str] | None = None, early_signals: list[int] | None = None) -> int:
    """The flowvm command.  From its first line SIGINT and SIGTERM stop a run at a step boundary, save it
    and say so (early_signals: those the entry point, flowvm_cli, saw while flowvm was being imported)."""
    with Stop(early_signals) as stop, _warnings_as_lines():
        try:
            if stop.signal is not None:
                raise StoppedDuringStartup(stop.signal)
            args = parser().parse_args(argv)
        except StoppedDuringStartup as stopped:
            return _stopped_during_startup(stopped.signum)
        args.stop = stop
        args.argv = list(argv) if argv is not None else sys.argv[1:]
        if args.command not in ("run", "resume", "sweep"):  # nothing to stop at a step boundary
            stop.restore()
        return _call(args)


@contextlib.contextmanager
def _warnings_as_lines():
    """flowvm's own warnings as one line each on stderr, in the command's words (no source line of flowvm's, no
    hint of the Python API where the command has an option)."""
    from ..base.errors import CopyWarning, FusionWarning, SettingsWarning

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, (SettingsWarning, CopyWarning, FusionWarning)):
            return shown(message, category, filename, lineno, file, line)
        text = str(message).removeprefix("flowvm: ")
        if issubclass(category, SettingsWarning):
            text = text.replace("drv.resume_with(settings=False) keeps the process's own.",
                                "--keep-settings keeps this process's own.")
        print(f"flowvm: warning: {text}", file=sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _check_counts(args) -> None:
    for name in ("every", "max_steps", "threads"):
        value = getattr(args, name, None)
        least = 0 if name == "max_steps" else 1
        if value is not None and value < least:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {least}")
    if getattr(args, "sync_every", 1) < 1:
        raise UsageError("--sync-every must be >= 1")
    seconds = getattr(args, "every_seconds", None)
    if seconds is not None and not 0 < seconds < float("inf"):
        raise UsageError(f"--every-seconds must be a finite number of seconds > 0, got {seconds}")
    if args.command == "run" and args.checkpoint is None and (args.every or args.every_seconds):
        raise UsageError("--every and --every-seconds need --checkpoint PATH (where to save)")


def _call(args) -> int:
    """The command's function, its errors as the command's messages and exit statuses."""
    try:
        _check_counts(args)
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
    except Exception as err:  # the program's own error: its frames, not the machine's, and where it happened
        print(format_user_error(err), end="", file=sys.stderr)
        return 1


def _stopped_during_startup(signum: int) -> int:
    print(f"flowvm: stopped by {signal.Signals(signum).name} during start-up, before the run's first step "
          "(nothing ran; no checkpoint written or changed)", file=sys.stderr)
    return 128 + signum
