"""What a compiled step may not drop or compute differently from eager, found before it compiles: calls with a
side effect and no result (``torch._assert_async``, ``torch._check``...), and ops whose compiled form gives other
values than eager on some inputs.  A step holding one stays eager, the reason in ``runtime().refused`` and its
header.

Checked three times: on the step's CALLs before anything compiles (``refused_call``: every path, the child's
too), on dynamo's graph (``refused_dynamo_graph``: what code of yours calls) and on the aten graph inductor
gets (``refused_node``: what modules and functions decompose to), in the compile thread, the direct form's
trace and the child's graph check."""

from __future__ import annotations

from typing import Any

# aten ops with a side effect and no result: inductor may drop them (``_assert_async`` without a message is
# dropped on the CPU, and a failed assertion then goes unseen)
SIDE_EFFECT_OPS = frozenset({"_assert_async", "_functional_assert_async", "_assert_scalar", "_functional_assert_scalar",
                             "_print", "sym_constrain_range", "_functional_sym_constrain_range"})

# aten ops whose compiled (vectorized) form returns a zero of the other sign than eager for a tie of +0.0 and
# -0.0, or for a clamp to 0: ``1 / torch.clamp(x, min=0)`` is then an infinity of the other sign
SIGNED_ZERO_OPS = frozenset({"maximum", "minimum", "fmax", "fmin", "clamp", "clamp_min", "clamp_max", "clip",
                             "hardtanh", "relu6"})

SIGNED_ZERO_REASON = "inductor returns zeros of the other sign than eager (0.0 for -0.0) for ties and clamps to 0"

MUL_ZERO_REASON = ("a product with an integer 0, which inductor folds to zeros (an infinity or NaN times 0 is NaN "
                   "eagerly)")


def _narrow_ints() -> tuple:
    import torch

    return (torch.int8, torch.uint8, torch.int16)


def _cast_reason(dtype: Any) -> str:
    return (f"a cast of floats to {dtype}: values out of its range saturate in the compiled form and wrap "
            "around eagerly")


def refused_node(node: Any) -> str | None:
    """Why a call_function node of an aten graph keeps its step eager, or None."""
    import torch

    target = node.target
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", None) or getattr(target, "__name__", "")
    if name in SIDE_EFFECT_OPS:
        return f"{target}: a side effect (an assertion) that the compiled form may drop"
    if name in SIGNED_ZERO_OPS:
        return f"{target}: {SIGNED_ZERO_REASON}"
    if name == "mul" and any(type(a) in (int, bool) and a == 0 for a in node.args):
        return f"{target}: {MUL_ZERO_REASON}"
    if name in ("_to_copy", "convert_element_type", "to", "_to_dtype"):
        dtype = node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
        src = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if dtype in _narrow_ints() and isinstance(src, torch.Tensor) and src.is_floating_point():
            return f"{target}: {_cast_reason(dtype)}"
    return None


def refused_graph(gm: Any) -> str | None:
    """Why an aten graph (make_fx's, AOTAutograd's, the one inductor compiles) keeps its step eager, or None."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            why = refused_node(node)
            if why is not None:
                return why
    return None


def _side_effect_functions() -> dict:
    """torch's own functions with a side effect and no result, by identity: name."""
    import torch

    found = {}
    for name in dir(torch):
        if name.startswith(("_assert", "_check")) and callable(getattr(torch, name, None)):
            found[id(getattr(torch, name))] = f"torch.{name}"
    for name in SIDE_EFFECT_OPS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            found[id(packet)] = f"aten.{name}"
            for overload in packet.overloads():
                found[id(getattr(packet, overload))] = f"aten.{name}.{overload}"
    return found


_SIDE_EFFECTS: dict | None = None


def side_effect_name(fn: Any) -> str | None:
    global _SIDE_EFFECTS
    if _SIDE_EFFECTS is None:
        _SIDE_EFFECTS = _side_effect_functions()
    try:
        return _SIDE_EFFECTS.get(id(fn))
    except TypeError:  # pragma: no cover
        return None


def _signed_zero_functions() -> dict:
    import torch

    F = torch.nn.functional
    found = {}
    for name in ("maximum", "minimum", "fmax", "fmin", "clamp", "clamp_min", "clamp_max", "clip", "clamp_",
                 "clamp_min_", "clamp_max_", "clip_"):
        for owner, prefix in ((torch, "torch"), (torch.Tensor, "torch.Tensor")):
            fn = getattr(owner, name, None)
            if fn is not None:
                found[id(fn)] = f"{prefix}.{name}"
    for name in ("hardtanh", "hardtanh_", "relu6"):
        found[id(getattr(F, name))] = f"torch.nn.functional.{name}"
    return found


_SIGNED: dict | None = None


def refused_call(calls: Any) -> str | None:
    """Why a step whose CALLs hold a side effect or an op computing other values compiled stays eager (None when
    none does).  Functions of yours, modules and casts are looked into when the graph is traced
    (``refused_graph``); a ReLU6 or Hardtanh module is refused here."""
    import torch

    from ..program.printer import call_text

    global _SIGNED
    if _SIGNED is None:
        _SIGNED = _signed_zero_functions()
    for call in calls:
        fn = call.fn
        name = side_effect_name(fn)
        if name is not None:
            return f"CALL {call_text(call)}: {name} is a side effect (an assertion) that the compiled form may drop"
        bound = getattr(fn, "__func__", None)
        name = _SIGNED.get(id(fn)) or (_SIGNED.get(id(bound)) if bound is not None else None)
        if name is None and getattr(fn, "__name__", None) in ("clamp", "clamp_min", "clamp_max", "clip") and \
                isinstance(getattr(fn, "__self__", None), torch.Tensor):
            name = f"Tensor.{fn.__name__}"
        if name is not None:
            return f"CALL {call_text(call)}: {name}: {SIGNED_ZERO_REASON}"
        if isinstance(fn, torch.nn.Module):
            for sub in fn.modules():
                if isinstance(sub, (torch.nn.Hardtanh, torch.nn.ReLU6)):
                    return f"CALL {call_text(call)}: {type(sub).__name__}: {SIGNED_ZERO_REASON}"
    return None


def refused_dynamo_graph(gm: Any) -> str | None:
    """Why dynamo's graph (torch-level calls, from code of yours too) holds a side effect or a product with an
    integer 0 (folded before the aten graph is checked), or None."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            name = side_effect_name(node.target)
            if name is not None:
                return f"{name}: a side effect (an assertion) that the compiled form may drop"
        if node.op in ("call_function", "call_method") and _product_with_int_zero(node):
            return f"{getattr(node.target, '__name__', node.target)}: {MUL_ZERO_REASON}"
    return None


def _product_with_int_zero(node: Any) -> bool:
    import operator

    import torch

    if node.target not in (operator.mul, operator.imul, torch.mul, torch.multiply, "mul", "mul_", "multiply"):
        return False
    return any(type(a) in (int, bool) and a == 0 for a in list(node.args) + list(node.kwargs.values()))
