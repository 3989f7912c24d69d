"""Edits of a program's tree: ``edit_tree`` applies replace, insert and remove at given paths, rebuilding the
ancestors of the edits only; ``become`` gives the edited root to the element the edit was called on.

What an edit does to a child depends on its parent's kind, through three tables (``flowvm.program.kinds``):
``ROLE`` (a child that must stay a single CALL: a WHILE's condition, a SWITCH's CALL selector), ``REMOVE``
(a SEQ or a WEAVE drops the child; elsewhere it becomes an empty SEQ) and ``INSERT`` (a SEQ takes the new
siblings; elsewhere the child and them are wrapped in a SEQ).  A container kind written elsewhere gets the
defaults, or registers entries of its own.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..base.errors import EditError
from ..program.elements import CALL, SEQ, SWITCH, WEAVE, WHILE, Element
from ..program.kinds import KindTable
from ..program.paths import Path, format_path
from ..program.registers import Register


def rebuild(el: Element, children: Sequence[Element]) -> Element:
    """el over new children, keeping its namespace mark and its dependency_overrides."""
    new = el.with_children(children)
    if el.scope is not None and new.scope is not el.scope:
        new = new.with_scope(el.scope)
    return carry_overrides(el, new)


ROLE = KindTable("role", lambda parent, index: None, {
    WHILE: lambda parent, index: "condition" if index == 0 else None,
    SWITCH: lambda parent, index: "selector" if index == 0 and not isinstance(parent.selector, Register) else None,
})
"""The role of a parent's child that must stay a single CALL ('condition', 'selector'), or None, by the
parent's kind: ``fn(parent, index)`` (default: None)."""


def role(parent: Element | None, index: int) -> str | None:
    """'condition' / 'selector' when child index of parent is a WHILE condition or a SWITCH's CALL selector."""
    return None if parent is None else ROLE.of(parent)(parent, index)


def _where(el: Element, path: Path) -> str:
    from ..program.printer import describe

    return f"{describe(el)} at path {format_path(path) or '<root>'!r}"


def _made(new: Any, old: Element, what: str) -> Element:
    el = new(old) if callable(new) and not isinstance(new, Element) else new
    if not isinstance(el, Element):
        raise TypeError(f"{what}: expected a flowvm element (or a function returning one), "
                        f"got {type(el).__name__} {el!r:.60}")
    return el


class NoFrames:
    """The frame listener of a program edit: there is no run to keep in step.

    ``flowvm.editing.hotpatch.DriverFrames`` implements the same calls for a driver.
    """

    def replace(self, path, old, new, verb="replace"): pass

    def seq_insert(self, seq_path, index, items): pass

    def seq_delete(self, seq_path, index, children): pass

    def wrap(self, path, wrapper, index): pass

    def weave_delete(self, weave_path, index, child): pass


@dataclass
class Children:
    """The children of one parent while edits change them: ``kids`` (the new list) and ``removed`` (the
    indices, in the old list, of those a REMOVE dropped)."""

    parent: Element
    path: Path
    kids: list
    frames: Any
    removed: list = field(default_factory=list)


def _remove_from_seq(c: Children, i: int) -> None:
    c.frames.seq_delete(c.path, i, c.kids)
    del c.kids[i]
    c.removed.append(i)


def _remove_from_weave(c: Children, i: int) -> None:
    current, parent = c.kids[i], c.parent
    if parent.n_required > len(c.kids) - 1:
        raise EditError(f"cannot remove {_where(current, c.path + (i,))}: its WEAVE requires {parent.n_required} "
                        f"finished children and would have only {len(c.kids) - 1}", format_path(c.path + (i,)))
    c.frames.weave_delete(c.path, i, current)
    del c.kids[i]
    c.removed.append(i)


def _remove_as_empty(c: Children, i: int) -> None:
    c.frames.replace(c.path + (i,), c.kids[i], SEQ([]), "remove")
    c.kids[i] = SEQ([])


REMOVE = KindTable("remove", _remove_as_empty, {SEQ: _remove_from_seq, WEAVE: _remove_from_weave})
"""How a parent loses its child i, by the parent's kind: ``fn(children, i)`` edits ``children.kids``
(telling ``children.frames``, the run's listener).  Default: the child becomes an empty SEQ."""


def _insert_into_seq(c: Children, i: int, items: list, after: bool) -> None:
    j = i + 1 if after else i
    c.frames.seq_insert(c.path, j, items)
    c.kids[j:j] = items


def _insert_wrapped(c: Children, i: int, items: list, after: bool) -> None:
    wrapper = SEQ([c.kids[i], *items] if after else [*items, c.kids[i]])
    c.frames.wrap(c.path + (i,), wrapper, 0 if after else len(items))
    c.kids[i] = wrapper


INSERT = KindTable("insert", _insert_wrapped, {SEQ: _insert_into_seq})
"""How new elements go beside a parent's child i, by the parent's kind: ``fn(children, i, items, after)``.
Default: the child and the items are wrapped in a SEQ."""


def _rebuild_weave(el: WEAVE, kids: list, removed: list) -> Element:
    if not removed:
        return rebuild(el, kids)
    weights = None if el.weights is None else [w for k, w in enumerate(el.weights) if k not in removed]
    rebuilt = WEAVE(el.n_required, kids, weights)
    return rebuilt.with_scope(el.scope) if el.scope is not None else rebuilt


REBUILD = KindTable("rebuild", lambda el, kids, removed: rebuild(el, kids), {WEAVE: _rebuild_weave})
"""The parent over its edited children, by kind: ``fn(el, kids, removed)`` (removed: the old indices of the
children dropped).  Default: ``rebuild``."""


def edit_tree(program: Element, found: Iterable, op: str, new: Any, frames=NoFrames()) -> Element:
    """The program with op applied to every match, rebuilt once (ancestors of edits only).

    Edits are made last in walk order first: inside a subtree before at its
    root, later siblings before earlier ones, so that each edit finds the paths
    of the others unchanged (the order the frame listener relies on).  A
    function given as ``new`` receives the match as edited by the edits inside it.
    """
    targets = {m.path for m in found}
    by_parent: dict[Path, list[int]] = {}
    touched: set[Path] = set()
    for p in targets:
        if p:
            by_parent.setdefault(p[:-1], []).append(p[-1])
        for k in range(len(p)):
            touched.add(p[:k])

    def visit(el: Element, path: Path) -> Element:
        if path not in touched:
            return el
        c = Children(el, path, [visit(child, path + (i,)) for i, child in enumerate(el.children)], frames)
        for i in sorted(by_parent.get(path, ()), reverse=True):
            _edit_child(c, i, op, new)
        if len(c.kids) == len(el.children) and all(a is b for a, b in zip(c.kids, el.children)):
            return el
        return REBUILD.of(el)(el, c.kids, c.removed)

    program_after = visit(program, ())
    if () in targets:
        return _edit_root(program_after, op, new, frames)
    return program_after


def _edit_root(program: Element, op: str, new: Any, frames) -> Element:
    if op == "remove":
        raise EditError("cannot remove the root of the program; replace it instead", "")
    if op == "replace":
        replacement = _made(new, program, "replace_with")
        frames.replace((), program, replacement)
        return replacement
    items = [_made(n, program, f"insert_{op}") for n in new]
    wrapper = SEQ([program, *items] if op == "after" else [*items, program])
    frames.wrap((), wrapper, 0 if op == "after" else len(items))
    return wrapper


def _edit_child(c: Children, i: int, op: str, new: Any) -> None:
    """Apply op to child i of the parent, editing its children in place."""
    path = c.path + (i,)
    current = c.kids[i]
    what = role(c.parent, i)
    if op == "replace":
        el = _made(new, current, "replace_with")
        if what is not None and not isinstance(el, CALL):
            raise EditError(f"cannot replace {_where(current, path)} by {el.kind}: a {what} must be a CALL",
                            format_path(path))
        c.frames.replace(path, current, el)
        c.kids[i] = el
    elif op == "remove":
        if what is not None:
            raise EditError(f"cannot remove {_where(current, path)}: it is the {what} of its parent; "
                            "replace it with another CALL instead", format_path(path))
        REMOVE.of(c.parent)(c, i)
    else:
        after = op == "after"
        if what is not None:
            raise EditError(f"cannot insert {'after' if after else 'before'} {_where(current, path)}: it is the "
                            f"{what} of its parent, which must be a single CALL; edit the parent instead",
                            format_path(path))
        INSERT.of(c.parent)(c, i, [_made(n, current, f"insert_{op}") for n in new], after)


def apply_edits(program: Element, found: Sequence, op: str, new: Any) -> Element:
    """The edited program (the original is untouched); its dependency_overrides are carried over."""
    edited = edit_tree(program, found, op, new)
    return carry_overrides(program, edited)


def become(root: Element, edited: Element) -> Element:
    """Give root (in place) the kind and content of edited, and return root.

    Where edited still contains root itself (root wrapped in a SEQ with a
    hook, say), that occurrence becomes a copy of root as it was, so the
    tree stays a tree.
    """
    if edited is root:
        return root
    before = copy.copy(root)
    edited = _substitute(edited, root, before)
    object.__setattr__(root, "__class__", type(edited))
    root.__dict__.clear()
    root.__dict__.update(edited.__getstate__())
    from ..machine.live import refresh_drivers_holding
    from ..program.elements import subtrees_changed

    subtrees_changed()  # the subtrees of everything holding root changed: their analyses are stale
    refresh_drivers_holding(root)
    return root


def _substitute(el: Element, old: Element, new: Element) -> Element:
    if el is old:
        return new
    kids = el.children
    if not kids:
        return el
    changed = [_substitute(k, old, new) for k in kids]
    if all(a is b for a, b in zip(changed, kids)):
        return el
    return rebuild(el, changed)


def carry_overrides(old: Element, new: Element) -> Element:
    """new, or a copy of it holding old's dependency_overrides and settings when old has some."""
    for name in ("_overrides", "_settings"):
        table = old.__dict__.get(name)
        if table and new is not old and new.__dict__.get(name) != table:
            new = copy.copy(new)
            new.__dict__[name] = dict(table)
    return new
