"""Deterministic toy functions for generated programs (importable, so plain pickle works)."""

P = 1_000_003


def const(v):
    return v


def add(a, b):
    return (a + b) % P


def mix(a, b, k=3):
    return (a * k + b + 1) % P


def inc(a):
    return (a + 1) % P


def pair(a, b):
    return [a, b]


def total(xs):
    return sum(int(x) for x in xs) % P if isinstance(xs, list) else int(xs)


def below(counter, limit):
    """WHILE condition: counts up to limit, then returns 0 (stop) which also resets the counter."""
    return counter + 1 if counter + 1 <= limit else 0


def mod3(a):
    return a % 3


def record(log, value):
    log.append(value)
    return value
