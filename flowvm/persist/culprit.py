"""Where in a run a value is held, for errors that must name it: ``held_at(driver, found)`` walks the registers,
the frames and the value in transit, and gives the first place whose value ``found`` accepts, as a user reads
it: ``registers/loss``, ``registers/history[3]``, ``registers/model.cache``, ``frame of BUFFER at 0.1 (values[2])``.

The walk goes into lists, tuples, dicts, sets and the attributes of plain objects (a module's parameters,
buffers and submodules by their names), a few levels deep, each object once.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from ..program.paths import format_path

__all__ = ["held_at", "places", "unpicklable_at", "program_places", "values_in", "DEPTH"]

DEPTH = 6  # how deep the walk goes into a register's value


def held_at(driver, found: Callable[[Any], bool]) -> str | None:
    """The first place of driver's state whose value found(value) accepts, or None."""
    for where, value in places(driver):
        try:
            if found(value):
                return where
        except Exception:
            continue
    return None


def unpicklable_at(driver, dumps: Callable[[Any], Any], error: BaseException | None = None
                   ) -> tuple[str, Any, BaseException] | None:
    """(where, value, error) for the innermost place of driver's state, or leaf of its program, that
    dumps(value) fails on (a file object inside a logger in a register: ``registers/log.file``), going in
    only while the value inside fails with the same message as the whole (``error``: an object whose own
    reduction explains the refusal is named, not the part of it that does not pickle); None when every
    place pickles alone."""
    found = None
    for where, value in [*places(driver), *program_places(driver.program)]:
        if found is not None and not _inside_of(where, found[0]):
            break  # past the failing value's insides: the innermost failure was found
        try:
            dumps(value)
        except Exception as err:
            if found is None or error is None or str(err) == str(error):
                found = (where, value, err)
    return found


def _inside_of(where: str, outer: str) -> bool:
    return where.startswith(outer) and where[len(outer):len(outer) + 1] in (".", "[", ",", " ")


def program_places(program) -> Iterator[tuple[str, Any]]:
    """(where, value) for what the program's leaves hold beside the registers: each leaf itself, a CALL's
    function, the object its method is bound to, its partial's arguments, the values it closes over, its
    default arguments, and the leaf's own arguments (``CALL at 0.1, function f, default argument 1``)."""
    from ..program.paths import walk

    for path, el in walk(program):
        if el.is_leaf:
            where = f"{el.kind} at {format_path(path) or 'the root'}"
            yield where, el
            yield from _function_places(where, getattr(el, "fn", None))
            for i, arg in enumerate(getattr(el, "args", ()) or ()):
                yield f"{where}, argument {i + 1}", arg


def _function_places(where: str, fn: Any) -> Iterator[tuple[str, Any]]:
    import functools

    while isinstance(fn, functools.partial):
        for i, arg in enumerate(fn.args):
            yield f"{where}, partial argument {i + 1}", arg
        for key, arg in (fn.keywords or {}).items():
            yield f"{where}, partial argument {key}", arg
        fn = fn.func
    if fn is None:
        return
    name = str(getattr(fn, "__qualname__", None) or type(fn).__name__).rsplit("<locals>.", 1)[-1]
    named = f"{where}, function {name}"
    yield named, fn
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type(functools)):
        yield f"{named}, self", owner
    for cell, var in zip(getattr(fn, "__closure__", None) or (), getattr(getattr(fn, "__code__", None), "co_freevars", ())):
        try:
            yield f"{named}, variable {var}", cell.cell_contents
        except ValueError:  # an empty cell
            continue
    for i, default in enumerate(getattr(fn, "__defaults__", None) or ()):
        yield f"{named}, default argument {i + 1}", default


def places(driver) -> Iterator[tuple[str, Any]]:
    """(where, value) for every value of driver's state: registers, frames, the value in transit, and what
    they hold (see the module docstring)."""
    seen: set[int] = set()
    for name, value in dict(driver.registers).items():
        yield from values_in(f"registers/{name}", value, DEPTH, seen)
    state = driver.snapshot()
    from ..machine.layouts import layout_of
    from ..machine.slots import walk

    for path, chain, index, _ in walk(state.frames):
        frame = chain[index]
        el = frame[0]
        layout = layout_of(el)
        names = () if layout is None else layout.slots
        for j, value in enumerate(frame[1:]):
            slot = names[j] if j < len(names) else f"slot {j + 1}"
            yield from values_in(f"frame of {el.kind} at {format_path(path) or 'the root'} ({slot})", value, 3, seen)
    if state.carry is not _nothing():
        yield from values_in("the value passed on by the element that just finished", state.carry, DEPTH, seen)


def _nothing():
    from ..base.sentinels import NOVALUE

    return NOVALUE


_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), type)


def values_in(where: str, value: Any, depth: int, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """(where, value) for value and what it holds (containers' items, objects' attributes), depth levels deep,
    each object once (seen: the ids met so far)."""
    if isinstance(value, _LEAVES):
        return
    if id(value) in seen:
        return
    seen.add(id(value))
    yield where, value
    if depth <= 0 or _opaque(value):
        return
    for sub, item in _parts(value):
        yield from values_in(where + sub, item, depth - 1, seen)


def _opaque(value: Any) -> bool:
    """Values not walked into: arrays and tensors (their elements are no places), functions, modules."""
    module = type(value).__module__ or ""
    return module.startswith(("numpy", "torch._C")) or callable(value) and not hasattr(value, "_parameters") \
        or _is_tensor(value)


def _is_tensor(value: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _parts(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in list(value.items()):
            yield (f"[{key!r}]" if isinstance(key, (str, int)) else f"[a {type(key).__name__} key]"), item
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield f"[{i}]", item
    elif isinstance(value, (set, frozenset)):
        for item in list(value):
            yield f" (an item {type(item).__name__})", item
    else:
        attributes = getattr(value, "__dict__", None)
        if not isinstance(attributes, dict):
            return
        for key, item in list(attributes.items()):
            if key in ("_parameters", "_buffers", "_modules") and isinstance(item, dict):
                for name, sub in list(item.items()):  # a torch module's members by their names
                    yield f".{name}", sub
            else:
                yield f".{key}", item
