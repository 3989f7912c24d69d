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

from typing import Any, Callable, NamedTuple, Sequence

from ..program.elements import Element, provide, tool
from ..base.errors import EditError
from ..program.paths import Path, format_path, get, parse_path, walk
from .tree import NoFrames, apply_edits, become, carry_overrides, edit_tree, rebuild  # noqa: F401  (their old home)
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
            self._check_driver_patch()
            return tool("patch_driver")(self.target, self._found, op, new)
        self._check_program_edit()
        edited = apply_edits(self.target, self._found, op, new)
        self._used = True
        return become(self.target, edited)

    def _check_driver_patch(self) -> None:
        from ..machine.live import drivers_mid_step

        if self.target in drivers_mid_step():
            raise EditError(f"the driver is running a step (step {self.target.steps}): a patch made by a "
                            "CALL of that run is refused; patch it between steps")
        if self.target.program is not self.program:
            raise EditError(f"the driver's program has changed since these matches of {self.description} "
                            "were found (a patch replaces it): call find() or at() again")

    def _check_program_edit(self) -> None:
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
        _check_not_running(self.target)


def _check_not_running(target: Element) -> None:
    """An edit in place of target is refused while a driver runs it (or runs a step of a program holding it)."""
    from ..machine.live import drivers_mid_step, running_in
    from ..program.printer import describe

    for busy in drivers_mid_step():
        if not busy.done and any(x is target for _, x in walk(busy.program)):
            raise EditError(f"{describe(target)} is part of the program a driver is running a step of "
                            f"(step {busy.steps}): an edit made by a CALL of that run is refused; edit "
                            "between steps (or patch the run through the driver, drv.find(...))")
    live = running_in(target)
    if live is not None:
        drv, where = live
        raise EditError(f"{describe(target)} is running in a driver (step {drv.steps}, at path "
                        f"{where!r}); an edit in place would change it under that run: patch the run "
                        "through the driver (drv.find(...), drv.at(...)), or edit a copy "
                        "(copy.copy(element).find(...))")


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


provide("find", find)  # Element.find(), Driver.find()
provide("at", at)
