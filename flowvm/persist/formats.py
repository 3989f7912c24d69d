"""The checkpoint formats, in one registry: a checkpoint's suffix chooses its format, and its first bytes
tell whether a file is one.

    pickle   (any suffix but those below; ``.ckpt`` by custom)  flowvm.save / load / read_header
             the whole run, code included (checkpoint.py)
    state    ``.safetensors``                                    flowvm.save_state / load_state /
             the run's state only; loaded into the program built   read_state_header (state.py)
             again from code

``format_of(place)`` gives a place's format (a path, a URL or a Location), ``Format.save``, ``.load``,
``.read_header`` its functions (``load`` as the format's own: a state file loads into a program),
``Format.holds_code`` whether the file holds the program (a state file does not: commands build it again),
``Format.check`` refuses a run the format cannot hold before it starts, ``Format.starts_like(first
bytes)`` whether a file looks like one of its files, and ``Format.in_the_way(location)`` what of a file already
at a place must not be replaced silently: ``("unfinished", text)`` for an unfinished run of the format,
``("foreign", text)`` for a file that is none of its, None when nothing is lost.  """

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable

from ..base.errors import CheckpointError
from . import checkpoint, state, storage
from .location import Location

__all__ = ["Format", "FORMATS", "PICKLE", "STATE", "format_of"]


@dataclass(frozen=True)
class Format:
    name: str
    suffixes: tuple[str, ...]  # lower case, with their dot; () for the default format
    holds_code: bool
    save: Callable[..., Any]  # save(driver, place, key=None, meta=None) -> where it went
    load: Callable[..., Any]
    read_header: Callable[..., dict]  # read_header(place, key=None): checked, nothing acted upon
    check: Callable[[Any, Any], Any]  # check(driver, place): raise if the format cannot hold the run
    starts_like: Callable[[bytes], bool]  # whether a file's first bytes (MAGIC_BYTES of them) are this format's
    in_the_way: Callable[[Location], "tuple[str, str] | None"]  # see the module docstring


MAGIC_BYTES = 9  # enough first bytes for every format's starts_like


def _safetensors_start(start: bytes) -> bool:
    """A safetensors file: an 8-byte little-endian header size, then the JSON header."""
    if len(start) < 9:
        return False
    return 2 <= struct.unpack("<Q", start[:8])[0] < 1 << 31 and start[8:9] == b"{"


def _unfinished(loc: Location, header: dict) -> tuple[str, str] | None:
    if header.get("done"):
        return None
    target = (header.get("meta") or {}).get("target") or header.get("program")
    return "unfinished", f"{loc} holds an unfinished run ({target}, step {header.get('steps')})"


def _pickle_in_the_way(loc: Location) -> tuple[str, str] | None:
    try:
        start = storage.read_start(loc, MAGIC_BYTES, missing_ok=True)
    except CheckpointError:
        if loc.url is not None:
            raise  # the store's problem (no bucket, no access): the caller names it
        return None  # a directory or an unreadable path: saving names the problem
    if not start:
        return None
    if not PICKLE.starts_like(start):
        return "foreign", f"{loc} exists and is not a flowvm checkpoint"
    try:
        header = checkpoint.read_header(loc)
    except CheckpointError:
        return None  # a damaged checkpoint: nothing to lose
    return _unfinished(loc, header)


def _state_in_the_way(loc: Location) -> tuple[str, str] | None:
    try:
        header = state.read_state_header(loc)
    except CheckpointError as err:
        if err.reason in ("no such file", "no such object") or err.reason.startswith(("corrupted", "refused")):
            return None  # nothing there, or a damaged flowvm state file
        return "foreign", f"{loc} exists and is not a flowvm state checkpoint ({err.reason})"
    return _unfinished(loc, header)


PICKLE = Format("pickle", (), True, checkpoint.save, checkpoint.load, checkpoint.read_header,
                lambda driver, place: None, lambda start: checkpoint.MAGIC.startswith(start[:len(checkpoint.MAGIC)]), _pickle_in_the_way)
STATE = Format("state", (state.SUFFIX,), False, state.save_state, state.load_state, state.read_state_header,
               state.collect, _safetensors_start, _state_in_the_way)
FORMATS: list[Format] = [STATE, PICKLE]  # the default last


def format_of(place: Any) -> Format:
    """The format of a checkpoint place (a path, a URL or a Location), chosen by its suffix."""
    name = Location.of(place).name.lower()
    for fmt in FORMATS:
        if not fmt.suffixes or name.endswith(fmt.suffixes):
            return fmt
    raise AssertionError("the default format is missing")  # pragma: no cover
