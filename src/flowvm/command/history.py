"""The history of a run's metrics, kept by the command line: its SHOW registers (and those named with
``--history``) recorded every ``every`` steps and when the run finishes.

Points are taken at fixed steps (multiples of ``every``, which the run's first start chooses from the
program's step count and keeps), so a run stopped anywhere and resumed records exactly the points of the
uninterrupted run.  The history travels in the checkpoint's ``meta`` (plain JSON: readable without loading
the run), saved with the run: a run killed and resumed from its last checkpoint records again the points
taken after it, none lost and none twice.  ``--tensorboard DIR`` writes the same points as TensorBoard
scalars; a resumed run's writer purges the points past its checkpoint's step (``purge_step``), so the
curves never double.  ``flowvm plot`` draws them (``plot_history``).
"""

from __future__ import annotations

import numbers
from typing import Any

POINTS = 200  # about this many points over a run whose step count the program fixes


def point_value(value: Any) -> float | list[float] | None:
    """A register's value as a number or a list of numbers (a small array, a list); None when it is not."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    size = getattr(value, "size", None)
    if callable(size):  # a torch tensor
        size = value.numel()
    if item is not None and size == 1:
        try:
            return float(item())
        except (TypeError, ValueError, RuntimeError):
            return None
    if isinstance(value, (list, tuple)) or (size is not None and isinstance(size, int) and 1 < size <= 64):
        try:
            values = [float(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]
        except (TypeError, ValueError):
            return None
        return values if len(values) <= 64 else None
    return None


class History:
    """Points of named registers, every ``every`` steps: ``points[name] = [[step, value], ...]``."""

    def __init__(self, meta: dict, names: list[str], total: int | None, tensorboard: str | None = None,
                 start_step: int = 0):
        saved = meta.get("history") or {}
        self.every = int(saved.get("every") or max(1, (total or POINTS) // POINTS))
        self.names = list(dict.fromkeys(list(saved.get("names", [])) + list(names)))
        self.points: dict[str, list] = {n: [p for p in saved.get("points", {}).get(n, []) if p[0] <= start_step]
                                        for n in self.names}
        self.meta = meta["history"] = {"every": self.every, "names": self.names, "points": self.points}
        self.writer = None
        if tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            # points past the step the run resumes from were written by a run that was stopped: dropped
            self.writer = SummaryWriter(tensorboard, purge_step=start_step if start_step else None)

    def _coarsen(self, step: int) -> None:
        # A run longer than its program told (or than it could tell): keep about POINTS to 2 x POINTS points
        # by doubling the interval and keeping the points at its multiples.  It depends on the step alone,
        # so a resumed run coarsens exactly where the uninterrupted one does.
        while step // self.every > 2 * POINTS:
            self.every *= 2
            for name, points in self.points.items():
                points[:] = [p for p in points if p[0] % self.every == 0]

    def next_step(self, step: int) -> int:
        """The next step at which a point is due, after step."""
        return (step // self.every + 1) * self.every

    def record(self, step: int, registers, final: bool = False) -> None:
        """The points at step (a multiple of every; final: the run's last step, whatever it is)."""
        self._coarsen(step)
        self.meta["every"] = self.every
        if step % self.every and not final:
            return  # due under the interval before it doubled
        for name in self.names:
            if name not in registers:
                continue
            value = point_value(registers[name])
            if value is None:
                continue
            points = self.points[name]
            if points and points[-1][0] >= step:
                continue  # recorded already (the run resumed at this very step)
            points.append([step, value])
            if self.writer is not None:
                if isinstance(value, list):
                    for k, v in enumerate(value):
                        self.writer.add_scalar(f"{name}/{k}", v, step)
                else:
                    self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


def plot_history(history: dict, names: list[str], out: str, title: str = "") -> Any:
    """One panel per metric (a line, or one line per item of a list-valued metric) against the step; saved
    to out (any format matplotlib writes).  Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = history.get("points", {})
    missing = [n for n in names if not points.get(n)]
    if missing:
        known = ", ".join(n for n in points if points[n]) or "none"
        raise SystemExit(f"flowvm: no history of {', '.join(missing)} in the run (recorded: {known})")
    fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.4 * len(names) + 0.6), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        steps = [p[0] for p in points[name]]
        values = [p[1] for p in points[name]]
        marker = "." if len(steps) < 50 else None  # a few points (one, even) still show
        if isinstance(values[0], list):
            for k in range(len(values[0])):
                ax.plot(steps, [v[k] for v in values], marker=marker, label=f"{name}[{k}]")
            ax.legend(fontsize="small")
        else:
            ax.plot(steps, values, marker=marker, label=name)
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return fig
