"""Every call of flowvm into torch's internals (dynamo, inductor, AOTAutograd, export, make_fx, torch._C):
the one place that changes when torch changes them (tests/fused/test_torch_internals.py checks that no other
module of flowvm names them).

What each function returns is flowvm's own (plain values and dataclasses), so the rest of fused/ does not
depend on the shape of torch's objects.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from typing import Any, Callable

_DYNAMO_SCOPE_PREFIX = "___unnamed_scope_"  # torch >= 2.14: a function's globals not those of a module


@dataclasses.dataclass
class GuardRead:
    """One of dynamo's guards: its kind, its source (an expression over the step's globals ``G``), the value
    dynamo read there (when it could), and the keyword arguments of its check (``attr``, ``key``,
    ``source_b``: the other source of a duplicate input)."""
    kind: str
    source: str
    has_value: bool
    value: Any
    keywords: dict


@dataclasses.dataclass
class DynamoTrace:
    """What dynamo saw tracing a step as one graph: its guards, the objects of the program the step
    changed (descriptions), and the globals of the traced frame (dynamo's own among them)."""
    guards: list[GuardRead]
    changed: list[str]
    scope: dict


def dynamo_trace(fn: Callable, inputs: list, grad: bool) -> DynamoTrace:
    """Trace ``fn(*inputs)`` with dynamo as one graph (``fullgraph``), without compiling it; raises what
    dynamo raises when it cannot."""
    import torch
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch._dynamo.variables.base import AttributeMutationNew, ValueMutationNew

    entries: list = []
    found: dict[str, Any] = {}

    def keep(given):
        entries.extend(given)
        return [True] * len(given)

    def backend(gm, example_inputs):
        output = InstructionTranslator.current_tx().output
        effects = output.side_effects
        found["changed"] = [str(v) for v in effects.id_to_variable.values()
                            if not isinstance(v.mutation_type, (AttributeMutationNew, ValueMutationNew))
                            and effects.is_modified(v)]
        found["scope"] = dict(output.global_scope)
        return gm.forward

    torch._dynamo.reset()
    try:
        traced = torch._dynamo.optimize(backend, nopython=True, guard_filter_fn=keep)(fn)
        # an LSTM is torch's own code, compiled by AOTAutograd as in the steps with modules only
        with torch.set_grad_enabled(grad), torch._dynamo.config.patch(allow_rnn=True):
            traced(*inputs)
    finally:
        torch._dynamo.reset()
    guards = [GuardRead(e.guard_type, e.orig_guard.name, bool(e.has_value), e.value if e.has_value else None,
                        dict(getattr(e.orig_guard.create_fn, "keywords", None) or {})) for e in entries]
    return DynamoTrace(guards, found.get("changed", []), found.get("scope", {}))


def is_globals_scope(name: str) -> bool:
    """Whether a global dynamo installed for its guards is the globals of a function that are not those of an
    imported module (torch 2.14 reads such a function's globals as they are, under this name; 2.13 reads
    them through ``sys.modules`` by the module's name)."""
    return name.startswith(_DYNAMO_SCOPE_PREFIX)



# ------------------------------------------------------------------------------------ torch's C side
def torch_c() -> Any:
    import torch

    return torch._C


def tensor_base() -> type:
    import torch

    return torch._C.TensorBase


def is_op_overload(fn: Any) -> bool:
    """Whether fn is one of torch's operators (``torch.ops.aten.sin.default`` or its packet)."""
    import torch

    return isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def aoti_loadable() -> bool:
    """Whether this torch loads AOTInductor packages."""
    import torch

    return hasattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader")


# ------------------------------------------------------------------------------------ settings of the moment
def autocast_enabled() -> bool:
    import torch

    return torch._C._is_any_autocast_enabled()


def mode_depths() -> tuple[Callable[[], int], Callable[[], int]]:
    """The functions giving how many torch function modes and dispatch modes are active (generated checks
    call them before each call of a compiled step)."""
    import torch

    return torch._C._len_torch_function_stack, torch._C._len_torch_dispatch_stack


def mkldnn_enabled() -> Callable[[], bool]:
    import torch

    return torch._C._get_mkldnn_enabled


def global_state_guard() -> Any:
    """Dynamo's check of the torch settings of the moment (default dtype, grad and inference mode, autocast,
    deterministic algorithms, matmul precision, threads): an object whose ``check()`` says whether they are
    unchanged, or None on a torch without it."""
    try:
        from torch._C._dynamo.guards import GlobalStateGuard
    except ImportError:  # pragma: no cover - another torch
        return None
    return GlobalStateGuard()


def fx_patcher() -> Any:
    """torch.fx's patcher of globals and methods while it traces (None on a torch without one)."""
    try:
        from torch.fx import _symbolic_trace
    except ImportError:  # pragma: no cover - no torch: nothing compiles
        return None
    return getattr(_symbolic_trace, "_Patcher", None)


# ----------------------------------------------------------------------------------------- the thread's compile
def inductor_after_tracing(mode: Any, options: dict, dynamic: Any, traced: Any,
                           check: Callable[[Any], None] | None = None) -> Callable:
    """Inductor as torch.compile runs it (``mode``, ``options``, ``dynamic``), setting the event ``traced``
    when AOTAutograd hands its first graph (on fake tensors) to inductor's inner compiler; ``check(gm)``
    sees each aten graph inductor compiles first (and may raise to refuse it)."""
    import inspect

    import torch
    from torch._inductor import compile_fx as cfx

    wrapper = torch._TorchCompileInductorWrapper(mode, dict(options), dynamic)
    extra = {}
    if "compile_region_name" in inspect.signature(cfx.compile_fx).parameters:
        extra["compile_region_name"] = getattr(wrapper, "name", None)

    def inner_compile(*args, **kwargs):
        traced.set()
        if check is not None:
            check(args[0] if args else kwargs["gm"])
        return cfx.compile_fx_inner(*args, **kwargs)

    def inductor(gm, example_inputs):
        return cfx.compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=dict(wrapper.config),
                              **extra)

    return inductor


def lookup_backend(name: str) -> Callable:
    import torch

    return torch._dynamo.lookup_backend(name)


def is_aot_backend(backend: Any) -> bool:
    """Whether a backend compiles through AOTAutograd (which reads the real inputs again before compiling)."""
    from torch._dynamo.backends.common import AotAutograd

    return isinstance(backend, AotAutograd)


def lowering_backward_now() -> Any:
    """A context in which AOTAutograd compiles the backward graph with the forward one, not at the first
    backward pass (a no-op context on a torch without the setting)."""
    import contextlib

    import torch

    if getattr(torch._functorch.config, "force_non_lazy_backward_lowering", None) is None:
        return contextlib.nullcontext()  # pragma: no cover - older torch
    return torch._functorch.config.patch(force_non_lazy_backward_lowering=True)


def aten_graphs_seen() -> Any:
    """A context in which AOTAutograd hands every graph to inductor's inner compiler (its own cache, which
    would skip it, off: inductor's cache of compiled graphs still applies), so that ``check`` sees it."""
    import contextlib

    import torch

    if getattr(torch._functorch.config, "enable_autograd_cache", None) is None:
        return contextlib.nullcontext()  # pragma: no cover - older torch
    return torch._functorch.config.patch(enable_autograd_cache=False)


def run_only(fn: Callable) -> Callable:
    """fn calling the code compiled for it when its guards pass, else running eagerly; never compiling.

    This is ``torch._dynamo.run(fn)`` without the checks its wrapper makes on every call (tracing,
    export, nested compiles: none apply to a step called by the driver), which cost about as much
    as a small compiled graph takes to run."""
    import torch

    try:
        from torch._C._dynamo.eval_frame import set_eval_frame
    except ImportError:  # pragma: no cover - another torch layout
        return torch._dynamo.run(fn)

    def run_only(*args):
        prior = set_eval_frame(False)  # False: run cached compiled code only (thread-local)
        try:
            return fn(*args)
        finally:
            set_eval_frame(prior)

    return run_only


def fake_trace(fn: Callable, args: tuple) -> Any:
    """``fn(*args)`` traced on fake tensors, with no autograd, into a torch.fx graph (``make_fx``)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return make_fx(fn, tracing_mode="fake")(*args)


def inductor_graph(gm: Any, args: list, options: dict) -> Any:
    """Inductor's compiled graph for ``gm`` (called with a list of tensors), without dynamo."""
    import torch
    from torch._inductor.compile_fx import compile_fx_inner

    with torch._inductor.config.patch(dict(options)):
        return compile_fx_inner(gm, list(args))


# ------------------------------------------------------------------------------------------ the child's compile
def reparametrized(module: Any, tensors: dict) -> Any:
    """A context in which module computes with these tensors in place of its parameters and buffers."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=True, strict=False)


def aot_capture(fn: Callable, record: Callable[[str, Any, list], None]) -> Callable:
    """``fn`` traced by AOTAutograd as torch.compile traces it (the min-cut partition): calling the result
    runs the graphs eagerly and hands each to ``record("forward" | "backward", graph, example inputs)``."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def capture(kind):
        def compiler(gm, example_inputs):
            record(kind, gm, list(example_inputs))
            return make_boxed_func(gm.forward)
        return compiler

    return aot_function(fn, fw_compiler=capture("forward"), bw_compiler=capture("backward"),
                        inference_compiler=capture("forward"), partition_fn=min_cut_rematerialization_partition)


def aoti_package(module: Any, args: tuple, path: str, options: dict) -> None:
    """Export ``module(*args)`` (a torch.nn.Module) and build an AOTInductor package of it at path."""
    import torch

    exported = torch.export.export(module, args, strict=False)
    torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=options)


def aoti_loader(path: str) -> Any:
    """The AOTInductor package at path, loaded with torch's C++ loader (``.run(list of tensors)``)."""
    import torch

    return torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)


# What a package of a CPU function with no weights holds besides its one library: sources, metadata and the
# archive's own records.  A package holding anything else is loaded whole (aoti_loader).
_LIBRARY_ONLY = re.compile(r"[^/]+/(archive_format|archive_version|byteorder|version|\.data/[^/]+|"
                           r"data/aotinductor/model/[^/]+\.(cpp|h|json|so))")


def aoti_library(package: str, target: str) -> bool:
    """Write the compiled library of the AOTInductor package at package to target, when it is all the package
    needs to run (one CPU library, no weights): ``aoti_runner`` loads it without unpacking the package (a
    third of the time).  Whether it did."""
    import json
    import zipfile

    with zipfile.ZipFile(package) as z:
        names = z.namelist()
        libraries = [n for n in names if n.endswith(".so")]
        if len(libraries) != 1 or not all(_LIBRARY_ONLY.fullmatch(n) for n in names):
            return False
        for name in names:
            if name.endswith("_metadata.json") and json.loads(z.read(name)).get("AOTI_DEVICE_KEY") != "cpu":
                return False
        with z.open(libraries[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return True


def aoti_runner(library: str) -> Any:
    """The library aoti_library wrote, loaded with torch's C++ runner (``.run(list of tensors)``)."""
    import torch

    return torch._C._aoti.AOTIModelContainerRunnerCpu(library, 1)
