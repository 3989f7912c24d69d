"""The fields of a checkpoint's header (both formats) that the commands read, checked before anything reads
them: a header is covered by a checksum only, which anyone who writes a file can compute."""

from __future__ import annotations

from typing import Any

from ..base.errors import CheckpointError

_TEXT = ("flowvm", "python", "created", "program", "bytecode")
MAX_HISTORY_NAMES = 100  # metrics a file's history may name (each is a panel of `flowvm plot`)


def check_header(header: Any, path) -> dict:
    """header (of either file format, read by checking its checksum only: anyone may have written it) after
    checking the type of every field the commands read, the run's meta included; a CheckpointError names
    the first field that is not as flowvm writes it."""
    if type(header) is not dict:
        raise CheckpointError(path, "corrupted: the header is not a JSON object")
    for name in _TEXT:
        if name in header and (type(header[name]) is not str or len(header[name]) > 200):
            _field(path, name, "a string of at most 200 characters", header[name])
    if "steps" in header and (type(header["steps"]) is not int or not 0 <= header["steps"] < 1 << 62):
        _field(path, "steps", "an int >= 0", header["steps"])
    for name in ("done", "signed"):
        if name in header and type(header[name]) is not bool:
            _field(path, name, "true or false", header[name])
    if "position" in header and header["position"] is not None and type(header["position"]) is not str:
        _field(path, "position", "a path (a string) or null", header["position"])
    for name in ("meta", "settings"):
        if name in header and header[name] is not None and type(header[name]) is not dict:
            _field(path, name, "an object", header[name])
    _check_meta(header.get("meta") or {}, path)
    return header


def _check_meta(meta: dict, path) -> None:
    """The fields of the run's meta that the commands read (target, options, intervals, history)."""
    text = (lambda v: type(v) is str and len(v) <= 4096)
    for name in ("target", "module", "executor", "scheduler", "versions"):
        if meta.get(name) is not None and not text(meta[name]):
            _field(path, f"meta.{name}", "a string", meta[name])
    for name in ("sets", "show"):
        if name in meta and (type(meta[name]) is not list or not all(text(v) for v in meta[name])):
            _field(path, f"meta.{name}", "a list of strings", meta[name])
    for name in ("every", "threads"):
        if meta.get(name) is not None and (type(meta[name]) is not int or not 1 <= meta[name] < 1 << 62):
            _field(path, f"meta.{name}", "an int >= 1 or null", meta[name])
    seconds = meta.get("every_seconds")
    if seconds is not None and (type(seconds) not in (int, float) or not 0 < seconds < float("inf")):
        _field(path, "meta.every_seconds", "a number > 0 or null", seconds)
    if meta.get("search") is not None and type(meta["search"]) is not dict:
        _field(path, "meta.search", "an object", meta["search"])
    if meta.get("history") is not None:
        _check_history(meta["history"], path)


def _check_history(history: Any, path) -> None:
    number = (lambda v: type(v) in (int, float))
    try:
        names, points = history["names"], history["points"]
        if type(names) is not list or len(names) > MAX_HISTORY_NAMES or not all(type(n) is str for n in names):
            raise ValueError(f"names: a list of at most {MAX_HISTORY_NAMES} strings")
        if type(points) is not dict or set(points) != set(names):
            raise ValueError("points: an object of each name's points")
        every = history["every"]
        if type(every) is not int or not 1 <= every < 1 << 62 or type(history.get("auto", True)) is not bool:
            raise ValueError("every: an int >= 1, auto: true or false")
        for name, rows in points.items():
            if type(rows) is not list or not all(
                    type(p) is list and len(p) == 2 and type(p[0]) is int and (
                        number(p[1]) or p[1] is None
                        or type(p[1]) is list and all(number(v) or v is None for v in p[1])) for p in rows):
                raise ValueError(f"points of {name!r:.40}: a list of [step, number or list of numbers]")
    except (TypeError, KeyError, ValueError) as err:
        raise CheckpointError(path, f"corrupted: the header's field 'meta.history' is not as flowvm writes it "
                                    f"({str(err)[:120]})") from None


def _field(path, name: str, expected: str, got: Any):
    raise CheckpointError(path, f"corrupted: the header's field {name!r} must be {expected}, got "
                                f"{type(got).__name__} {got!r:.40}")
