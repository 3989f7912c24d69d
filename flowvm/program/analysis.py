"""Static analysis: which registers elements read and write, and whether they can take a step.

Used by the verifier, by ``start()`` to find the program's register file, and
by later passes (SPAWN's choice of registers to ship, fusion).  The public
queries at the end (``info``, ``analyze``, ``readers``, ``writers``) give the
same results per element, with its path and its children's paths.
"""

from __future__ import annotations

from typing import NamedTuple

from .elements import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Element
from .kinds import KindTable
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
    return True if el.is_leaf else CAN_STEP.of(el)(el)


def _counted(el) -> bool:
    return isinstance(el.n, Register) or el.n > 0


def _selector_runs(el: SWITCH) -> bool:
    return not isinstance(el.selector, Register)  # a CALL selector is a step


CAN_STEP = KindTable("can step", lambda el: any(can_step(c) for c in el.children), {
    REPEAT: lambda el: _counted(el) and can_step(el.body),
    BUFFER: lambda el: _counted(el) and can_step(el.body),
    WHILE: lambda el: True,  # the condition itself is a step
    SWITCH: lambda el: _selector_runs(el) or any(can_step(c) for c in el.children),
    WEAVE: lambda el: el.required > 0 and any(can_step(c) for c in el.children),
})
"""Whether running a container can ever take a step, by kind (default: when some child can)."""


def may_finish(el: Element) -> bool:
    """Whether el can ever finish on its own (a LOOP never does)."""
    return MAY_FINISH.of(el)(el)


def _switch_may_finish(el: SWITCH) -> bool:
    head = 1 if _selector_runs(el) else 0
    return all(may_finish(c) for c in el.children[:head]) and any(may_finish(c) for c in el.children[head:])


def _counted_may_finish(el) -> bool:
    return isinstance(el.n, Register) or el.n == 0 or may_finish(el.body)


MAY_FINISH = KindTable("may finish", lambda el: True, {
    LOOP: lambda el: False,
    SEQ: lambda el: all(may_finish(c) for c in el.children),
    REPEAT: _counted_may_finish, BUFFER: _counted_may_finish,
    WHILE: lambda el: may_finish(el.cond),
    SWITCH: _switch_may_finish,
    WEAVE: lambda el: sum(may_finish(c) for c in el.children) >= el.required,
})
"""Whether an element can ever finish on its own, by kind (default: True)."""


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
        if el.frame_kind is WEAVE:
            return True
        if not el.is_leaf:
            todo.extend(el.children)
    return False


def _unknown_steps(el: Element) -> int:
    raise LookupError


def _counted_steps(el) -> int:
    if not isinstance(el.n, int):
        raise LookupError
    return el.n * steps_of(el.body) if el.n else 0


def _weave_steps(el: WEAVE) -> int:
    if el.required != len(el.elements):
        raise LookupError
    return sum(steps_of(c) for c in el.children)


STATIC_STEPS = KindTable("static steps", _unknown_steps, {
    CALL: lambda el: 1, PRINT: lambda el: 1,
    SEQ: lambda el: sum(steps_of(c) for c in el.children),
    REPEAT: _counted_steps, BUFFER: _counted_steps, WEAVE: _weave_steps,
})
"""The steps an element takes when its shape alone fixes them, by kind; LookupError when it does not
(default)."""


def steps_of(el: Element) -> int:
    """The steps el takes, fixed by its shape (LookupError when they are not)."""
    return STATIC_STEPS.of(el)(el)


def static_steps(program) -> int | None:
    """The number of steps the program takes, when its shape alone fixes it (else None)."""
    try:
        return steps_of(program)
    except LookupError:
        return None
