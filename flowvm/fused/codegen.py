"""The generated function of a FUSED element: one source line per fused call, taking the registers the
calls read and returning those they write (see flowvm/fused/runtime.py for how it runs)."""

from __future__ import annotations

import hashlib
import keyword
import sys
from dataclasses import dataclass
from typing import Any, Callable


from ..program.registers import Register, resolve


def generate(el) -> "Generated":
    """The generated functions of a FUSED element (see Generated)."""
    var: dict[str, str] = {}
    for r in [*el.inputs, *el.outputs]:
        var.setdefault(r.name, f"r{len(var)}")
    ns: dict[str, Any] = {}
    calls = el.calls
    split = next((i for i, c in enumerate(calls) if is_barrier(c.fn)), len(calls))
    line_of: dict[int, int] = {}
    lines: list[str] = []

    def body(indices) -> None:
        for i in indices:
            lines.append(_call_line(i, calls[i], ns, var))
            line_of[len(lines)] = i

    def ret(names) -> None:
        lines.append(f"    return ({', '.join([var[n] for n in names] + ['v'])},)")

    params = ", ".join(var[r.name] for r in el.inputs)
    lines.append(f"def fused({params}):")
    body(range(len(calls)))
    ret([r.name for r in el.outputs])
    head_inputs, head_outputs = _reads_writes(calls[:split])
    if 0 < split < len(calls):
        lines.append(f"def head({', '.join(var[n] for n in head_inputs)}):")
        body(range(split))
        ret(head_outputs)
        unpack = ", ".join([var[n] for n in head_outputs] + ["v"])
        lines.append(f"def tail(h, {params}):")
        lines.append(f"    ({unpack},) = h")
        body(range(split, len(calls)))
        ret([r.name for r in el.outputs])
    source = "\n".join(lines) + "\n"
    filename = _define(source, ns)
    names = [r.name for r in el.inputs]
    positions = None if head_inputs == names else tuple(names.index(n) for n in head_inputs)
    if split == len(calls):
        return Generated(ns["fused"], ns["fused"], None, None, line_of, filename, source)
    if split == 0:  # nothing before the backward pass: nothing to compile
        return Generated(ns["fused"], None, None, None, line_of, filename, source)
    return Generated(ns["fused"], ns["head"], ns["tail"], positions, line_of, filename, source)


def _call_line(i: int, call, ns: dict, var: dict) -> str:
    """The line of the generated source calling calls[i] (its function and constants put in ns)."""
    ns[f"f{i}"] = call.fn
    parts = [_src(a, f"c{i}_{j}", ns, var) for j, a in enumerate(call.args)]
    for j, (key, value) in enumerate(call.kwargs.items()):
        name = f"c{i}_k{j}"
        if key.isidentifier() and not keyword.iskeyword(key):
            parts.append(f"{key}={_src(value, name, ns, var)}")
        else:
            ns[name + "_key"] = key
            parts.append(f"**{{{name}_key: {_src(value, name, ns, var)}}}")
    target = f"{var[call.store_to.name]} = " if call.store_to is not None else ""
    return f"    {target}v = f{i}({', '.join(parts)})"


def _define(source: str, ns: dict) -> str:
    """Run the generated source in ns; its file name.  Named by its source, so that the same calls give the
    same function (and pickle) in every process."""
    filename = f"<flowvm FUSED {hashlib.sha1(source.encode()).hexdigest()[:16]}>"
    exec(compile(source, filename, "exec"), ns)
    for name in ("fused", "head", "tail"):  # a module name of their own: a pickler looking for the module
        if name in ns:                       # of a function with none searches every module imported
            ns[name].__module__ = filename
    return filename


@dataclass
class Generated:
    """``fused(*inputs)``: all the calls, eagerly.  ``head``: the calls before the first barrier
    (``Tensor.backward``), the part that is compiled; ``tail(head_result, *inputs)`` runs the rest
    eagerly (None when there is no barrier, and then head is fused).  ``head_positions`` picks
    head's arguments from the inputs (None: all of them)."""

    fused: Callable
    head: Callable | None
    tail: Callable | None
    head_positions: tuple[int, ...] | None
    line_of: dict[int, int]
    filename: str
    source: str


def is_barrier(fn: Any) -> bool:
    """Whether fn ends the compiled part of a fused step and runs eagerly (backward passes: also a statement
    ``loss.backward()`` of a ``@flowvm.program`` function, which says so by ``__flowvm_backward__``)."""
    torch = sys.modules.get("torch")
    return torch is not None and (fn is torch.Tensor.backward or fn is torch.autograd.backward
                                  or getattr(fn, "__flowvm_backward__", False) is True)


def _reads_writes(calls) -> tuple[list[str], list[str]]:
    from ..program.registers import iter_registers

    reads: list[str] = []
    written: list[str] = []
    for c in calls:
        for r in list(iter_registers(c.args)) + list(iter_registers(c.kwargs)):
            if r.name not in written and r.name not in reads:
                reads.append(r.name)
        if c.store_to is not None and c.store_to.name not in written:
            written.append(c.store_to.name)
    return reads, written


def _src(value: Any, name: str, ns: dict, var: dict) -> str:
    """Source for an argument: a register's variable, a container built inline, or a constant."""
    if isinstance(value, Register):
        return var[value.name]
    if _has_register(value) and not _frozen(value):
        # a list or dict holding registers may be changed in place: read it at each call, as a CALL does
        ns[name] = value
        ns["resolve"] = resolve
        file = ", ".join(f"{r.name!r}: {var[r.name]}" for r in _registers(value))
        return f"resolve({name}, {{{file}}})"
    if isinstance(value, (list, tuple)) and _has_register(value):
        items = [_src(v, f"{name}_{k}", ns, var) for k, v in enumerate(value)]
        if isinstance(value, list):
            return f"[{', '.join(items)}]"
        if hasattr(value, "_fields"):
            ns[name + "_t"] = type(value)
            return f"{name}_t({', '.join(items)})"
        return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
    if isinstance(value, dict) and _has_register(value):
        pairs = [f"{_src(k, f'{name}_k{n}', ns, var)}: {_src(v, f'{name}_v{n}', ns, var)}"
                 for n, (k, v) in enumerate(value.items())]
        text = "{" + ", ".join(pairs) + "}"
        if type(value) is not dict:
            ns[name + "_t"] = type(value)
            text = f"{name}_t({text})"
        return text
    ns[name] = value
    return name


def _frozen(value: Any) -> bool:
    """A tuple (or namedtuple) whose items are registers or frozen tuples: it cannot change, so it is built
    inline; anything else holding registers is read at each call."""
    if isinstance(value, Register):
        return True
    if isinstance(value, tuple) and (type(value) is tuple or hasattr(type(value), "_fields")):
        return all(_frozen(v) or not _has_register(v) and _immutable(v) for v in value)
    return False


def _immutable(value: Any) -> bool:
    from .reads import immutable

    return immutable(value)


def _registers(value: Any) -> list:
    from ..program.registers import iter_registers

    seen: dict[str, Register] = {}
    for r in iter_registers(value):
        seen.setdefault(r.name, r)
    return list(seen.values())


def _has_register(value: Any) -> bool:
    from ..program.registers import has_registers

    return has_registers(value)


def leaf_source(el, rt_name: str = "rt") -> str:
    """Source of the zero-argument leaf the driver calls: read registers, call, store, return."""
    args = ", ".join(f"R[{r.name!r}]" for r in el.inputs)
    body = [
        "def leaf():",
        "    try:",
        f"        v = {rt_name}.current({args})",
        "    except Exception as e:",
        f"        {rt_name}.annotate(e)",
        "        raise",
    ]
    body += [f"    R[{r.name!r}] = v[{k}]" for k, r in enumerate(el.outputs)]
    body.append("    return v[-1]")
    return "\n".join(body) + "\n"


def barrier_index(calls) -> int:
    return next((i for i, c in enumerate(calls) if is_barrier(c.fn)), len(calls))


