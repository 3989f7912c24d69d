"""Static analysis: which registers elements read and write, and whether they can take a step.

Used by the verifier, by ``start()`` to find the program's register file, and
by later passes (SPAWN's choice of registers to ship, fusion).  The public
queries at the end (``info``, ``analyze``, ``readers``, ``writers``) give the
same results per element, with its path and its children's paths.
"""

from __future__ import annotations

from typing import NamedTuple

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
    return el._cached_subtree("reads", lambda: _union(el, "own_reads", reads))


def writes(el: Element) -> set[str]:
    """Names of the registers el or any element inside it may write."""
    return el._cached_subtree("writes", lambda: _union(el, "own_writes", writes))


def _union(el: Element, own: str, rec) -> frozenset:
    names = {r.name for r in getattr(el, own)()}
    for child in el.children:
        names |= rec(child)
    return frozenset(names)


def can_step(el: Element) -> bool:
    """Whether running el can ever take a step (a leaf action)."""
    return el._cached_subtree("can_step", lambda: _can_step(el))


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


# ------------------------------------------------------------- public queries
class ElementInfo(NamedTuple):
    """What the analysis knows about one element of a program.

    ``reads``/``writes`` cover the element and everything inside it;
    ``own_reads``/``own_writes`` the element alone (a REPEAT's count and
    counter, a CALL's arguments and ``store_to``); ``children`` are the
    children's paths, in path order.
    """

    path: tuple
    element: Element
    parent: tuple | None
    children: tuple
    own_reads: frozenset
    own_writes: frozenset
    reads: frozenset
    writes: frozenset

    @property
    def kind(self) -> str:
        return self.element.kind

    @property
    def path_text(self) -> str:
        from .paths import format_path

        return format_path(self.path)


def info(program: Element, path=()) -> ElementInfo:
    """The ElementInfo of the element at path ("0.2.1" or a tuple; the root by default).

    >>> from flowvm import CALL, REPEAT, Registers
    >>> reg = Registers(x=1)
    >>> i = info(REPEAT(2, CALL(abs, reg('x'), store_to=reg('y'))), "0")
    >>> i.kind, i.path_text, sorted(i.reads), sorted(i.writes), i.parent
    ('CALL', '0', ['x'], ['y'], ())
    """
    from .paths import get, parse_path

    path = parse_path(path)
    return _info(path, get(program, path))


def _info(path: tuple, el: Element) -> ElementInfo:
    return ElementInfo(path, el, path[:-1] if path else None, tuple(path + (i,) for i in range(len(el.children))),
                       frozenset(r.name for r in el.own_reads()), frozenset(r.name for r in el.own_writes()),
                       frozenset(reads(el)), frozenset(writes(el)))


def analyze(program: Element) -> list[ElementInfo]:
    """The ElementInfo of every element, parents before children (walk order)."""
    from .paths import walk

    return [_info(p, el) for p, el in walk(program)]


def readers(program: Element, name: str) -> list[tuple]:
    """Paths of the elements that read register name themselves (own_reads), in walk order."""
    from .paths import walk

    return [p for p, el in walk(program) if any(r.name == name for r in el.own_reads())]


def writers(program: Element, name: str) -> list[tuple]:
    """Paths of the elements that write register name themselves (own_writes), in walk order."""
    from .paths import walk

    return [p for p, el in walk(program) if any(r.name == name for r in el.own_writes())]


def has_weave(program) -> bool:
    """Whether the driver runs a WEAVE (fragments inside other leaves, such as a SPAWN's, do not count)."""
    todo = [program]
    while todo:
        el = todo.pop()
        if type(el) is WEAVE:
            return True
        if not el.is_leaf:
            todo.extend(el.children)
    return False


def static_steps(program) -> int | None:
    """The number of steps the program takes, when its shape alone fixes it (else None)."""
    from .elements import BUFFER, CALL, PRINT, REPEAT, SEQ, WEAVE

    def count(el):
        kind = type(el)
        if kind is CALL or kind is PRINT:
            return 1
        if kind is SEQ or (kind is WEAVE and el.required == len(el.elements)):
            return sum(count(c) for c in el.children)
        if (kind is REPEAT or kind is BUFFER) and isinstance(el.n, int):
            return el.n * count(el.body) if el.n else 0
        raise LookupError

    try:
        return count(program)
    except LookupError:
        return None
