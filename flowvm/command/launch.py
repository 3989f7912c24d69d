"""``flowvm run TARGET --nproc N`` and ``flowvm resume LOCATION``: data-parallel runs on torch.distributed.

The command has two roles.  Given ``--nproc`` (or ``--nnodes``), it is the *launcher*: it starts torch's
elastic agent (flowvm.distributed.agent), which starts the ranks, each running this same command line
(``python -m flowvm ...``), restarts them after a lost rank (``--max-restarts``) and reports the rank that
failed.  Started by an agent (ours or a plain ``torchrun -m flowvm run ...``: its environment names the
process group), it is a *rank*: it starts the process group, builds the program (its ``Batches`` shard
each epoch by rank), runs it in step with the other ranks and saves coordinated checkpoints in the folder
or URL prefix ``--checkpoint`` names (flowvm.distributed.coordinated).  Only rank 0 prints progress and the
report, records the history, writes TensorBoard scalars and ``--output``.

A rank restarted by the agent finds the checkpoint its run saved (same run id) and resumes from it.
``flowvm resume LOCATION`` of a distributed checkpoint launches as many ranks as saved it, unless
``--nproc`` asks for another number (each remaining global batch is then shared out among the new ranks).
"""

from __future__ import annotations

import gc
import math
import socket
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

from ..base.errors import CheckpointError, UsageError
from ..base.data import max_workers
from ..base.environment import cores
from ..base.workers import die_with_parent
from ..persist.location import Location
from ..persist.lock import hold_as_rank, holding
from ..distributed import coordinated, group
from ..distributed.agent import RankError, config, record_error, run_elastic
from ..distributed.loop import DEFAULT_SYNC_EVERY, Synchronized
from ..distributed.replicas import ReplicaError, per_rank_names
from .places import key_of
from .runs import check_output, finish, module_of, set_threads, start_program, write_model
from .history import History
from .runner import DEFAULT_EVERY_SECONDS, rate_text, shown
from .targets import recorded
from . import outputs
from .rankends import all_ended, leave, tell, told


def add_options(parser) -> None:
    """The data-parallel options of ``run`` and ``resume``."""
    g = parser.add_argument_group("data-parallel runs (torch.distributed; see docs/distributed.md)")
    g.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, metavar="N", help="ranks on this host (processes, one per GPU with CUDA)")
    g.add_argument("--nnodes", type=int, default=1, metavar="M", help="hosts taking part (default 1)")
    g.add_argument("--node-rank", type=int, metavar="R", help="this host's rank among them (a static rendezvous)")
    g.add_argument("--rdzv", "--rdzv-endpoint", dest="rdzv", metavar="HOST:PORT",
                   help="the rendezvous endpoint (several hosts)")
    g.add_argument("--rdzv-id", metavar="ID", help="the run's id, the same on every host (default: derived from "
                                                   "--rdzv)")
    g.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart the ranks up to K times after one fails (from the last complete checkpoint)")
    g.add_argument("--dist-timeout", type=float, metavar="S",
                   help=f"seconds a collective waits for the other ranks before failing (default "
                        f"${group.TIMEOUT_ENV} or {group.DEFAULT_TIMEOUT:g})")
    g.add_argument("--sync-every", type=int, default=DEFAULT_SYNC_EVERY, metavar="N",
                   help=f"steps between two agreements of the ranks on stopping and saving (default "
                        f"{DEFAULT_SYNC_EVERY})")


def wanted(args) -> bool:
    """Whether this command line is a data-parallel run (to launch, or one rank of)."""
    if group.launched():
        return True
    if getattr(args, "nproc", None) is not None or getattr(args, "nnodes", 1) != 1:
        return True
    return args.command == "resume" and coordinated.is_checkpoint(args.path)


def cmd_run(args) -> int:
    location = _location(args.checkpoint)
    check_output(args.output)
    if not group.launched():
        _check_options(args)
        if location is not None and not args.force:
            _refuse_unfinished(location, key_of(args))
        return _launch(args, 1 if args.nproc is None else args.nproc, location)
    return _as_rank(args, _run_rank)


def cmd_resume(args) -> int:
    location = _location(args.path)
    if args.program is not None or args.set:
        raise UsageError("--program and --set resume state checkpoints (.safetensors) only")
    if not coordinated.is_checkpoint(location):
        raise UsageError(f"{location} holds no distributed checkpoint (no {coordinated.MANIFEST})")
    if not group.launched():
        _check_options(args)
        manifest = coordinated.verify(location, key_of(args))  # a damaged file: one line, before any rank
        return _launch(args, manifest["world_size"] if args.nproc is None else args.nproc, location)
    return _as_rank(args, _resume_rank)


def complete_step(args) -> None:
    """A data-parallel run's location given to ``show`` or ``plot``: its manifest's complete step (the run
    rank 0 saved there, ``shared.ckpt``) in args.path instead."""
    if coordinated.is_checkpoint(args.path):
        manifest = coordinated.read_manifest(args.path, key_of(args))
        args.path = Location.of(coordinated.join(args.path, f"{manifest['folder']}/shared.ckpt"))


# ------------------------------------------------------------------ the launcher
def _check_options(args) -> None:
    """The data-parallel options, refused in one line before any rank starts."""
    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nproc is not None and args.nproc > max_workers():
        raise UsageError(f"--nproc {args.nproc} is more ranks than this host can run usefully: at most "
                         f"{max_workers()} (4 per core of its {cores()}, or 8)")
    if args.nnodes < 1 or args.max_restarts < 0:
        raise UsageError(f"--nnodes must be >= 1 and --max-restarts >= 0, got {args.nnodes} and {args.max_restarts}")
    if args.sync_every < 1:
        raise UsageError(f"--sync-every must be >= 1, got {args.sync_every}")
    try:
        seconds = group.timeout_seconds(args.dist_timeout)
    except ValueError as err:
        raise UsageError(f"--dist-timeout: {err}" if args.dist_timeout is not None else str(err)) from None
    if not math.isfinite(seconds):
        raise UsageError(f"the collectives' timeout must be a finite number of seconds, got {seconds}")
    if args.rdzv is not None:
        _check_endpoint(args.rdzv, args.node_rank, args.nnodes)


def _check_endpoint(rdzv: str, node_rank: int | None, nnodes: int = 1) -> None:
    """--rdzv HOST:PORT: a port, and, where this host serves the rendezvous for sure, a port no one else holds.
    Hosts that meet without node ranks (several, each may serve it) are not checked: the launcher of another
    host of the same run, started first on this machine, holds the port rightly."""
    host, sep, port = rdzv.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--rdzv must be HOST:PORT, got {rdzv!r}")
    serves = node_rank == 0 or (node_rank is None and nnodes == 1)
    if not serves or host.strip("[]") not in ("127.0.0.1", "localhost", "::1", socket.gethostname()):
        return
    with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as probe:
        try:
            probe.bind((host.strip("[]"), int(port)))
        except OSError as err:
            raise UsageError(f"--rdzv {rdzv}: this host cannot serve the rendezvous there ({err.strerror}): another "
                             "process holds the port; choose another port") from None


def _location(value):
    """A data-parallel run's checkpoint folder (a Path) or URL prefix (a str) from the place given."""
    if value is None:
        return None
    loc = Location.of(value)
    if loc.path is not None:
        if loc.path.exists() and not loc.path.is_dir():
            raise UsageError(f"--checkpoint {loc}: a data-parallel run saves into a folder; {loc} is a file")
        return loc.path
    return loc.url.rstrip("/")


def _refuse_unfinished(location, key) -> None:
    if coordinated.is_checkpoint(location):
        manifest = coordinated.read_manifest(location, key)
        if not manifest.get("done"):
            raise UsageError(f"{location} holds an unfinished run (step {manifest.get('steps')}); "
                             f"continue it with `flowvm resume {location}`, or pass --force to start over")


def _launch(args, nproc: int, location) -> int:
    """Start the agent (which starts the ranks); while they run, the launcher holds the checkpoint's lock
    (flowvm.persist.lock: on several hosts, the host of rank 0 does), so that a second run saving there is
    refused (status 2, naming the holder)."""
    if location is None or (args.nnodes > 1 and args.node_rank != 0):
        return _launch_ranks(args, nproc)
    if isinstance(location, Path):
        location.parent.mkdir(parents=True, exist_ok=True)
    with holding(location):
        return _launch_ranks(args, nproc)


def _launch_ranks(args, nproc: int) -> int:
    if nproc < 1 or args.nnodes < 1 or args.max_restarts < 0:
        raise UsageError("--nproc and --nnodes must be >= 1, --max-restarts >= 0")
    try:
        cfg = config(nproc, args.nnodes, args.rdzv, args.node_rank, args.max_restarts,
                     run_id=args.rdzv_id)
    except ValueError as err:
        raise UsageError(f"{err}") from None
    args.stop.restore()  # the agent takes SIGINT/SIGTERM over and passes them to the ranks
    with told() as ends:  # the ranks say there how they ended
        code = _run_agent(args, cfg, nproc)
        stopped, finished = ends.stopped, ends.finished
    if code >= 128 and finished == nproc and not stopped:  # a signal after every rank had finished the run
        return 0
    return max(stopped) if code == 0 and stopped else code


def _run_agent(args, cfg, nproc: int) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if args.nnodes > 1:
        print(f"flowvm: waiting for {args.nnodes} hosts at {args.rdzv} (Ctrl-C to give up)", file=sys.stderr,
              flush=True)
    try:
        run_elastic(cfg, sys.executable, "-m", "flowvm", *args.argv)
    except SignalException as err:  # the launcher was signalled: the agent passed it on to the ranks, which
        # agreed to stop, saved and said so (rank 0), in the time the agent gives them.  A second signal
        # during that shutdown (Ctrl-C, then a SIGTERM) is raised over the first: the first is the status
        first = err
        while isinstance(first.__context__, SignalException):
            first = first.__context__
        return 128 + int(first.sigval)
    except RankError as err:
        if err.stopped() is not None:  # the ranks agreed to stop on a signal, saved, and rank 0 said so
            return 128 + err.stopped()
        if all_ended(nproc):  # and then one died in its teardown (its group's threads, an atexit hook):
            print(f"flowvm: rank {err.rank} died in its teardown (exit code {err.exitcode}) after every rank "
                  f"had ended; the run's status stands", file=sys.stderr)
            return 0  # the status is the one they ended with (_launch_ranks)
        if err.traceback:  # the error, with where it was raised, then which rank raised it
            print(err.traceback.rstrip(), file=sys.stderr)
            print(f"flowvm: rank {err.rank} failed (exit code {err.exitcode}); every rank is stopped",
                  file=sys.stderr)
        else:
            print(f"flowvm: {err}; every rank is stopped", file=sys.stderr)
        return 2 if err.kind == "hung" else 1  # a hang is a fault of the run's own (a stopped process, a
        # program that never reaches a collective), said in one line; the rest are failures
    return 0


# ------------------------------------------------------------------ a rank
def _as_rank(args, body) -> NoReturn:
    """Run ``body`` as a rank of the launcher's group; a rank that ends with a status (its run done, stopped or
    refused, its error recorded for the launcher) leaves at once (``rankends.leave``)."""
    leave(_rank_status(args, body))


def _rank_status(args, body) -> int:
    die_with_parent(os.getppid())  # a rank never outlives the launcher that started it (SIGKILL'd too)
    saves_to = args.checkpoint if args.command == "run" else (args.checkpoint or args.path)
    if saves_to is not None:
        hold_as_rank(saves_to)  # while it lives, a new run saving there is refused, its launcher gone or not
    group.init(args.dist_timeout)
    try:
        return tell(body(args))
    except (group.AllRanksError, UsageError) as err:  # every rank alike, at one step: said once a host, status 2
        if group.local_rank() == 0:
            print(f"flowvm: {err}", file=sys.stderr, flush=True)
        return tell(2)
    except SystemExit as err:
        if group.rank() != 0:  # the same refusal on every rank: said once
            raise SystemExit(2 if isinstance(err.code, str) else err.code) from None
        raise
    except BaseException as err:
        text = str(err).lower()
        kind = "group" if any(word in text for word in ("gloo", "nccl", "connection", "timed out")) else "raised"
        if record_error(err, kind):  # the agent's launcher prints it, once
            return 1
        raise
    finally:
        gc.collect()  # the run's DDP modules hold the group: gone before it ends, not at the interpreter's exit
        group.shutdown()


def _meta(args, module, threads, location, values: dict) -> dict:
    meta = {"target": recorded(args.target), "module": module.__name__, "sets": list(args.set), **values,
            "show": list(getattr(module, "SHOW", [])), "threads": threads, "every": args.every,
            "every_seconds": args.every_seconds, "sync_every": args.sync_every}
    return outputs.record(args, meta)


def _run_rank(args) -> int:
    location, key = _location(args.checkpoint), key_of(args)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if location is not None and coordinated.is_checkpoint(location):
        manifest = coordinated.read_manifest(location, key)
        if restart > 0 and manifest["meta"].get("run_id") == run_id:  # this run, restarted: from its checkpoint
            args.path = location
            return _resume_rank(args)
        if not args.force and restart == 0:
            _refuse_unfinished(location, key)
    module, drv, values, threads = start_program(args)
    meta = dict(_meta(args, module, threads, location, values), run_id=run_id)
    return _go(args, drv, module, meta, location, key, resumed=False)


def _resume_rank(args) -> int:
    location, key = _location(args.path), key_of(args)
    manifest = coordinated.read_manifest(location, key)
    meta = dict(manifest.get("meta") or {}, run_id=os.environ.get("TORCHELASTIC_RUN_ID"))
    module = module_of(meta)
    set_threads(args.threads)
    if args.every is None and args.every_seconds is None:
        args.every, args.every_seconds = meta.get("every"), meta.get("every_seconds")
    drv = coordinated.load(location, key, restore_settings=not getattr(args, "keep_settings", False))
    if args.threads is not None:
        drv.resume_with(settings={"torch.threads": args.threads})
    meta = outputs.resume(args, meta)
    check_output(args.output)
    return _go(args, drv, module, meta, location, key, resumed=manifest["world_size"] == max(group.world_size(), 1))


def _go(args, drv, module, meta: dict, location, key, resumed: bool) -> int:
    """Run a rank's driver in step with the others; rank 0 reports."""
    first = group.rank() == 0
    if location is not None and isinstance(location, Path) and first:
        location.mkdir(parents=True, exist_ok=True)
    group.barrier()
    history = History(drv, meta, list(meta.get("show", [])) + list(args.history), args.tensorboard) \
        if first else None
    progress = _Progress(drv, meta.get("show", []), args, location) if first else None

    def on_chunk(d):
        if history is not None:
            history.sync()
        if progress is not None:
            progress.tick()

    if location is not None and args.every is None and args.every_seconds is None:
        args.every_seconds = DEFAULT_EVERY_SECONDS  # as a run on one process saves
    runner = Synchronized(drv, location, args.every, args.every_seconds, args.sync_every, key, meta,
                          stop=args.stop, on_chunk=on_chunk, resumed=resumed, per_rank=_per_rank(module))
    try:
        status = runner.run(args.max_steps)
    finally:
        if history is not None:
            history.close()
    if first:
        if progress is not None:
            progress.tick(force=True)
        if status:
            name = signal.Signals(status - 128).name
            where = f"; saved to {location}, continue with `flowvm resume {location}`" if location else ""
            print(f"flowvm: stopped by {name} at step {drv.steps}{where}", file=sys.stderr, flush=True)
        finish(drv, module, location, key is not None, status)
        write_model(drv, module, args.output)
    group.barrier()  # no rank ends (which stops the group) before rank 0 has reported
    return status


def _per_rank(module) -> frozenset:
    """The registers the program file declares per-rank (``PER_RANK = ("stats",)``): each rank keeps its own
    value there, which the check that the ranks hold one model leaves out."""
    try:
        return per_rank_names(getattr(module, "PER_RANK", None) if module is not None else None,
                              f"PER_RANK in {getattr(module, '__file__', None) or getattr(module, '__name__', '?')}")
    except TypeError as err:  # on every rank alike: refused as the check's own refusal, one line
        raise ReplicaError(str(err)) from None


class _Progress:
    """Rank 0's plain progress lines."""

    def __init__(self, drv, show, args, location):
        self.drv, self.show, self.every = drv, list(show), args.progress_every
        self.quiet = args.progress == "none"
        self.start_step, self.start = drv.steps, time.monotonic()
        self.last = self.start
        if not self.quiet:
            where = f", saving to {location}" if location is not None else ""
            size = group.world_size()
            print(f"flowvm: running from step {drv.steps} on {size} rank{'s' if size != 1 else ''}{where}",
                  file=sys.stderr, flush=True)

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.quiet or not (force or now - self.last >= self.every):
            return
        self.last = now
        rate = rate_text(self.drv.steps - self.start_step, now - self.start)
        print(f"step {self.drv.steps} ({rate}) {shown(self.drv, self.show)}".rstrip(),
              file=sys.stderr, flush=True)


__all__ = ["add_options", "wanted", "cmd_run", "cmd_resume", "complete_step", "CheckpointError"]
