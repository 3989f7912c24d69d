"""Why a copy of a run is refused, named: ``copy_refused(err, driver)`` turns what pickling a driver raised into a
``CopyError`` that says where the value at fault is held (flowvm.persist.culprit) — a tensor whose autograd graph
a later backward() still needs (``LiveGraph``, raised by the pickler's tensor rule), or the innermost value that
does not pickle.
"""

from __future__ import annotations

from typing import Any

from ..base.errors import CopyError

__all__ = ["LiveGraph", "GRAPH_REASON", "copy_refused"]


class LiveGraph(CopyError):
    """A tensor with a live autograd graph met while pickling (``where`` found later by ``copy_refused``)."""

    def __init__(self, tensor):
        super().__init__("<copy>", GRAPH_REASON)
        self.tensor = tensor


GRAPH_REASON = ("holds a tensor whose autograd graph a later backward() may still run through (a copy taken "
                "between a forward pass and its backward); torch cannot copy an autograd graph, and the copy's "
                "backward() would silently give no gradients. Copy the run after the backward (flowvm's own "
                "saves wait for such a step: Driver.copyable() tells when), or keep what is not differentiated "
                "as loss.detach() or loss.item() (or compute it under torch.no_grad())")


def copy_refused(err: Exception, driver, dumps, path: Any = "<copy>") -> Exception:
    """err from pickling driver, as a CopyError naming where the value at fault is held: the register or
    frame holding a tensor with a live autograd graph, or the innermost value that does not pickle (the
    register, its attribute or item, or the program's element, with the object's type).  dumps(value)
    pickles one value as the copy would."""
    from .culprit import held_at, unpicklable_at

    if isinstance(err, LiveGraph):
        tensor = err.tensor
        where = held_at(driver, lambda v: v is tensor) or _graph_holder(driver, tensor, dumps)
        refused = CopyError(path, GRAPH_REASON, where or "a value of the run (not in a register or a frame)")
        refused.tensor = tensor
        return refused
    if isinstance(err, CopyError):
        return err
    found = unpicklable_at(driver, dumps, err)
    if found is None:
        return CopyError(path, f"does not pickle: {type(err).__name__}: {err}")
    where, value, inner = found
    return CopyError(path, f"holds a {type(value).__module__}.{type(value).__qualname__}, which does not pickle "
                           f"({type(inner).__name__}: {inner})", where)


def _graph_holder(driver, tensor, dumps) -> str | None:
    """Where a value is held whose pickling meets tensor (a tensor inside an object the walk does not enter)."""
    from .culprit import places

    for where, value in places(driver):
        try:
            dumps(value)
        except LiveGraph as err:
            if err.tensor is tensor:
                return where
        except Exception:
            continue
    return None
