"""The fields of a checkpoint's header (both formats) that the commands read, checked before anything reads
them: a header is covered by a checksum only, which anyone who writes a file can compute."""

from __future__ import annotations

from typing import Any, Callable

from ..base.errors import CheckpointError

MAX_HISTORY_NAMES = 100  # metrics a file's history may name (each is a panel of `flowvm plot`)
LARGEST = 1 << 62


def _text(limit: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is str and len(v) <= limit


def _or_none(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or ok(v)


def _count(v: Any) -> bool:
    return type(v) is int and 1 <= v < LARGEST


# (field, whether a value is as flowvm writes it, what it must be): a field that is there must pass
HEADER_FIELDS = [
    *[(name, _text(200), "a string of at most 200 characters") for name in ("flowvm", "python", "created", "program",
                                                                          "bytecode")],
    ("steps", lambda v: type(v) is int and 0 <= v < LARGEST, "an int >= 0"),
    ("done", lambda v: type(v) is bool, "true or false"),
    ("signed", lambda v: type(v) is bool, "true or false"),
    ("position", _or_none(lambda v: type(v) is str), "a path (a string) or null"),
    ("meta", _or_none(lambda v: type(v) is dict), "an object"),
    ("settings", _or_none(lambda v: type(v) is dict), "an object"),
]
META_FIELDS = [
    *[(name, _or_none(_text(4096)), "a string") for name in ("target", "module", "executor", "scheduler", "versions",
                                                              "data")],
    *[(name, lambda v: type(v) is list and all(_text(4096)(x) for x in v), "a list of strings")
      for name in ("sets", "show")],
    ("every", _or_none(_count), "an int >= 1 or null"),
    ("threads", _or_none(_count), "an int >= 1 or null"),
    ("every_seconds", _or_none(lambda v: type(v) in (int, float) and 0 < v < float("inf")), "a number > 0 or null"),
    ("search", _or_none(lambda v: type(v) is dict), "an object"),
]


def check_header(header: Any, path) -> dict:
    """header (of either file format, read by checking its checksum only: anyone may have written it) after
    checking the type of every field the commands read, the run's meta included; a CheckpointError names
    the first field that is not as flowvm writes it."""
    if type(header) is not dict:
        raise CheckpointError(path, "corrupted: the header is not a JSON object")
    _check_fields(header, HEADER_FIELDS, "", path)
    meta = header.get("meta") or {}
    _check_fields(meta, META_FIELDS, "meta.", path)
    if meta.get("history") is not None:
        _check_history(meta["history"], path)
    return header


def _check_fields(fields: dict, rules: list, prefix: str, path) -> None:
    for name, ok, expected in rules:
        if name in fields and not ok(fields[name]):
            _field(path, prefix + name, expected, fields[name])


def _check_history(history: Any, path) -> None:
    try:
        names, points = history["names"], history["points"]
        if type(names) is not list or len(names) > MAX_HISTORY_NAMES or not all(type(n) is str for n in names):
            raise ValueError(f"names: a list of at most {MAX_HISTORY_NAMES} strings")
        if type(points) is not dict or set(points) != set(names):
            raise ValueError("points: an object of each name's points")
        if not _count(history["every"]) or type(history.get("auto", True)) is not bool:
            raise ValueError("every: an int >= 1, auto: true or false")
        for name, rows in points.items():
            if type(rows) is not list or not all(_point(p) for p in rows):
                raise ValueError(f"points of {name!r:.40}: a list of [step, number or list of numbers]")
    except (TypeError, KeyError, ValueError) as err:
        raise CheckpointError(path, f"corrupted: the header's field 'meta.history' is not as flowvm writes it "
                                    f"({str(err)[:120]})") from None


def _point(p: Any) -> bool:
    """[step, value]: the value a number, null, or a list of numbers and nulls."""
    number = (lambda v: type(v) in (int, float) or v is None)
    return type(p) is list and len(p) == 2 and type(p[0]) is int and (
        number(p[1]) or type(p[1]) is list and all(number(v) for v in p[1]))


def _field(path, name: str, expected: str, got: Any):
    raise CheckpointError(path, f"corrupted: the header's field {name!r} must be {expected}, got "
                                f"{type(got).__name__} {got!r:.40}")
