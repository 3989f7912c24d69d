"""The ``flatten`` pass: splice nested SEQs into their parent and unwrap one-child SEQs.

A SEQ that marks an instance (``isolate``) or holds dependency_overrides is
kept whole, so that what it means survives optimization.

``SEQ([a, SEQ([b, c]), SEQ([]), d])`` becomes ``SEQ([a, b, c, d])`` and
``REPEAT(n, SEQ([f]))`` becomes ``REPEAT(n, f)`` (which lets the driver take
its fast path for a leaf repeated by a REPEAT).  Moving through containers
costs no step, so steps, values and registers are unchanged.  An empty SEQ
that is the last child stays: its value (None) is its parent's value.

>>> from flowvm import CALL, REPEAT, SEQ, Registers
>>> reg = Registers(x=1)
>>> f = CALL(abs, reg('x'), store_to=reg('x'))
>>> print(flatten(SEQ([f, SEQ([f, REPEAT(2, SEQ([f]))])])))
SEQ:
    x = abs(x)
    x = abs(x)
    REPEAT 2:
        x = abs(x)
"""

from __future__ import annotations

from ..program.elements import Element
from .registry import register_pass
from .rewrite import is_seq, rebuild, rewrite


def _plain(el: Element) -> bool:
    """A SEQ that only groups: no namespace mark, no dependency_overrides of its own."""
    return (is_seq(el) and el.scope is None and not el.__dict__.get("_overrides")
            and not el.__dict__.get("_settings"))


def _visit(el: Element, path) -> Element:
    if not is_seq(el):
        return el
    out: list[Element] = []
    last = len(el.elements) - 1
    changed = False
    for i, child in enumerate(el.elements):
        if _plain(child) and (child.elements or i < last):
            out.extend(child.elements)  # children of a flattened SEQ are flat already
            changed = True
        else:
            out.append(child)
    keep = [c for k, c in enumerate(out) if not (_plain(c) and not c.elements and k < len(out) - 1)]
    if len(keep) != len(out):
        out, changed = keep, True
    if len(out) == 1 and _plain(el):
        return out[0]
    return rebuild(el, out) if changed else el


@register_pass("flatten", default=True)
def flatten(program: Element) -> Element:
    """Splice nested SEQs into their parent SEQ and replace one-child SEQs by the child."""
    return rewrite(program, _visit)
