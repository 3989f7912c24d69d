"""``flowvm sweep`` (a random search over a program's options, trials as SPAWNs, on a Dask cluster with
``--executor dask``) and ``flowvm plot`` (a run's metric history drawn)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..persist.formats import format_of
from . import outputs
from .targets import load_module, parse_sets
from .places import check_checkpoint_path, key_of, refuse_to_overwrite
from .runs import check_output, finish, runner_for, write_model
from ..base.errors import UsageError


def start_dask(scheduler: str | None = None, versions: str = "error") -> Any:
    """A Dask client registered as the executor "dask": of a new cluster on this machine (a worker process
    per core), or connected to the scheduler at the address given (``tcp://host:port``), whose workers
    get the trials' code shipped (see flowvm.processes.shipping)."""
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise UsageError("--executor dask needs dask.distributed (pip install 'flowvm[dask]')") from None
    from .. import register_executor

    if scheduler is None:
        client = Client(LocalCluster(n_workers=os.cpu_count() or 1, threads_per_worker=1, processes=True,
                                     dashboard_address=None))
    else:
        try:
            client = Client(scheduler, timeout=30)
        except OSError as err:
            raise UsageError(f"cannot reach the Dask scheduler at {scheduler}: {err}") from None
    register_executor("dask", client, versions=versions)
    return client


def executor_option(value: str | None) -> str | None:
    """The scheduler address an --executor option names (None: a cluster on this machine, or no Dask)."""
    if value is None or value == "dask":
        return None
    if "://" in value:
        return value
    raise UsageError("--executor takes dask (a cluster on this machine) or a Dask scheduler's address "
                     "(tcp://host:8786); the default is a local pool")


def cmd_sweep(args) -> int:
    """A random search over a program's options, each trial a SPAWN; the best trial's model is kept."""
    from ..programs import sweep

    check_checkpoint_path(args.checkpoint)
    refuse_to_overwrite(args.checkpoint, args.force)
    check_output(args.output)
    if args.checkpoint is not None and not format_of(args.checkpoint).holds_code:
        raise UsageError("a sweep saves pickle checkpoints (.ckpt): its trials' results hold models")
    module = load_module(args.target)
    fixed = parse_sets(args.set, module.build)
    if args.data is not None:
        fixed["data"] = str(Path(args.data).resolve())
    scheduler = executor_option(args.executor)
    executor = None if args.executor is None else "dask"
    if executor is not None:
        start_dask(scheduler, args.versions)
    try:
        program = sweep.search(module.__name__.removeprefix("flowvm.programs."), args.space, args.trials, args.metric,
                               args.minimize, fixed, executor, args.seed)
    except (ValueError, TypeError, ImportError) as err:
        raise UsageError(f"sweep: {err}") from err
    drv = program.start()
    meta = {"target": "sweep", "module": sweep.__name__, "search": {"program": args.target, "space": args.space,
            "metric": args.metric, "minimize": args.minimize, "sets": list(args.set), "trials": args.trials},
            "executor": executor, "scheduler": scheduler, "versions": args.versions, "show": ["best_metric"], "every": args.every,
            "every_seconds": args.every_seconds}
    meta = outputs.record(args, meta)
    status = runner_for(args, drv, meta, args.checkpoint).run(args.max_steps)
    finish(drv, None, args.checkpoint, key_of(args) is not None, status)
    if drv.done:
        print(sweep.search_report(drv.registers))
    write_model(drv, sweep, args.output)
    return status


def cmd_plot(args) -> int:
    """Draw the history a run recorded (read from the checkpoint's header: nothing is unpickled)."""
    from .history import plot_history
    from .launch import complete_step

    complete_step(args)  # a data-parallel run's folder: its complete step
    key = key_of(args)
    header = format_of(args.path).read_header(args.path, key)
    meta = header.get("meta") or {}
    history = meta.get("history") or {}
    names = args.names or [n for n in history.get("names", []) if history.get("points", {}).get(n)]
    if not names:
        raise UsageError(f"{args.path} holds no history (runs of the flowvm command record their SHOW "
                         "registers, and those named with --history)")
    target = meta.get("target", "")
    plot_history(history, names, args.output, title=f"{Path(str(target)).stem or target} ({args.path})",
                 log=args.log)
    print(f"wrote {args.output}: {', '.join(names)} over {header.get('steps')} steps")
    return 0
