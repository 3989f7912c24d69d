"""Hot patches: the edits of ``flowvm.editing.edit`` applied to a half-run driver, in place.

The driver's frames (see ``flowvm.machine.driver``) hold the elements they run and
counters that index children (a SEQ's position, a SWITCH's case, a WEAVE's
turn).  A patch edits the program and remaps every frame, on the main stack
and in the paused segments of WEAVE frames, to the edited tree:

- an element that has **started** (a container with a frame in progress, a
  leaf that is polling) cannot be replaced or removed: ``EditError`` names it.
  Editing *inside* it is fine (add a hook to the body of a running loop), and
  so is inserting before or after it;
- the driver sits just before the element it will run next, which has not
  started: it can be replaced or removed; an element inserted before it
  runs next, and so does one inserted after the element that just finished
  when both are children of one SEQ (in a loop body that just finished an
  iteration, an element inserted after the body runs after its next one).
  After a leaf the driver enters the containers on its way to the next leaf
  (``Driver.unstarted_from`` marks them); none of their steps has run, so for a patch
  they have not started: their frames are rewound and entered again by the
  next step;
- an element inserted before a started element runs from its next
  activation on; one inserted after it runs when it finishes;
- a SEQ's position moves with its running child when siblings are inserted
  or removed before it; wrapping a started element in a SEQ adds that SEQ's
  frame around its frames;
- a child of a running WEAVE can be removed only while it waits for its
  first turn (its slots in the WEAVE's per-child lists go with it); a
  finished or started child is refused: replace it with ``SEQ([])`` instead.

The patch is all or nothing: refusals and verification of the edited
program (against the driver's registers, all references bound to them)
happen before the driver changes.  The driver's caches (the bound next leaf,
the fast REPEAT frame) are dropped, so the next step runs the edited program.
"""

from __future__ import annotations

from typing import Any

from ..machine.driver import Driver
from ..machine import frames as F
from ..machine.frames import ELEMENT, WEAVE_FINISHED, WEAVE_SEGMENTS
from ..machine.frames import walk as walk_frames
from ..machine.layouts import layout_of
from .edit import EditError, Match, NoFrames, carry_overrides, edit_tree
from ..program.elements import Element, provide
from ..program.paths import Path, format_path, get, walk


class _Frame:
    """A working copy of one frame: ``orig`` (the driver's list, None for a new frame) and ``data``."""

    __slots__ = ("orig", "data")

    def __init__(self, orig: list | None, data: list):
        self.orig = orig
        self.data = data


def _describe(el: Element, path: Path) -> str:
    from ..program.printer import describe

    return f"{describe(el)} at path {format_path(path) or '<root>'!r}"


class DriverFrames(NoFrames):
    """Keeps a working copy of a driver's frames in step with the edits of ``edit_tree``."""

    def __init__(self, drv: Driver):
        self.drv = drv
        stack = drv.frames
        fresh = drv.unstarted_from
        if fresh is not None and fresh < len(stack) - 1:
            # The last settle entered these containers on its way to the next leaf, and none of
            # them has taken a step: the patch sees them as not started (the next step enters
            # them again), so an element inserted before them runs first.
            self.main = [self._copy(fr) for fr in stack[:fresh]] + [_Frame(stack[fresh], [stack[fresh][ELEMENT]])]
        else:
            self.main = [self._copy(fr) for fr in stack]

    def _copy(self, fr: list) -> _Frame:
        return _Frame(fr, F.copy_frame(fr, lambda seg: [self._copy(s) for s in seg]))

    def started(self, f: _Frame) -> bool:
        if len(f.data) > 1:
            return True
        return f.data[ELEMENT].is_leaf and f.orig is not None and id(f.orig) in self.drv.live

    def chains(self) -> list[tuple[Path, list, int]]:
        """(path, chain, index) of every frame: the main stack and the WEAVE segments."""
        return [(path, chain, k) for path, chain, k, _ in walk_frames(self.main, key=lambda f: f.data)]

    def locate(self, path: Path) -> tuple[list, int] | None:
        for p, chain, k in self.chains():
            if p == path:
                return chain, k
        return None

    # -- the listener interface of edit_tree
    def replace(self, path: Path, old: Element, new: Element, verb: str = "replace") -> None:
        loc = self.locate(path)
        if loc is None:
            return
        chain, k = loc
        f = chain[k]
        if self.started(f):
            raise EditError(f"cannot {verb} {_describe(f.data[ELEMENT], path)}: it is running "
                            f"(driver at step {self.drv.steps}); edit the elements inside it, "
                            "or insert before or after it", format_path(path))
        F.set_element(f.data, new)

    def seq_insert(self, seq_path: Path, index: int, items: list) -> None:
        loc = self.locate(seq_path)
        if loc is None:
            return
        chain, k = loc
        f = chain[k]
        if len(f.data) == 1:
            return  # not started: it starts on the edited children
        pos = F.seq_position(f.data)
        if pos > index:
            F.set_seq_position(f.data, pos + len(items))
        elif pos == index:
            child = chain[k + 1] if k + 1 < len(chain) else None
            if child is not None and not self.started(child):
                F.set_element(child.data, items[0])  # the driver sits just before it: the inserted elements run next
            else:
                F.set_seq_position(f.data, pos + len(items))

    def seq_delete(self, seq_path: Path, index: int, children: list) -> None:
        loc = self.locate(seq_path)
        if loc is None:
            return
        chain, k = loc
        f = chain[k]
        if len(f.data) == 1:
            return
        pos = F.seq_position(f.data)
        if pos > index:
            F.set_seq_position(f.data, pos - 1)
        elif pos == index:
            child = chain[k + 1] if k + 1 < len(chain) else None
            path = seq_path + (index,)
            if child is None:
                F.set_seq_position(f.data, index - 1)  # it finished: its value goes on to the next one
            elif self.started(child):
                raise EditError(f"cannot remove {_describe(child.data[ELEMENT], path)}: it is running "
                                f"(driver at step {self.drv.steps})", format_path(path))
            elif index + 1 < len(children):
                F.set_element(child.data, children[index + 1])
            else:
                raise EditError(f"cannot remove {_describe(child.data[ELEMENT], path)}: the driver is about to run "
                                "it and it is the last element of its SEQ, whose value it gives; "
                                "replace it with another element instead", format_path(path))

    def wrap(self, path: Path, wrapper: Element, index: int) -> None:
        loc = self.locate(path)
        if loc is None:
            return
        chain, k = loc
        f = chain[k]
        if self.started(f):
            chain.insert(k, _Frame(None, F.seq_frame(wrapper, index)))
        else:
            F.set_element(f.data, wrapper)

    def weave_delete(self, weave_path: Path, index: int, child: Element) -> None:
        loc = self.locate(weave_path)
        if loc is None:
            return
        chain, k = loc
        data = chain[k].data
        if len(data) == 1:
            return  # not started: it starts on the edited children
        path = weave_path + (index,)
        segs = data[WEAVE_SEGMENTS]
        seg = segs[index]
        if data[WEAVE_FINISHED][index]:
            raise EditError(f"cannot remove {_describe(child, path)}: it has finished and its value is part of "
                            "its running WEAVE's result; replace it with SEQ([]) instead", format_path(path))
        if seg is None or len(seg) != 1 or self.started(seg[0]):
            raise EditError(f"cannot remove {_describe(child, path)}: it is running (a child of a running WEAVE, "
                            f"driver at step {self.drv.steps})", format_path(path))
        F.weave_drop_child(data, index)  # an unstarted child waiting for its first turn

    # -- commit
    def resolve(self, program: Element) -> None:
        """Point every frame at its element in the edited program, checking that running ones kept their kind."""
        for path, chain, k in self.chains():
            f = chain[k]
            try:
                el = get(program, path)
            except LookupError:  # pragma: no cover - an edit that lost a frame's element
                raise EditError(f"internal error: no element at path {format_path(path)!r} for a running frame",
                                format_path(path)) from None
            old = f.data[ELEMENT]
            if old.is_leaf and el is not old and self.started(f):
                raise EditError(f"cannot edit inside {_describe(old, path)}: it is running "
                                f"(driver at step {self.drv.steps})", format_path(path))
            if len(f.data) > 1:
                kind = old.frame_kind  # a frame's layout: its kind's (a subclass of a kind is that kind)
                segments = getattr(layout_of(old), "segments", None)  # paused children's frames, one per child
                if (type(el) is not type(old) if kind is None else el.frame_kind is not kind) \
                        or (segments is not None and len(el.children) != len(f.data[segments])):
                    raise EditError(f"cannot patch: {_describe(old, path)} is running and would become "
                                    f"{_describe(el, path)}", format_path(path))
            F.set_element(f.data, el)

    def materialize(self, chain: list) -> list[list]:
        return [F.overwrite(f.orig if f.orig is not None else [], F.copy_frame(f.data, self.materialize))
                for f in chain]


def patch_driver(drv: Driver, found: list[Match], op: str, new: Any) -> Driver:
    """Apply an edit to drv's program and frames in place (all or nothing); return drv."""
    from ..program.analysis import register_files
    from ..program.verify import verify

    frames = DriverFrames(drv)
    program = edit_tree(drv.program, found, op, new, frames)
    for file in register_files(program):
        if file is not drv.registers:
            names = sorted({r.name for _, el in walk(program) for r in el.own_reads() + el.own_writes()
                            if r.file is file})
            raise EditError(f"the patch uses registers {', '.join(map(repr, names[:3]))} of another register file; "
                            "build it with the driver's: reg = drv.registers; reg('name')")
    frames.resolve(program)
    verify(program, drv.registers)
    program = carry_overrides(drv.program, program)
    drv.replace_frames(frames.materialize(frames.main), program)  # the commit
    return drv


provide("patch_driver", patch_driver)  # edits made through Driver.find() and Driver.at()
