"""The checks of a run's frames read from a state file (flowvm.persist.state): every slot of every frame
has the type and the range its kind's layout gives it (flowvm/machine/layouts.py)."""

from __future__ import annotations

from ..machine.layouts import LARGEST, layout_of

__all__ = ["LARGEST", "check_frame"]


def _marker(fr: list, size: int, what: str) -> None:
    """A frame of size slots, or one more: the marker of a move that failed once (True)."""
    if len(fr) == size + 1 and fr[size] is True:
        return
    if len(fr) != size:
        raise ValueError(f"{what} frame has {len(fr) - 1} slots, its layout {size - 1}")


def check_frame(fr: list, steps: int) -> None:
    """Raise ValueError naming the first slot of fr (a frame as the driver holds it, its element first) that
    is not of its layout's type or range; steps: the run's step count."""
    el = fr[0]
    what = el.kind
    if len(fr) == 1:  # a leaf ready to run, a container not started yet
        return
    if el.is_leaf:
        raise ValueError(f"{what} (a leaf) frame has {len(fr) - 1} slots, its layout none")
    layout = layout_of(el)
    if layout is None:
        raise ValueError(f"{what} frame: an element kind whose frames a state file does not hold")
    _marker(fr, layout.size, what)
    layout.check(fr, len(el.children), steps)
