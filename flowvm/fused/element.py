"""The FUSED element (several torch CALLs run as one step, see flowvm.passes.fuse_torch), its settings, and
which functions may be fused (``fusable``)."""

from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping


from ..pickled import stable
from ..program.elements import CALL, SEQ, Element
from ..program.registers import Register, iter_registers
from .runtime import Runtime

FORMS = ("auto", "compiled", "eager")

# torch callables that cannot be traced into a graph, or only make sense run eagerly
NEVER_TENSOR = {"backward", "item", "tolist", "numpy", "register_hook", "data_ptr", "storage",  # (statements.py too)
                "untyped_storage", "share_memory_", "__repr__", "__str__", "__format__", "__reduce_ex__",
                "__setstate__", "__getstate__", "retain_grad", "pin_memory"}
_NEVER_TORCH = {"manual_seed", "seed", "initial_seed", "set_rng_state", "get_rng_state", "save", "load",
                "compile", "set_grad_enabled", "no_grad", "enable_grad", "inference_mode", "set_default_dtype",
                "use_deterministic_algorithms", "set_num_threads", "set_printoptions", "is_grad_enabled"}

_MARK = "__flowvm_fusable__"


def fusable(fn: Callable | None = None, enabled: bool = True):
    """Mark fn as fusable (a decorator): the fuse-torch pass may put its CALLs in a fused step.

    The function must be traceable by ``torch.compile`` (torch operations on
    its arguments, no side effects outside them).  ``fusable(fn, False)``
    excludes a function that would otherwise count as fusable.  A callable
    that takes no attributes (a bound method, a builtin) is wrapped in a
    ``functools.partial`` that carries the mark.

    >>> import torch
    >>> @fusable
    ... def gelu2(x):
    ...     return torch.nn.functional.gelu(x) * 2
    >>> is_fusable(gelu2)
    True
    """
    if fn is None:
        return lambda f: fusable(f, enabled)
    if not callable(fn):
        raise TypeError(f"fusable: expected a callable, got {type(fn).__name__} {fn!r:.60}")
    try:
        setattr(fn, _MARK, bool(enabled))
        return fn
    except (AttributeError, TypeError):
        wrapped = functools.partial(fn)
        setattr(wrapped, _MARK, bool(enabled))
        return wrapped


def is_fusable(fn: Any) -> bool:
    """Whether a CALL of fn may go into a fused torch step (see the module docstring)."""
    mark = getattr(fn, _MARK, None) if not isinstance(fn, type) else None
    if mark is not None:
        return bool(mark)
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if isinstance(fn, torch.nn.Module):
        return True
    if isinstance(fn, functools.partial):
        return is_fusable(fn.func)
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        return False
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.Tensor) or getattr(torch.Tensor, name, None) is fn:
        return name not in NEVER_TENSOR
    if name in _NEVER_TORCH:
        return False
    for ns in (torch, torch.nn.functional, torch.linalg, torch.special, torch.fft):
        if getattr(ns, name, None) is fn:
            return True
    # builtins of torch's C namespaces (torch.linalg.norm is torch._C._linalg.linalg_norm)
    return isinstance(fn, types.BuiltinFunctionType) and getattr(fn, "__module__", None) in _C_NAMESPACES


_C_NAMESPACES = {"torch", "torch._C._nn", "torch._C._linalg", "torch._C._special", "torch._C._fft"}


@stable("flowvm.pickled")
@dataclass(frozen=True)
class FuseSettings:
    """How a FUSED element compiles and chooses its form.

    - ``backend``, ``mode``, ``options``, ``dynamic``: passed to ``torch.compile``
      (``fullgraph=True`` always: a graph break falls back to eager).  For the
      inductor backend ``options`` defaults to ``{"fallback_random": True}``, so
      compiled code draws the same random numbers from the same global torch
      generator as eager code, and a run may switch forms without changing them.
    - ``form``: "auto" (time both, keep the faster), "compiled" or "eager".
    - ``background``: compile in the background while running eagerly
      (False: the first execution waits for the compile; use it in tests).
    - ``compile_in``: where a background inductor compile runs.  "process"
      (the default): a step over plain CPU tensors (no modules, no autograd,
      no tensor constants, no in-place, view or random ops) compiles with
      AOTInductor in a child process at a lower priority, so the program's
      interpreter never runs the compiler and never stalls for it; other
      steps compile on the background thread.  "thread": always the thread.
    - ``trials``: executions timed per form before deciding; ``margin``: how
      much faster (a fraction) compiled code must be to be kept.
    - ``max_compiles``: compiles per element (new input shapes need new ones);
      beyond that, inputs the compiled code rejects run eagerly.
    - ``compile_after``: with ``form="auto"`` and ``background``, seconds the
      step first spends running eagerly before its compile starts.  A cold
      compile takes 10-20 s of CPU that the running program shares, so only a
      step that has proved long-lived pays for it; short runs never compile.
    - ``payback``: with ``form="auto"``, ``background`` and the inductor backend, a
      compile starts only if the executions the run has left, as far as the
      REPEATs around the step tell, run at least ``payback`` times as long as the
      compile is expected to take (its first compile in a process: about 20 s
      with the compiler's imports; later ones: as long as those before).  0: no
      such check.  A step inside a LOOP or WHILE (no known end) is not checked.
    """

    backend: Any = "inductor"
    mode: str | None = None
    options: tuple = ()
    dynamic: bool | None = False
    form: str = "auto"
    background: bool = True
    compile_in: str = "process"
    trials: int = 10
    margin: float = 0.02
    max_compiles: int = 4
    compile_after: float = 20.0
    payback: float = 20.0

    def __post_init__(self):
        _number("payback", self.payback, "a number >= 0")
        _number("compile_after", self.compile_after, "a number of seconds >= 0")
        if self.compile_in not in ("process", "thread"):
            raise ValueError(f"fuse-torch: compile_in must be 'process' or 'thread', got {self.compile_in!r}")
        if self.form not in FORMS:
            raise ValueError(f"fuse-torch: form must be one of {', '.join(FORMS)}, got {self.form!r}")
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise TypeError(f"fuse-torch: backend must be a name or a callable, got {type(self.backend).__name__}")
        if self.backend != "inductor" and (self.mode is not None or self.options):
            raise ValueError("fuse-torch: mode and options apply to the inductor backend only")
        _number("trials", self.trials, "an int >= 1", integer=True)
        _number("max_compiles", self.max_compiles, "an int >= 1", integer=True)
        if not 0 <= self.margin < 1:
            raise ValueError(f"fuse-torch: margin must be in [0, 1), got {self.margin!r}")

    @classmethod
    def make(cls, options: Mapping | None = None, **kw: Any) -> "FuseSettings":
        backend = kw.get("backend", "inductor")
        if options is None:
            options = {"fallback_random": True} if backend == "inductor" else {}
        return cls(options=tuple(sorted(dict(options).items())), **kw)

    @property
    def backend_name(self) -> str:
        return self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")


@stable("flowvm")
class FUSED(Element):
    """One step that runs several CALLs through one generated, optionally torch.compile'd function.

    ``calls`` are the CALL elements it replaced, ``origins`` their paths in
    the program before optimization.  It reads ``inputs`` (the registers the
    calls read before writing them) and writes ``outputs`` (every register
    they write); its value is the last call's.
    """

    kind = "FUSED"
    is_leaf = True

    def __init__(self, calls: Iterable[CALL], origins: Iterable[str] | None = None,
                 settings: FuseSettings | None = None):
        calls = tuple(calls)
        if not calls:
            raise ValueError("FUSED: needs at least one CALL")
        for i, c in enumerate(calls):
            if type(c) is not CALL:
                raise TypeError(f"FUSED: call {i} must be a CALL, got {type(c).__name__}")
        origins = tuple(origins) if origins is not None else tuple("" for _ in calls)
        if len(origins) != len(calls):
            raise ValueError(f"FUSED: {len(origins)} origins for {len(calls)} calls")
        settings = settings if settings is not None else FuseSettings.make()
        if not isinstance(settings, FuseSettings):
            raise TypeError(f"FUSED: settings must be FuseSettings, got {type(settings).__name__}")
        inputs: dict[str, Register] = {}
        outputs: dict[str, Register] = {}
        for c in calls:
            for r in list(iter_registers(c.args)) + list(iter_registers(c.kwargs)):
                if r.name not in outputs:
                    inputs.setdefault(r.name, r)
            if c.store_to is not None:
                outputs.setdefault(c.store_to.name, c.store_to)
        self._init(calls=calls, origins=origins, settings=settings,
                   inputs=tuple(inputs.values()), outputs=tuple(outputs.values()))

    # -- analysis (verify, reads/writes)
    def own_reads(self) -> list[Register]:
        return list(self.inputs)

    def own_writes(self) -> list[Register]:
        return list(self.outputs)

    # -- running: the leaf protocol
    def runtime(self) -> Runtime:
        """The live state (functions, compiled code, timings): a cache, dropped when pickled."""
        return self._cached("runtime", lambda: Runtime(self))

    simple_leaf = True  # one step, never pending: the driver's fast paths run it

    def leaf_for(self, regs: dict) -> Callable[[], Any]:
        return self.runtime().leaf(regs)

    # -- printing
    def header_text(self) -> str:
        rt = self.__dict__.get("_c_runtime")
        s = self.settings
        if s.form == "eager":
            status = "eager (forced)"
        elif rt is None:
            status = "compiled (forced), not run yet" if s.form == "compiled" else "auto, not run yet"
        else:
            status = rt.status()
        return f"FUSED {len(self.calls)} calls, torch.compile({s.backend_name}): {status}:"

    def detail_lines(self) -> list[str]:
        from ..program.printer import call_text

        return [f"{call_text(c)}  # was {o or '<root>'}" for c, o in zip(self.calls, self.origins)]

    def with_form(self, form: str) -> "FUSED":
        """The same fused step with its form set to "auto", "compiled" or "eager"."""
        return FUSED(self.calls, self.origins, replace(self.settings, form=form))

    def unfused(self) -> SEQ:
        """The CALLs this element replaced, as a SEQ."""
        return SEQ(self.calls)

    def __flowvm_source__(self):
        """(constructor, args, kwargs) rebuilding this element (flowvm.to_source, flowvm.isolate)."""
        defaults = FuseSettings.make(backend=self.settings.backend)
        kwargs: dict[str, Any] = {"origins": list(self.origins)}
        for name in ("backend", "mode", "options", "dynamic", "form", "background", "compile_in", "trials", "margin",
                     "max_compiles", "compile_after", "payback"):
            value = getattr(self.settings, name)
            if value != getattr(defaults, name):
                kwargs[name] = dict(value) if name == "options" else value
        return fused_step, tuple(self.calls), kwargs


def fused_step(*calls: CALL, origins: Iterable[str] | None = None, options: Mapping | None = None,
               **settings: Any) -> FUSED:
    """A FUSED element from its calls and fuse-torch options (the form ``flowvm.to_source`` writes)."""
    return FUSED(calls, origins, FuseSettings.make(options, **settings))


def _number(name: str, value: Any, what: str, integer: bool = False) -> None:
    """Refuse an option that is not a number (an int with integer; never a bool) at least 0 (1 with integer)."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value >= (1 if integer else 0):
        raise ValueError(f"fuse-torch: {name} must be {what}, got {value!r}")
