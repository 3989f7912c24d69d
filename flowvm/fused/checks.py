"""What a compile in another process may take and must give back (flowvm/fused/outofprocess.py and
stateful.py, and the in-process direct form): which tensors, functions and graphs qualify, the torch
settings a child process needs, and the comparison of a compiled result with eager."""

from __future__ import annotations

import sys
from typing import Any

MAX_JOB_BYTES = 1 << 20   # a job whose pickle is larger carries data: it compiles on the thread


def plain_graph(gm: Any) -> str | None:
    """Why a graph traced by ``make_fx`` is not a plain tensor function (None when it is): its results are
    tensors computed from the inputs, with no input handed back, no in-place, view or random op."""
    import torch

    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = out_node.args[0]
    if not isinstance(results, (tuple, list)) or not all(
            isinstance(r, torch.fx.Node) and isinstance(r.meta.get("val"), torch.Tensor) for r in results):
        return "a result that is not a tensor"
    if any(r.op == "placeholder" for r in results):
        return "an input handed back as it is (aliased)"
    for node in gm.graph.nodes:
        why = _impure(node) if node.op == "call_function" else None
        if why is not None:
            return why
    return None


def _impure(node: Any) -> str | None:
    """Why a call of a traced graph keeps it from being a plain tensor function (None when it does not)."""
    import torch

    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return f"{node.target}: in-place or view op"
    if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
        return f"{node.target}: random numbers (inductor draws them differently from eager)"
    from .effects import refused_node

    return refused_node(node)  # an assertion, an op that compiles to other values than eager's


def plain_tensor(a: Any) -> bool:
    """A dense tensor (not a subclass, sparse or nested) that needs no gradient and has no lazy negation
    or conjugation: what the direct form and a compiled package take."""
    import torch

    return (type(a) is torch.Tensor and a.layout is torch.strided and not a.is_nested and not a.requires_grad
            and not a.is_neg() and not a.is_conj())


def aoti_available() -> bool:
    """Whether this torch loads AOTInductor packages and this program can start a python child."""
    from . import torch_internals

    return torch_internals.aoti_loadable() and not getattr(sys, "frozen", False)


def holds_state(value: Any) -> bool:
    """Whether a call's constant argument holds a tensor or a module (a compiled package would hold a copy)."""
    import torch

    from ..program.registers import Register

    if isinstance(value, Register):
        return False
    if isinstance(value, (torch.Tensor, torch.nn.Module)):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(holds_state(v) for v in value)
    if isinstance(value, dict):
        return any(holds_state(k) or holds_state(v) for k, v in value.items())
    return False


def torch_code(obj: Any) -> bool:
    """A class or function defined in torch itself."""
    return (getattr(obj, "__module__", None) or "").startswith("torch.")


def torch_function(fn: Any) -> bool:
    """A function of torch itself (``torch.sin``, ``torch.nn.functional.relu``, ``torch.Tensor.add``, an
    ``OpOverload``), not bound to an object: no state of the program's process behind it."""
    import types

    import torch

    from . import torch_internals

    if torch_internals.is_op_overload(fn):
        return True
    if not isinstance(fn, (types.BuiltinFunctionType, types.FunctionType, types.MethodDescriptorType,
                           types.WrapperDescriptorType)):
        return False
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, types.ModuleType):
        return False  # a bound method: its object is state
    module = getattr(fn, "__module__", None) or getattr(owner, "__name__", None) or ""
    if isinstance(fn, (types.MethodDescriptorType, types.WrapperDescriptorType)):
        return getattr(fn, "__objclass__", None) in (torch.Tensor, torch_internals.tensor_base())
    return module == "torch" or module.startswith(("torch.", "torch._C"))


def settings() -> dict:
    """The torch settings that change what a step computes, for the child to set."""
    import torch

    return {"threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "deterministic": torch.are_deterministic_algorithms_enabled()}


def mismatch(got: Any, want: Any, scale: float = 0.0) -> str | None:
    """Why compiled results differ from eager ones (None when they agree): their number, types, dtypes,
    shapes, or values beyond float rounding.  With scale (the largest magnitude among results summed from
    the same terms, such as gradients of one loss), a value may also be off by float rounding of that."""
    import torch

    if len(got) != len(want):
        return f"{len(got)} results, not {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        if not isinstance(g, torch.Tensor) or g.dtype != w.dtype or g.shape != w.shape:
            return (f"result {k} is {getattr(g, 'dtype', type(g).__name__)} {tuple(getattr(g, 'shape', ()))}, "
                    f"eager gives {w.dtype} {tuple(w.shape)}")
        if g.is_floating_point() or g.is_complex():
            eps = torch.finfo(g.dtype).eps
            same = torch.allclose(g, w, rtol=max(1e-4, 16 * eps), atol=max(1e-5, 16 * eps, 16 * eps * scale),
                                  equal_nan=True)
        else:
            same = torch.equal(g, w)
        if not same:
            return f"result {k} differs from eager"
    return None


def collective(calls: Any) -> str | None:
    """Why a step whose calls communicate with other processes (a DistributedDataParallel or FSDP module,
    a torch.distributed function) stays eager, or None.  Every rank must run the same collectives in the
    same order, and each rank would change forms at its own time (its own timings, its own compile); a
    child process cannot take the process group either."""
    import torch

    from ..program.printer import call_text

    for call in calls:
        for obj in (call.fn, getattr(call.fn, "__self__", None)):
            for sub in obj.modules() if isinstance(obj, torch.nn.Module) else ():
                if type(sub).__module__.startswith(("torch.nn.parallel", "torch.distributed")):
                    return (f"CALL {call_text(call)}: {type(sub).__name__} communicates with the other ranks; "
                            "a fused step holding it stays eager")
        if (getattr(call.fn, "__module__", None) or "").startswith("torch.distributed"):
            return f"CALL {call_text(call)}: a collective of torch.distributed; a fused step holding it stays eager"
    return None
