"""``flowvm show`` of a state file (flowvm.persist.state): the header, the listing marked with the position and
the registers, read without the program; nothing is imported or restored, and large tensors are hashed but
not kept, so that memory stays bounded whatever the file declares."""

from __future__ import annotations

import sys

from contextlib import contextmanager
from typing import Any, Iterator

from ..base.errors import CheckpointError
from .checkpoint import _key_bytes
from .statedecoder import Decoder
from .statefile import read_state
from .statevalues import numpy_dtype


@contextmanager
def malformed(path: Any, what: str) -> Iterator[None]:
    """Whatever a malformed file makes fail in the block, as a CheckpointError naming the file (the checks
    name the field at fault; this catches what they miss)."""
    try:
        yield
    except CheckpointError:
        raise
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as err:
        raise CheckpointError(path, f"malformed: {what} cannot be read ({type(err).__name__}: "
                                    f"{str(err)[:200]})") from None


def pairs(items: Any, path: Any) -> list:
    if type(items) is not list or not all(type(p) is list and len(p) == 2 and type(p[0]) is str for p in items):
        raise CheckpointError(path, "malformed: the registers cannot be read")
    return items


class SavedObject:
    """Stands for an object's state when a state file is read without its program (``flowvm show``)."""

    def __init__(self, node: dict):
        self.type = str(node.get("type") or next(iter(node), "object"))[:80]

    def __repr__(self) -> str:
        return f"<saved state of a {self.type}>"


class _ShownDecoder(Decoder):
    """Decodes a file's values for ``flowvm show``: objects' states as SavedObject, tensors not read (those
    over SHOW_BYTES) as SavedArray, carrying their shape and dtype."""

    def _array(self, have: Any, node: dict, where: str) -> Any:
        base, _ = self._loaded(node["ndarray"], where)
        return self.keep(node, base) if isinstance(base, SavedArray) else super()._array(have, node, where)

    def _tensor(self, have: Any, node: dict, where: str) -> Any:
        base, _ = self._loaded(node["tensor"], where)
        if isinstance(base, SavedArray) or "torch" not in sys.modules:  # (read as a numpy array: torch not imported)
            return self.keep(node, base)
        return super()._tensor(have, node, where)


class SavedArray:
    """Stands for an array or tensor that ``flowvm show`` does not read: its shape and dtype."""

    def __init__(self, info: dict):
        self.shape = tuple(info["shape"])
        self.dtype = numpy_dtype(info["dtype"]).name if info["kind"] == "numpy" else str(info["dtype"])


_SAVED_KINDS = {"numpy": type("ndarray", (SavedArray,), {}), "torch": type("Tensor", (SavedArray,), {})}
SHOW_BYTES = 1024  # tensors up to this size are read by show_state (a loss, a scalar); larger ones are not
MAX_DEPTH = 1000  # listing rows nest at most this deep


def _placeholder(dec: Decoder, have: Any, node: dict, where: str) -> Any:
    return dec.keep(node, SavedObject(node))


def show_state(path: Any, key: bytes | str | None = None) -> tuple[dict, str, dict]:
    """(header, the listing marked with the position, the registers) of a state file, read without its
    program: objects' states show as SavedObject, arrays and tensors over SHOW_BYTES as their shape and dtype
    (their data is hashed, not kept: memory stays bounded whatever the file says); nothing is imported or
    restored."""
    loaded = read_state(path, _key_bytes(key), keep=SHOW_BYTES)
    tensors = {n: loaded.tensors[n] if n in loaded.tensors else _SAVED_KINDS[info["kind"]](info)
               for n, info in loaded.table.items()}
    with malformed(path, "the saved run"):
        dec = _ShownDecoder(loaded.table, tensors, path, _placeholder)
        parts = loaded.parts
        objects = parts["objects"]
        if type(objects) is not list or not all(type(i) is list and len(i) == 2 for i in objects):
            raise CheckpointError(path, "malformed: the objects table cannot be read")
        for item in objects:
            dec.value(item[1], f"objects/{str(item[0])[:80]}")
        registers = {name: dec.value(node, f"registers/{name}") for name, node in pairs(parts["registers"], path)}
        run, head = parts["run"], loaded.header
        text = _listing(_rows(parts["program"], path), _marks(run, path))
    state = f"finished after {head.get('steps')} steps" if head.get("done") else \
        f"step {head.get('steps')}" + (f", next: path {head['position']!r}" if head.get("position") is not None else "")
    return head, f"# flowvm driver: {state}\n" + text, registers


def _rows(program: Any, path: Any) -> list:
    rows = program.get("listing", []) if type(program) is dict else None
    if type(rows) is not list or not all(
            type(r) is list and len(r) == 3 and (r[0] is None or type(r[0]) is str) and type(r[1]) is int
            and 0 <= r[1] <= min(len(rows), MAX_DEPTH) and type(r[2]) is str and len(r[2]) <= 10_000 for r in rows):
        raise CheckpointError(path, "malformed: the program's listing (flowvm.program's 'listing': rows of "
                                    f"[path, depth 0..{MAX_DEPTH}, text]) cannot be read")
    return rows


def _marks(run: Any, path: Any) -> list:
    marks = run.get("marks", []) if type(run) is dict else None
    if type(marks) is not list or not all(
            type(m) is list and len(m) == 3 and type(m[0]) is str and type(m[1]) is str and len(m[1]) <= 2
            and type(m[2]) is str and len(m[2]) <= 1000 for m in marks):
        raise CheckpointError(path, "malformed: the run's position marks (flowvm.run's 'marks': [path, gutter, "
                                    "comment]) cannot be read")
    return marks


def _listing(rows: list, marks: list) -> str:
    index = {p: k for k, (p, _, _) in enumerate(rows) if p is not None}
    notes: dict[int, tuple] = {}
    for p, gutter, comment in marks:  # as flowvm.program.printer.listing places them
        while p not in index and p:
            p = p.rpartition(".")[0]
        k = index.get(p)
        if k is not None and (k not in notes or (gutter.strip() and not notes[k][0].strip())):
            notes[k] = (gutter, comment or notes.get(k, ("", ""))[1])
    width = 3 if notes else 0
    text = []
    for k, (p, depth, body) in enumerate(rows):
        gutter, comment = notes.get(k, ("", ""))
        text.append(f"{gutter:<{width}}{'    ' * depth}{body}" + (f"  # {comment}" if comment else ""))
    return "\n".join(text)
