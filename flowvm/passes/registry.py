"""The pass registry and the pipeline runner behind ``flowvm.optimize`` (see the package docstring)."""

from __future__ import annotations

import contextvars
import copy
import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from ..program.elements import Element
from ..base.errors import PassError, UnknownPassError, VerifyError

__all__ = [
    "Pass", "PassError", "PassContext", "optimize", "register_pass", "unregister_pass", "get_pass",
    "list_passes", "DEFAULT_PIPELINE", "current_context",
]


@dataclass(frozen=True)
class Pass:
    """A named Program -> Program rewrite.

    ``run(program, **options)`` returns the new program (or the same object
    when it changes nothing); it must never modify its input.
    """

    name: str
    run: Callable[..., Element]
    description: str = ""
    default: bool = False

    def __call__(self, program: Element, **options: Any) -> Element:
        return self.run(program, **options)

    def __str__(self) -> str:
        return f"{self.name}: {self.description}" if self.description else self.name


@dataclass
class PassContext:
    """What a pass may know about the pipeline it runs in (``current_context()``).

    ``original`` is the program given to optimize; ``origin(el, path)`` is the
    path an element had in it, as text (passes keep leaves as the same objects,
    so a leaf is found by identity; one used at several places gives them all,
    "1.0 or 1.2"), else ``path`` (an element a pass made).
    """

    original: Element
    pass_name: str = ""
    _paths: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        from ..program.paths import walk

        seen: dict[int, list] = {}
        for path, el in walk(self.original):
            seen.setdefault(id(el), []).append(path)
        self._paths = seen

    def origin(self, el: Element, path: tuple[int, ...]) -> str:
        from ..program.paths import format_path

        found = self._paths.get(id(el)) or [path]
        return " or ".join(format_path(p) or "<root>" for p in found)


_CONTEXT: contextvars.ContextVar[PassContext | None] = contextvars.ContextVar("flowvm_pass_context", default=None)


def current_context() -> PassContext | None:
    """The PassContext of the optimize() call running now (None outside optimize)."""
    return _CONTEXT.get()


_REGISTRY: dict[str, Pass] = {}


def summary(fn: Callable) -> str:
    """A pass's description from its docstring: the first paragraph, on one line."""
    return " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split())


def register_pass(name: str, fn: Callable[..., Element] | None = None, *, description: str | None = None,
                  default: bool = False, replace: bool = False):
    """Register fn under name (usable as a decorator); returns fn.

    ``default=True`` appends the pass to the default pipeline.  Registering
    a name twice raises ValueError unless ``replace=True``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a pass name must be a non-empty str, got {name!r}")

    def add(f: Callable[..., Element]) -> Callable[..., Element]:
        if not callable(f):
            raise TypeError(f"pass {name!r}: expected a function program -> program, got {type(f).__name__}")
        if name in _REGISTRY and not replace:
            raise ValueError(f"a pass named {name!r} is already registered (pass replace=True to override)")
        doc = description if description is not None else summary(f)
        _REGISTRY[name] = Pass(name, f, doc, default)
        if default and name not in DEFAULT_PIPELINE:
            DEFAULT_PIPELINE.append(name)
        return f

    return add(fn) if fn is not None else add


def unregister_pass(name: str) -> None:
    """Remove a registered pass (and drop it from the default pipeline)."""
    get_pass(name)
    del _REGISTRY[name]
    while name in DEFAULT_PIPELINE:
        DEFAULT_PIPELINE.remove(name)


def get_pass(name: str) -> Pass:
    """The registered pass called name; KeyError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownPassError(f"no optimizer pass named {name!r}; known passes: {', '.join(_REGISTRY)}",
                               str(name)) from None


def list_passes() -> list[Pass]:
    """Every registered pass, in registration order."""
    return list(_REGISTRY.values())


DEFAULT_PIPELINE: list[str] = []
"""Names of the passes optimize() runs when no ``passes`` are given, in order."""




def _resolve(spec: Any) -> tuple[Pass, dict]:
    options: dict = {}
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], Mapping):
        spec, options = spec[0], dict(spec[1])
    if isinstance(spec, str):
        return get_pass(spec), options
    if isinstance(spec, Pass):
        return spec, options
    if callable(spec):
        name = getattr(spec, "__name__", type(spec).__name__)
        return Pass(name, spec, summary(spec)), options
    raise TypeError(f"optimize: a pass must be a registered name, a Pass, a function program -> program or "
                    f"(pass, options), got {type(spec).__name__} {spec!r:.60}")


def optimize(program: Element, passes: Iterable[Any] | None = None, debug: bool = False,
             options: Mapping[str, Mapping[str, Any]] | None = None, explain: bool = False) -> Element:
    """Run the passes (default: ``DEFAULT_PIPELINE``) over program and return the new program.

    ``passes`` items are registered names, Pass objects, functions
    ``program -> program``, or ``(pass, {option: value})`` pairs.
    ``options`` maps a pass name to keyword options for it (merged under the
    pair's own).  With ``debug=True`` the program is verified before the
    first pass and after each one; a failure raises PassError naming the pass
    and the faulty path.  An exception inside a pass gets a note naming it.  With ``explain=True`` it prints
    why fuse-torch fused each run of torch CALLs and why not the other CALLs (flowvm.passes.explain).
    """
    if not isinstance(program, Element):
        raise TypeError(f"optimize expects a flowvm program (an element), got {type(program).__name__}")
    if isinstance(passes, (str, Pass)):
        passes = [passes]
    resolved = [_resolve(s) for s in (DEFAULT_PIPELINE if passes is None else passes)]
    _check_pipeline_options(options, resolved)
    if debug:
        _verify(program, "<input>", "the program given to optimize does not verify")
    ctx = PassContext(program)
    token = _CONTEXT.set(ctx)
    try:
        current = program
        for p, opts in resolved:
            merged = {**dict((options or {}).get(p.name, {})), **opts}
            ctx.pass_name = p.name
            _check_options(p, merged)
            current = _run_pass(p, current, merged, debug)
        if explain:
            from .explain import explain_fusion

            print(explain_fusion(program))
        # a new program even when no pass changed anything: editing it leaves the original alone
        return copy.copy(current) if current is program else current
    finally:
        _CONTEXT.reset(token)


def _check_pipeline_options(options: Any, resolved: list) -> None:
    """options maps names of passes in the pipeline to mappings of options."""
    if options is not None and not (isinstance(options, Mapping)
                                    and all(isinstance(v, Mapping) for v in options.values())):
        raise TypeError("optimize: options must map a pass name to its options, like "
                        f"{{'fuse-torch': {{'compile_after': 5}}}}; got {options!r:.80}")
    known = {p.name for p, _ in resolved}
    for name in options or {}:
        if name not in known:
            raise UnknownPassError(f"optimize: options given for pass {name!r}, which is not in the pipeline "
                                   f"({', '.join(p.name for p, _ in resolved) or 'empty'})", str(name))


def _run_pass(p: Pass, current: Element, options: dict, debug: bool) -> Element:
    """The program pass p makes of current (checked, with debug, to be new and to verify)."""
    before = str(current) if debug else None
    try:
        new = p.run(current, **options)
    except Exception as err:
        err.add_note(f"flowvm: in optimizer pass {p.name!r}")
        raise
    if not isinstance(new, Element):
        raise PassError(f"pass {p.name!r} returned {type(new).__name__}, not a flowvm program", p.name)
    if debug:
        if str(current) != before:
            raise PassError(f"pass {p.name!r} changed the program it was given in place; a pass must "
                            "return a new program (edit a copy: copy.copy(program).find(...))", p.name)
        _verify(new, p.name, f"pass {p.name!r} produced a program that does not verify")
    return new


def _check_options(p: Pass, options: Mapping[str, Any]) -> None:
    """Reject an option the pass does not take, naming the pass and what it does take."""
    if not options:
        return
    try:
        params = inspect.signature(p.run).parameters
    except (TypeError, ValueError):  # pragma: no cover - a callable without a signature
        return
    if any(q.kind is q.VAR_KEYWORD for q in params.values()):
        return
    takes = [n for n, q in list(params.items())[1:] if q.kind in (q.KEYWORD_ONLY, q.POSITIONAL_OR_KEYWORD)]
    for name in options:
        if name not in takes:
            close = difflib.get_close_matches(name, takes, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"optimize: pass {p.name!r} has no option {name!r} (it takes: "
                            f"{', '.join(takes) or 'none'}){hint}")


def _verify(program: Element, name: str, what: str) -> None:
    from ..program.verify import verify

    try:
        verify(program)
    except VerifyError as err:
        raise PassError(f"{what}: {err}", name, err.path, err.register) from err


# the built-in passes register themselves on import, in pipeline order
