"""A bottom-up tree rewriter shared by the passes.

``rewrite(program, visit)`` rebuilds the program from the leaves up: each
element's children are rewritten first, the element is rebuilt with
``with_children`` only when a child changed (so untouched subtrees stay the
very same objects; namespace marks and dependency_overrides are kept), then ``visit(element, path)`` may return a replacement.
Paths are those of the input program.
"""

from __future__ import annotations

from typing import Callable

from ..program.elements import CALL, SEQ, WEAVE, Element
from ..program.kinds import KindTable


def rebuild(el: Element, children) -> Element:
    """el over new children, keeping its namespace mark and dependency_overrides (see flowvm.editing.edit)."""
    from ..editing.edit import rebuild

    return rebuild(el, children)

def is_seq(el: Element) -> bool:
    """A SEQ as the passes see it: the kind, or a subclass that keeps its frame and moves (``frame_kind``)."""
    return el.frame_kind is SEQ


def is_call(el: Element) -> bool:
    """A CALL the passes may read and replace: the kind, or a subclass that runs as one (``frame_kind`` CALL, a
    simple leaf); a CALL with Depends arguments (not a simple leaf: it resolves them when it runs) is not."""
    return el.frame_kind is CALL and el.simple_leaf


Visit = Callable[[Element, tuple[int, ...]], Element]


SCHEDULES_BY_STEPS = KindTable("schedules by steps", lambda el: False, {WEAVE: lambda el: True})
"""Whether a container's schedule counts its children's steps (a WEAVE's turns), by kind (default: False):
the passes leave alone what is inside such a container."""


def under_weave(program: Element) -> set[tuple[int, ...]]:
    """Paths of the elements inside a WEAVE (or another container whose schedule counts steps,
    ``SCHEDULES_BY_STEPS``): a pass that changes how many steps a part takes leaves these alone."""
    from ..program.paths import walk

    inside: set[tuple[int, ...]] = set()
    for path, el in walk(program):
        if SCHEDULES_BY_STEPS.of(el)(el) or (path and path[:-1] in inside):
            inside.add(path)
    return inside


def rewrite(program: Element, visit: Visit) -> Element:
    """The program with every element replaced by visit(element-with-rewritten-children, path)."""

    def go(el: Element, path: tuple[int, ...]) -> Element:
        children = el.children
        if children:
            new = [go(c, path + (i,)) for i, c in enumerate(children)]
            if any(a is not b for a, b in zip(new, children)):
                el = rebuild(el, new)
        out = visit(el, path)
        if not isinstance(out, Element):
            raise TypeError(f"rewrite: visit returned {type(out).__name__} for the {el.kind} at path "
                            f"{'.'.join(map(str, path)) or '<root>'}, expected an element")
        return out

    return go(program, ())
