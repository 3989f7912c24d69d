"""Static analysis: which registers elements read and write, and whether they can take a step.

Used by the verifier, by ``start()`` to find the program's register file, and
by later passes (SPAWN's choice of registers to ship, fusion).
"""

from __future__ import annotations

from .elements import BUFFER, CALL, LOOP, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Element
from .registers import Register, Registers


def all_registers(program: Element) -> list[Register]:
    """Every Register reference in the program, reads and writes, in walk order."""
    from .paths import walk

    out = []
    for _, el in walk(program):
        out.extend(el.own_reads())
        out.extend(el.own_writes())
    return out


def register_files(program: Element) -> list[Registers]:
    """The distinct register files (by identity) the program's references are bound to."""
    files: dict[int, Registers] = {}
    for r in all_registers(program):
        files.setdefault(id(r.file), r.file)
    return list(files.values())


def reads(el: Element) -> set[str]:
    """Names of the registers el or any element inside it reads."""
    return el._cached("reads", lambda: _union(el, "own_reads", reads))


def writes(el: Element) -> set[str]:
    """Names of the registers el or any element inside it may write."""
    return el._cached("writes", lambda: _union(el, "own_writes", writes))


def _union(el: Element, own: str, rec) -> frozenset:
    names = {r.name for r in getattr(el, own)()}
    for child in el.children:
        names |= rec(child)
    return frozenset(names)


def can_step(el: Element) -> bool:
    """Whether running el can ever take a step (a leaf action)."""
    return el._cached("can_step", lambda: _can_step(el))


def _can_step(el: Element) -> bool:
    if el.is_leaf:
        return True
    if isinstance(el, (REPEAT, BUFFER)):
        return (isinstance(el.n, Register) or el.n > 0) and can_step(el.body)
    if isinstance(el, WHILE):
        return True  # the condition itself is a step
    if isinstance(el, SWITCH):
        return isinstance(el.selector, CALL) or any(can_step(c) for c in el.children)
    if isinstance(el, WEAVE):
        return el.required > 0 and any(can_step(c) for c in el.children)
    return any(can_step(c) for c in el.children)


def may_finish(el: Element) -> bool:
    """Whether el can ever finish on its own (a LOOP never does)."""
    if isinstance(el, LOOP):
        return False
    if isinstance(el, (SEQ,)):
        return all(may_finish(c) for c in el.children)
    if isinstance(el, (REPEAT, BUFFER)):
        return isinstance(el.n, Register) or el.n == 0 or may_finish(el.body)
    if isinstance(el, WHILE):
        return may_finish(el.cond)
    if isinstance(el, SWITCH):
        head = [el.selector] if isinstance(el.selector, CALL) else []
        return all(may_finish(c) for c in head) and any(may_finish(c) for c in el.children[len(head):])
    if isinstance(el, WEAVE):
        return sum(may_finish(c) for c in el.children) >= el.required
    return True

