"""Find elements by pattern and edit them: replace_with, insert_before, insert_after, remove.

Library code ships algorithms as templates; users edit them to add hooks::

    prog.find(CALL(cd1_update, layer=layer1)).replace_with(
        SEQ([CALL(cd1_update, layer=layer1), CALL(my_debugfn)]))

**Edits change the program they were called on in place** and return it.
Only that one element object (the root of the edit) changes: the edited
elements below it are new objects and every other element is left as it
was, so other programs sharing sub-elements with it are not affected, and a
driver started before the edit goes on with the program as it was when it
started (``start()`` takes its own copy of the root).  Calling ``find`` on an
element that is itself part of other programs edits it in all of them, as
with any shared mutable object.  To keep the original, edit a copy:
``copy.copy(prog).find(...)`` (a cheap copy of the root alone).
**A driver edit (a hot patch) changes the driver in place** and returns it:
``drv.find(...)`` edits the program a half-run driver is running and remaps
its frames, so the run goes on exactly (see ``flowvm.editing.hotpatch``).

Matching: a pattern matches elements of the same kind whose function and
given arguments are equal; positional arguments are compared from the first
(``ANY`` matches anything), keyword arguments not named in the pattern match
anything, ``store_to`` is compared only when the pattern gives one, and a
Register matches a Register of the same name.  A container pattern matches
containers with equal settings whose children match the pattern's children.
A plain function as the pattern matches every CALL of it, an element class
(``REPEAT``) every element of that kind; ``where=`` takes a predicate on elements.  No match raises ``EditError`` (``missing_ok=True``
gives an empty result instead, whose edits change nothing).

>>> from flowvm import CALL, REPEAT, SEQ, Registers
>>> reg = Registers(x=0)
>>> def inc(v, by=1):
...     return v + by
>>> prog = REPEAT(3, CALL(inc, reg('x'), by=2, store_to=reg('x')))
>>> prog.find(CALL(inc)).paths
['0']
>>> seen = []
>>> prog2 = prog.find(inc).insert_after(CALL(seen.append, reg('x')))
>>> prog2 is prog
True
>>> print(prog)
REPEAT 3:
    SEQ:
        x = inc(x, by=2)
        list.append(x)
>>> prog.run(), seen
(None, [2, 4, 6])
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from ..program.elements import CALL, SEQ, SWITCH, WEAVE, WHILE, Element, provide, tool
from ..base.errors import EditError
from ..program.paths import Path, format_path, get, parse_path, walk
from .match import ANY, describe_pattern, matches, near_misses, pattern_test, same_value  # noqa: F401  (ANY, same_value: the public names)




class Match(NamedTuple):
    """One match: the element's path (a tuple of child indices) and the element."""

    path: Path
    element: Element

    @property
    def path_text(self) -> str:
        return format_path(self.path)


class Matches(Sequence):
    """The result of ``find``/``at``: the matches, and edits that apply to all of them.

    On a program the edits change it in place and return it; on a driver they
    patch the driver in place and return it.  Matches serve one edit: find
    again after it.
    """

    def __init__(self, target: Any, found: list[Match], description: str):
        self.target = target
        self.program = _program_of(target)  # the program the paths are in
        self._found = found
        self.description = description
        self._used = False

    def __len__(self) -> int:
        return len(self._found)

    def __getitem__(self, i):
        return self._found[i]

    @property
    def paths(self) -> list[str]:
        return [m.path_text for m in self._found]

    @property
    def elements(self) -> list[Element]:
        return [m.element for m in self._found]

    def __repr__(self) -> str:
        inner = ", ".join(f"{m.path_text or '<root>'}: {m.element!r}" for m in self._found)
        return f"<{len(self._found)} match{'es' if len(self._found) != 1 else ''} of {self.description}: {inner}>"

    def replace_with(self, new: Element | Callable[[Element], Element]):
        """Replace every match by new (an element, or a function of the matched element returning one)."""
        return self._apply("replace", new)

    def insert_before(self, *new: Element | Callable[[Element], Element]):
        """Insert the new elements just before every match (into its SEQ, else wrapping both in a SEQ)."""
        return self._apply("before", new)

    def insert_after(self, *new: Element | Callable[[Element], Element]):
        """Insert the new elements just after every match (into its SEQ, else wrapping both in a SEQ)."""
        return self._apply("after", new)

    def remove(self):
        """Remove every match: from its SEQ or WEAVE; elsewhere it becomes an empty SEQ."""
        return self._apply("remove", None)

    def _apply(self, op: str, new: Any):
        if op != "remove" and not (op == "replace" or new):
            raise TypeError(f"insert_{op}: give at least one element to insert")
        from ..machine.driver import Driver

        if isinstance(self.target, Driver):
            from ..machine.running import drivers_mid_step

            if self.target in drivers_mid_step():
                raise EditError(f"the driver is running a step (step {self.target.steps}): a patch made by a "
                                "CALL of that run is refused; patch it between steps")
            if self.target.program is not self.program:
                raise EditError(f"the driver's program has changed since these matches of {self.description} "
                                "were found (a patch replaces it): call find() or at() again")
            return tool("patch_driver")(self.target, self._found, op, new)
        if self._used:
            raise EditError(f"these matches of {self.description} were already used for an edit, which may "
                            "have moved them: call find() or at() again")
        for m in self._found:
            try:
                here = get(self.program, m.path)
            except LookupError:
                here = None
            if here is not m.element:
                raise EditError(f"the program has changed since these matches of {self.description} were "
                                "found (another edit moved them): call find() or at() again", m.path_text)
        from ..machine.running import drivers_mid_step, running_in

        for busy in drivers_mid_step():
            if not busy.done and any(x is self.target for _, x in walk(busy.program)):
                from ..program.printer import describe

                raise EditError(f"{describe(self.target)} is part of the program a driver is running a step of "
                                f"(step {busy.steps}): an edit made by a CALL of that run is refused; edit "
                                "between steps (or patch the run through the driver, drv.find(...))")
        live = running_in(self.target)
        if live is not None:
            from ..program.printer import describe

            drv, where = live
            raise EditError(f"{describe(self.target)} is running in a driver (step {drv.steps}, at path "
                            f"{where!r}); an edit in place would change it under that run: patch the run "
                            "through the driver (drv.find(...), drv.at(...)), or edit a copy "
                            "(copy.copy(element).find(...))")
        edited = apply_edits(self.target, self._found, op, new)
        self._used = True
        return become(self.target, edited)


# ------------------------------------------------------------------- finding
def find(target: Any, pattern: Any = None, *, where: Callable[[Element], bool] | None = None,
         missing_ok: bool = False) -> Matches:
    """Every element of a program (or of a driver's program) matching pattern and where, parents first."""
    program = _program_of(target)
    if pattern is None and where is None:
        raise TypeError("find: give a pattern element, a function (matches its CALLs) or where=predicate")
    if where is not None and not callable(where):
        raise TypeError(f"find: where must be a predicate taking an element, got {type(where).__name__} "
                        f"{where!r:.40}")
    test = pattern_test(pattern)
    found = [Match(p, el) for p, el in walk(program) if (test is None or test(el)) and (where is None or where(el))]
    description = describe_pattern(pattern, where)
    if not found and not missing_ok:
        raise EditError(f"find: no element matches {description} in the program{near_misses(program, pattern)}")
    return Matches(target, found, description)


def at(target: Any, *paths: Path | str) -> Matches:
    """The elements at the given paths ("0.2.1" or tuples), to edit them as ``find`` results."""
    program = _program_of(target)
    if not paths:
        raise TypeError("at: give at least one path")
    found = []
    for p in paths:
        p = parse_path(p)
        try:
            found.append(Match(p, get(program, p)))
        except LookupError as err:
            raise EditError(str(err), format_path(p)) from None
    return Matches(target, found, "paths " + ", ".join(repr(format_path(m.path)) for m in found))


def _program_of(target: Any) -> Element:
    from ..machine.driver import Driver

    if isinstance(target, Driver):
        return target.program
    if isinstance(target, Element):
        return target
    raise TypeError(f"expected a flowvm program or Driver, got {type(target).__name__}")


# ------------------------------------------------------------------- editing
def rebuild(el: Element, children: Sequence[Element]) -> Element:
    """el over new children, keeping its namespace mark and its dependency_overrides."""
    new = el.with_children(children)
    if el.scope is not None and new.scope is not el.scope:
        new = new.with_scope(el.scope)
    return carry_overrides(el, new)


def role(parent: Element | None, index: int) -> str | None:
    """'condition' / 'selector' when child index of parent is a WHILE condition or a SWITCH's CALL selector."""
    if isinstance(parent, WHILE) and index == 0:
        return "condition"
    if isinstance(parent, SWITCH) and isinstance(parent.selector, CALL) and index == 0:
        return "selector"
    return None


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


def edit_tree(program: Element, found: Iterable[Match], op: str, new: Any, frames=NoFrames()) -> Element:
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
        kids = list(el.children)
        for i, child in enumerate(kids):
            kids[i] = visit(child, path + (i,))
        weights = list(el.weights) if isinstance(el, WEAVE) and el.weights is not None else None
        for i in sorted(by_parent.get(path, ()), reverse=True):
            _edit_child(el, path, kids, weights, i, op, new, frames)
        if len(kids) == len(el.children) and all(a is b for a, b in zip(kids, el.children)):
            return el
        if isinstance(el, WEAVE) and len(kids) != len(el.elements):
            rebuilt = WEAVE(el.n_required, kids, weights)
            return rebuilt.with_scope(el.scope) if el.scope is not None else rebuilt
        return rebuild(el, kids)

    program_after = visit(program, ())
    if () in targets:
        if op == "remove":
            raise EditError("cannot remove the root of the program; replace it instead", "")
        if op == "replace":
            replacement = _made(new, program_after, "replace_with")
            frames.replace((), program_after, replacement)
            return replacement
        items = [_made(n, program_after, f"insert_{op}") for n in new]
        wrapper = SEQ([program_after, *items] if op == "after" else [*items, program_after])
        frames.wrap((), wrapper, 0 if op == "after" else len(items))
        return wrapper
    return program_after


def _edit_child(parent: Element, parent_path: Path, kids: list, weights: list | None, i: int, op: str,
                new: Any, frames) -> None:
    """Apply op to child i of parent, editing kids (and a WEAVE's weights) in place."""
    path = parent_path + (i,)
    current = kids[i]
    what = role(parent, i)
    if op == "replace":
        el = _made(new, current, "replace_with")
        if what is not None and not isinstance(el, CALL):
            raise EditError(f"cannot replace {_where(current, path)} by {el.kind}: a {what} must be a CALL",
                            format_path(path))
        frames.replace(path, current, el)
        kids[i] = el
    elif op == "remove":
        if what is not None:
            raise EditError(f"cannot remove {_where(current, path)}: it is the {what} of its parent; "
                            "replace it with another CALL instead", format_path(path))
        if isinstance(parent, SEQ):
            frames.seq_delete(parent_path, i, kids)
            del kids[i]
        elif isinstance(parent, WEAVE):
            if parent.n_required > len(kids) - 1:
                raise EditError(f"cannot remove {_where(current, path)}: its WEAVE requires {parent.n_required} "
                                f"finished children and would have only {len(kids) - 1}", format_path(path))
            frames.weave_delete(parent_path, i, current)
            del kids[i]
            if weights is not None:
                del weights[i]
        else:
            frames.replace(path, current, SEQ([]), "remove")
            kids[i] = SEQ([])
    else:
        after = op == "after"
        if what is not None:
            raise EditError(f"cannot insert {'after' if after else 'before'} {_where(current, path)}: it is the "
                            f"{what} of its parent, which must be a single CALL; edit the parent instead",
                            format_path(path))
        items = [_made(n, current, f"insert_{op}") for n in new]
        if isinstance(parent, SEQ):
            j = i + 1 if after else i
            frames.seq_insert(parent_path, j, items)
            kids[j:j] = items
        else:
            wrapper = SEQ([current, *items] if after else [*items, current])
            frames.wrap(path, wrapper, 0 if after else len(items))
            kids[i] = wrapper


def apply_edits(program: Element, found: Sequence[Match], op: str, new: Any) -> Element:
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
    from ..machine.running import refresh_drivers_holding
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


provide("find", find)  # Element.find(), Driver.find()
provide("at", at)
