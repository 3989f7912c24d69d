"""Static checks run before a program starts.

- every register read has some execution path that writes it first
  (registers already holding a value count as written);
- no LOOP or WHILE has a body that can never take a step;
- all register references are bound to one register file;
- no two instances of a template (``isolate``/``template``, see
  ``flowvm.editing.namespaces``) write a register in common.

This is the register-file counterpart of checking that every popped skip
tensor was stashed before.  Writes are tracked as a *may* analysis: a read is
an error only when no path at all can have written the register by then.
"""

from __future__ import annotations

from .analysis import can_step, register_files, writes
from .elements import BUFFER, LOOP, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Element
from .kinds import KindTable
from ..base.errors import VerifyError
from .paths import format_path, parse_path, walk
from .printer import listing
from .registers import Registers


def program_registers(program: Element) -> Registers:
    """The one register file the program's references are bound to (a new empty one if none)."""
    files = register_files(program)
    if len(files) > 1:
        from .paths import walk
        from .printer import describe

        first: dict[int, tuple] = {}  # register file -> (path, element, register) where it is first used
        for path, el in walk(program):
            for r in el.own_reads() + el.own_writes():
                first.setdefault(id(r.file), (path, el, r))
        where = [first[id(f)] for f in files if id(f) in first][:3]
        shown = "; ".join(f"register {r.name!r} of file {k + 1} at path '{format_path(p) or '<root>'}' "
                          f"({describe(el)})" for k, (p, el, r) in enumerate(where))
        raise VerifyError(
            f"the program uses registers from {len(files)} different register files ({shown}); a program "
            "runs on one Registers object: build every reference with the same one (reg = Registers(); "
            "reg('name'))",
            path=format_path(where[1][0]) if len(where) > 1 else "",
        )
    return files[0] if files else Registers()


def _refs(program):
    from .analysis import all_registers

    return all_registers(program)


def verify(program: Element, registers: dict | None = None) -> None:
    """Raise VerifyError if program can read an unwritten register or spin without steps.

    ``registers`` defaults to the program's own register file; names already
    in it count as written.
    """
    if registers is None:
        registers = program_registers(program)
    _check(program, (), frozenset(registers), program)
    check_collisions(program)  # instances (isolate/template) writing one register


def _fail(message: str, path: tuple, program: Element, register: str | None = None):
    from .printer import listing

    where = format_path(path) or "<root>"
    text = listing(program, {path: (">>", "here")})
    raise VerifyError(f"{message} (at path '{where}')\n{text}", format_path(path), register)


def _check_reads(el: Element, path: tuple, before: frozenset, program: Element) -> None:
    for r in el.own_reads():
        if r.name not in before:
            from .printer import describe

            known = ", ".join(sorted(before)) or "none"
            _fail(f"register {r.name!r} is read by {describe(el)} but no execution path writes it before "
                  f"(registers written by then: {known})", path, program, r.name)


def _may_write(el: Element) -> frozenset:
    """The registers el may write when it runs: ``writes(el)`` less what sits in a part that never
    runs (the body of a REPEAT or BUFFER whose count is the literal 0, the children of a WEAVE(0))."""
    if el.is_leaf:
        if not el.children:
            return frozenset(writes(el))
        # a leaf running a fragment (SPAWN): its own value's register, and what the fragment may write
        store_to = getattr(el, "store_to", None)
        own = frozenset([store_to.name]) if store_to is not None else frozenset()
        return own.union(*(_may_write(c) for c in el.children))
    own = frozenset(r.name for r in el.own_writes())
    if SKIPS_CHILDREN.of(el)(el):
        return own
    return own.union(*(_may_write(c) for c in el.children))


SKIPS_CHILDREN = KindTable("skips children", lambda el: False, {
    REPEAT: lambda el: isinstance(el.n, int) and el.n == 0,
    BUFFER: lambda el: isinstance(el.n, int) and el.n == 0,
    WEAVE: lambda el: el.n_required == 0,
})
"""Whether a container's children never run, seen from its fields alone (a REPEAT of the literal 0), by
kind (default: False)."""


def _check(el: Element, path: tuple, before: frozenset, program: Element) -> frozenset:
    """Check el given the registers that may be written before it; return those after it."""
    return CHECK.of(el)(el, path, before, program)


def _check_leaf(el: Element, path: tuple, before: frozenset, program: Element) -> frozenset:
    for i, child in enumerate(el.children):  # a leaf running a fragment (SPAWN): name the reader in it
        _check(child, path + (i,), before, program)
    _check_reads(el, path, before, program)
    return before | (_may_write(el) if el.children else {r.name for r in el.own_writes()})


def _check_in_order(el: Element, path: tuple, before: frozenset, program: Element) -> frozenset:
    """The children run in order, each against what the children before it may write (a child that runs
    again only adds writes): SEQ, and the default for a container kind written elsewhere
    (docs/containers.md)."""
    if el.is_leaf:
        return _check_leaf(el, path, before, program)
    _check_reads(el, path, before, program)
    for i, child in enumerate(el.children):
        before = _check(child, path + (i,), before, program)
    return before | {r.name for r in el.own_writes()}


# A loop body's first iteration runs before any later one, so it is checked
# against what is written before the loop; later iterations only add writes.
def _check_counted(el: REPEAT | BUFFER, path: tuple, before: frozenset, program: Element) -> frozenset:
    _check_reads(el, path, before, program)
    own = {r.name for r in el.own_writes()}
    _check(el.body, path + (0,), before | (own if isinstance(el, REPEAT) else set()), program)
    if SKIPS_CHILDREN.of(el)(el):  # the body never runs (a BUFFER still stores [])
        return before | own
    return before | own | _may_write(el.body)


def _check_loop(el: LOOP, path: tuple, before: frozenset, program: Element) -> frozenset:
    if not can_step(el.body):
        _fail("LOOP body can never take a step; the loop would spin forever", path, program)
    _check(el.body, path + (0,), before, program)
    return before | _may_write(el.body)


def _check_while(el: WHILE, path: tuple, before: frozenset, program: Element) -> frozenset:
    if not can_step(el.body):
        _fail("WHILE body can never take a step", path, program)
    after_cond = _check(el.cond, path + (0,), before, program)
    _check(el.body, path + (1,), after_cond, program)
    return after_cond | _may_write(el.body)


def _check_switch(el: SWITCH, path: tuple, before: frozenset, program: Element) -> frozenset:
    _check_reads(el, path, before, program)
    children = el.children
    head = len(children) - len(el.cases) - (el.default is not None)  # 1: a CALL selector runs first
    if head:
        before = _check(children[0], path + (0,), before, program)
    after = set(before)
    for i in range(head, len(children)):
        after |= _check(children[i], path + (i,), before, program)
    return frozenset(after)


def _check_weave(el: WEAVE, path: tuple, before: frozenset, program: Element) -> frozenset:
    if el.n_required == 0:  # done before any child takes a step
        for i, child in enumerate(el.elements):
            _check(child, path + (i,), before | writes(el), program)  # checked, but writes nothing
        return before
    all_writes = [_may_write(c) for c in el.elements]
    after = set(before)
    for i, child in enumerate(el.elements):
        others = frozenset().union(*(w for j, w in enumerate(all_writes) if j != i))
        after |= _check(child, path + (i,), before | others, program)
    return frozenset(after)


CHECK = KindTable("verify", None, {
    Element: _check_in_order, SEQ: _check_in_order, REPEAT: _check_counted, BUFFER: _check_counted,
    LOOP: _check_loop, WHILE: _check_while, SWITCH: _check_switch, WEAVE: _check_weave,
})
"""verify's check of one element, by kind: ``fn(el, path, before, program)`` checks el given the names of
the registers that may be written before it and returns those after it, calling ``_check`` on children
(for any Element without an entry of its own: the children run in order)."""


# ------------------------------------------------ instances (flowvm.editing.namespaces) that write one register
def instances(program: Element) -> list[tuple[tuple, Element]]:
    """(path, element) of every marked instance in the program, parents first."""
    todo = [program]
    while todo:  # a quick scan first: most programs have no instance at all
        el = todo.pop()
        if el.scope is not None:
            return [(p, e) for p, e in walk(program) if e.scope is not None]
        todo.extend(el.children)
    return []


def collisions(program: Element) -> list[dict]:
    """Pairs of instances that write a register in common (not one both declare shared).

    Each collision is a dict with ``paths`` (two path strings), ``registers``
    (sorted names) and ``instances`` (their two scopes).  Nested instances
    and two occurrences of the very same element do not collide.
    """
    found = instances(program)
    out = []
    for i, (pa, a) in enumerate(found):
        for pb, b in found[i + 1:]:
            if a is b or pb[: len(pa)] == pa or pa[: len(pb)] == pb:
                continue
            common = (writes(a) & writes(b)) - (_shared_writes(a) & _shared_writes(b))
            if common:
                out.append({"paths": (format_path(pa), format_path(pb)), "registers": sorted(common),
                            "instances": (a.scope, b.scope)})
    return out


def _shared_writes(instance: Element) -> frozenset:
    """Names the instance writes only where it, or an instance inside it, declares them shared."""
    shared_only: set[str] = set()
    owned: set[str] = set()

    def visit(el: Element, shared: frozenset) -> None:
        if el.scope is not None:
            shared = shared | el.scope.shared
        for r in el.own_writes():
            (shared_only if r.name in shared else owned).add(r.name)
        for child in el.children:
            visit(child, shared)

    visit(instance, frozenset())
    return frozenset(shared_only - owned)


def check_collisions(program: Element) -> None:
    """Raise VerifyError for the first collision between instances (see ``collisions``)."""
    found = collisions(program)
    if not found:
        return
    c = found[0]
    pa, pb = c["paths"]
    names = ", ".join(repr(n) for n in c["registers"][:5])
    a, b = c["instances"]
    what = (f"two instances of template {a.template}" if a.template is not None and a.template == b.template
            else "two instances")
    hint = ("they share a namespace; give each its own" if a.namespace is not None and a.namespace == b.namespace
            else "isolate them: sub.isolate('a'), sub.isolate('b')")
    text = listing(program, {parse_path(pa): (">>", "instance"), parse_path(pb): (">>", "instance")})
    raise VerifyError(f"register collision: {what} (paths {pa or '<root>'!r} and {pb or '<root>'!r}, {a!r} and "
                      f"{b!r}) both write {names}; {hint}\n{text}", pb, c["registers"][0])
