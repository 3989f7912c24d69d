"""Element paths: the address every tool uses.

A path is a tuple of child indices from the root, printed as "0.2.1"; the
root's path is ``()``, printed as "" (and shown as "<root>" in messages).
Child indices follow each element's ``children`` tuple.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from .elements import Element

Path = tuple[int, ...]


def format_path(path: Path) -> str:
    return ".".join(map(str, path))


def parse_path(text: str | Path) -> Path:
    if isinstance(text, tuple):
        return text
    if not isinstance(text, str):
        raise TypeError(f"an element path is a str like '0.2.1' or a tuple of child indices, got "
                        f"{type(text).__name__} {text!r:.40}")
    text = text.strip()
    if not text:
        return ()
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        raise ValueError(f"bad element path {text!r}: expected dot-separated child indices like '0.2.1'") from None


def walk(program: Element, path: Path = ()) -> Iterator[tuple[Path, Element]]:
    """Yield (path, element) for every element, parents before children."""
    stack = [(path, program)]
    while stack:
        p, el = stack.pop()
        yield p, el
        children = el.children
        for i in range(len(children) - 1, -1, -1):
            stack.append((p + (i,), children[i]))


def get(program: Element, path: Path | str) -> Element:
    """The element at path."""
    el = program
    path = parse_path(path)
    for depth, i in enumerate(path):
        children = el.children
        if not 0 <= i < len(children):
            raise LookupError(f"no element at path {format_path(path)!r}: "
                              f"{el.kind} at {format_path(path[:depth]) or '<root>'} has {len(children)} children")
        el = children[i]
    return el
