"""The ``batch-buffers`` pass: ``BUFFER(n, CALL(src.next))`` becomes one ``CALL(src.next_batch, n)``.

The *bufferable* protocol: a source whose method ``NAME`` produces one item
may offer ``NAME_batch(n, *args, **kwargs)``, returning exactly what
``BUFFER(n, CALL(src.NAME, *args, **kwargs))`` collects (the n items stacked
as BUFFER stacks them) and leaving the source where n calls of ``NAME``
would.  The rewritten program takes one step where the BUFFER took n, with
the same value in the BUFFER's register.

The rewrite applies when the BUFFER's body is a CALL of a bound method whose
owner has a callable ``NAME_batch``, and that CALL stores nothing itself
(its register would have to hold the last item).  A BUFFER of 0 is left
alone; a count held in a register is checked when the CALL runs (0 gives
``[]`` as BUFFER does, without calling the batch method).

>>> from flowvm import BUFFER, CALL, Registers
>>> class Counter:
...     def __init__(self): self.i = 0
...     def next(self):
...         self.i += 1
...         return self.i
...     def next_batch(self, n):
...         out = list(range(self.i + 1, self.i + n + 1))
...         self.i += n
...         return out
>>> reg = Registers()
>>> prog = batch_buffers(BUFFER(3, CALL(Counter().next), store_to=reg('xs')))
>>> print(prog)
xs = Counter.next_batch(3)
>>> prog.run(), reg['xs']
([1, 2, 3], [1, 2, 3])
"""

from __future__ import annotations

import numbers

import types
from typing import Any, Callable

from ..program.elements import BUFFER, CALL, Element
from ..program.registers import Register
from .registry import register_pass
from .rewrite import rewrite, under_weave

SUFFIX = "_batch"


def batch_method(fn: Callable) -> Callable | None:
    """The batched counterpart of a bound method (``src.NAME_batch``), or None."""
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", None)
    if owner is None or name is None or isinstance(owner, (type, types.ModuleType)):
        return None
    batched = getattr(owner, name + SUFFIX, None)
    return batched if callable(batched) else None


def batch_or_empty(method: Callable, n: int, *args: Any, **kwargs: Any) -> Any:
    """``method(n, ...)``, or ``[]`` (BUFFER's value for no items) when n is 0; n checked as BUFFER checks it."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"BUFFER count holds {type(n).__name__} {n!r:.60}, expected an int >= 0")
    if n < 0:
        raise ValueError(f"BUFFER count holds {n}, expected an int >= 0")
    return [] if n == 0 else method(int(n), *args, **kwargs)


def _visit(el: Element, path) -> Element:
    if type(el) is not BUFFER or type(el.body) is not CALL:
        return el
    call = el.body
    if call.store_to is not None:
        return el
    batched = batch_method(call.fn)
    if batched is None:
        return el
    if isinstance(el.n, Register):
        return CALL(batch_or_empty, batched, el.n, *call.args, store_to=el.store_to, **call.kwargs)
    if el.n == 0:
        return el
    return CALL(batched, el.n, *call.args, store_to=el.store_to, **call.kwargs)


@register_pass("batch-buffers", default=True)
def batch_buffers(program: Element) -> Element:
    """Turn BUFFER(n, CALL(src.NAME)) into one CALL(src.NAME_batch, n) where the source offers it (not
    inside a WEAVE, whose turns count the BUFFER's n steps)."""
    weaves = under_weave(program)
    return rewrite(program, lambda el, path: el if path in weaves else _visit(el, path))
