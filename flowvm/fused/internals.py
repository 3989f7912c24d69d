"""Every call of flowvm into torch's internals (dynamo, inductor, AOTAutograd, export, make_fx, torch._C):
the one place that changes when torch changes them (tests/fused/test_internals.py checks that no other
module of flowvm names them).

What each function returns is flowvm's own (plain values and dataclasses), so the rest of fused/ does not
depend on the shape of torch's objects.
"""

from __future__ import annotations

import dataclasses
import sys
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

