"""The history of a run's metrics on the command line: its SHOW registers (and those named with ``--history``)
watched by the driver (``Driver.watch``, flowvm.machine.metrics: points at fixed steps, part of the run's
state, so a run stopped anywhere and resumed records exactly the points of the uninterrupted run).  The
command also writes the history into every checkpoint's ``meta`` (plain JSON: ``flowvm plot`` reads it
without loading the run), ``--tensorboard DIR`` writes the points as TensorBoard scalars (a resumed run's
writer purges the points past its checkpoint's step, ``purge_step``, so the curves never double), and
``flowvm plot`` draws them (``plot_history``).
"""

from __future__ import annotations

from typing import Any

from ..machine import metrics
from ..base.errors import UsageError


class History:
    """The command's side of a watched run: the history in the checkpoints' meta, and the TensorBoard
    writer fed with every point recorded since the last ``sync``."""

    def __init__(self, drv, meta: dict, names: list[str], tensorboard: str | None = None):
        if drv.watched is None and meta.get("history"):  # a checkpoint whose run kept its history in meta only
            metrics.adopt(drv, meta["history"])
        drv.watch(*names)
        self.drv = drv
        meta["history"] = drv.watched  # the same dict: every save writes the points so far
        self.sent = {name: len(points) for name, points in drv.watched["points"].items()}
        self.writer = None
        if tensorboard is not None:
            # points past the step the run resumes from were written by a run that was stopped: dropped
            self.writer = ScalarWriter(tensorboard, purge_step=drv.steps if drv.steps else None)
            self.sent = {name: sum(1 for p in points if p[0] < drv.steps)
                         for name, points in drv.watched["points"].items()}

    def sync(self) -> None:
        """Write the points recorded since the last call to TensorBoard."""
        if self.writer is None:
            return
        for name, points in self.drv.watched["points"].items():
            start = min(self.sent.get(name, 0), len(points))  # (a coarsened history has fewer points)
            for step, value in points[start:]:
                if isinstance(value, list):
                    for k, v in enumerate(value):
                        self.writer.add_scalar(f"{name}/{k}", v, step)
                else:
                    self.writer.add_scalar(name, value, step)
            self.sent[name] = len(points)

    def close(self) -> None:
        if self.writer is not None:
            self.sync()
            self.writer.flush()
            self.writer.close()


class ScalarWriter:
    """TensorBoard scalars written with the ``tensorboard`` package's own event file writer (no torch needed,
    ``pip install 'flowvm[tensorboard]'``).  ``purge_step``: TensorBoard drops the points at and past this
    step that earlier files of the directory hold (a run resumed from an older checkpoint)."""

    def __init__(self, logdir: str, purge_step: int | None = None):
        try:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise UsageError("--tensorboard needs the tensorboard package (pip install "
                             "'flowvm[tensorboard]')") from None
        self._event, self._summary = Event, Summary
        self._file = EventFileWriter(str(logdir))
        if purge_step is not None:
            self._add(Event(step=int(purge_step), session_log=SessionLog(status=SessionLog.START)))

    def _add(self, event) -> None:
        import time

        event.wall_time = time.time()
        self._file.add_event(event)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._add(self._event(step=int(step), summary=summary))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def plot_history(history: dict, names: list[str], out: str, title: str = "", log: bool = False) -> Any:
    """One panel per metric (a line, or one line per item of a list-valued metric) against the step; saved
    to out (any format matplotlib writes), on a logarithmic y axis with log (a loss; values <= 0 are left
    out).  Returns the figure."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("flowvm plot needs matplotlib (pip install 'flowvm[plot]')") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = history.get("points", {})
    missing = [n for n in names if not points.get(n)]
    if missing:
        known = ", ".join(n for n in points if points[n]) or "none"
        raise UsageError(f"no history of {', '.join(missing)} in the run (recorded: {known})")
    fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.4 * len(names) + 0.6), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        _panel(ax, name, points[name], log)
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return fig


def _panel(ax, name: str, points: list, log: bool) -> None:
    """One metric's panel: a line, or one line per item of a list-valued metric."""
    steps = [p[0] for p in points]
    values = [p[1] for p in points]
    marker = "." if len(steps) < 50 else None  # a few points (one, even) still show
    if isinstance(values[0], list):
        for k in range(len(values[0])):
            ax.plot(steps, [v[k] for v in values], marker=marker, label=f"{name}[{k}]")
        ax.legend(fontsize="small")
    else:
        ax.plot(steps, values, marker=marker, label=name)
    ax.set_ylabel(name)
    if log:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
