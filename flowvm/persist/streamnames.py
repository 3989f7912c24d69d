"""The names a pickle stream would import, read without unpickling anything (``names_in``): what loading a
checkpoint would look up and call, for ``flowvm.persist.checkpoint.imports`` and the checks of untrusted files."""

from __future__ import annotations

from typing import Any


def names_in(stream: bytes) -> set[tuple[str, str]]:
    """The (module, name) pairs a pickle stream imports, read without unpickling anything (the globals
    that loading it would look up and call)."""
    import pickletools

    found: set[tuple[str, str]] = set()
    memo: dict[int, Any] = {}
    pushed: list[Any] = []  # what each opcode pushed: a string, or None for anything else
    for op, arg, _ in pickletools.genops(bytes(stream)):
        name = op.name
        if name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            pushed.append(arg)
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = pushed[-1] if pushed else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            pushed.append(memo.get(arg))
        elif name == "STACK_GLOBAL":
            module, qualname = pushed[-2], pushed[-1]
            found.add((module if isinstance(module, str) else "?", qualname if isinstance(qualname, str) else "?"))
            pushed.append(None)
        elif name in ("GLOBAL", "INST"):
            module, _, qualname = arg.partition(" ")
            found.add((module, qualname))
            pushed.append(None)
        elif op.stack_after:
            pushed.append(None)
    return found
