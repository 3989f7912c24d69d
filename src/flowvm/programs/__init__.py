"""Learning algorithms written as flowvm programs, one module each.

Each module has ``build(**options)`` returning a program with sensible
defaults, ``SHOW`` (register names worth showing while it runs) and
``report(registers)`` (a one-paragraph summary of the result).
"""

import numbers as _numbers


def check_options(program: str, counts: dict | None = None, positive: dict | None = None) -> None:
    """Raise ValueError/TypeError naming the program and the option, for counts that are not ints >= 1
    and for numbers that are not > 0 (None allowed: a default chosen later)."""
    for name, value in (counts or {}).items():
        if isinstance(value, bool) or not isinstance(value, _numbers.Integral):
            raise TypeError(f"{program}: {name} must be an int >= 1, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{program}: {name} must be >= 1, got {value}")
    for name, value in (positive or {}).items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, _numbers.Real):
            raise TypeError(f"{program}: {name} must be a number > 0, got {type(value).__name__} {value!r}")
        if not value > 0:
            raise ValueError(f"{program}: {name} must be > 0, got {value}")
