"""In the child process: the compile of a stateful step (flowvm/fused/stateful.py) as named stages, each
taking and giving dataclasses and raising ``Refused`` with the reason the parent shows in
``runtime().refused``:

1. ``guard``: the step made a function of (state, inputs), with, for code of the user's, the guards of what it
   reads (flowvm/fused/guards.py);
2. ``effects``: one run on random values finds the buffers the step changes in place and its distinct
   results (a step changing a parameter or an input in place is refused);
3. ``graphs``: AOTAutograd traces it into a forward graph and, when a result needs a gradient, a backward
   graph, as torch.compile does;
4. ``check``: the graphs hold no tensor constant, in-place op or (without ``fallback_random``) random op,
   and their inputs and results are as the effects say;
5. ``package``: an AOTInductor package of each graph and ``meta.json``, for ``kernel.Kernel``.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from . import torch_internals
from .effects import refused_node
from .refused import Refused
from .stateful import BACKWARD, FORWARD, META


@dataclass
class Guarded:
    """The step as a function of (state..., inputs...), zero inputs of its layouts, and what the user's code
    read (dynamo's guards; None for torch's own code)."""
    step: Callable
    inputs: list
    reads: dict | None


@dataclass
class Effects:
    """What a run of the step showed: the state tensors it changed in place (indices), where each result is
    among the distinct ones, and which of those need a gradient."""
    mutated: list[int]
    index: list[int]
    needs: list[bool]


@dataclass
class Graphs:
    """AOTAutograd's forward graph and its inputs' layouts, the backward ones (None without a backward
    pass), and how many of the backward graph's inputs the forward saved."""
    forward: Any
    forward_in: list
    backward: Any
    backward_in: list | None
    saved: int


def compile_job(job: dict, workdir: str) -> None:
    """Trace the stateful step of ``job`` with AOTAutograd and write its packages and meta to workdir
    (raises Refused)."""
    g = guard(job)
    e = effects(job, g)
    gr = graphs(job, g, e)
    check(gr, e, bool(job["options"].get("fallback_random")))
    package(job, g, e, gr, workdir)


def guard(job: dict) -> Guarded:
    import torch

    head, modules, binds = job["head"], job["modules"], job["binds"]
    n = len(job["state"])
    inputs = [torch.empty_strided(shape, stride, dtype=dtype).zero_() for shape, stride, dtype in job["layouts"]]

    def step(*a):
        with contextlib.ExitStack() as stack:
            for module, bind in zip(modules, binds):
                stack.enter_context(torch_internals.reparametrized(module, {k: a[i] for k, i in bind.items()}))
            return head(*a[n:])

    reads = None
    if job.get("guarded"):  # code of the user's: what it reads of the program, as dynamo's guards
        from .guardtrace import trace

        reads = trace(head, modules, [i.clone() for i in inputs], job["grad"])
    return Guarded(step, inputs, reads)


def _fresh(job: dict, g: Guarded) -> list:
    return [s.detach().clone().requires_grad_(s.requires_grad) for s in job["state"]] + [i.clone() for i in g.inputs]


def effects(job: dict, g: Guarded) -> Effects:
    """What the step changes in place (BatchNorm's running statistics and batch count): the package returns
    their new values.  Found from a run on random values (some kernels change a buffer without counting a
    new version of it)."""
    import torch

    n = len(job["state"])
    args = _random(_fresh(job, g))
    before = [(a._version, a.detach().clone()) for a in args]
    with torch.set_grad_enabled(job["grad"]):
        outs = g.step(*args)
    mutated = [i for i, (a, (version, value)) in enumerate(zip(args, before))
               if a._version != version or not torch.equal(a.detach(), value)]
    if any(i >= n or args[i].requires_grad for i in mutated):
        raise Refused("it changes a parameter or an input in place")
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise Refused("a result that is not a tensor")
    uniq, index = distinct(outs)
    if any(u is a or u._base is not None for u in uniq for a in args):
        raise Refused("a result that is an input or a view")
    return Effects(mutated, index, [bool(u.requires_grad) for u in uniq])


def _random(args: list) -> list:
    """args with random values in their floating point tensors (the same in every child)."""
    import torch

    numbers = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for a in args:
            if a.is_floating_point():
                a.copy_(torch.randn(a.shape, generator=numbers, dtype=a.dtype))
    return args


def graphs(job: dict, g: Guarded, e: Effects) -> Graphs:
    import torch

    found: dict[str, tuple] = {}

    def record(kind, gm, example_inputs):
        found[kind] = (gm, [(tuple(x.shape), tuple(x.stride()), x.dtype) for x in example_inputs])

    traced = torch_internals.aot_capture(lambda *a: tuple(distinct(g.step(*a))[0]), record)
    with torch.set_grad_enabled(job["grad"]):
        got = traced(*_fresh(job, g))
        if any(e.needs):
            torch.autograd.backward([x for x, need in zip(got, e.needs) if need],
                                    [torch.ones_like(x) for x, need in zip(got, e.needs) if need])
    forward, forward_in = found["forward"]
    backward, backward_in = found.get("backward", (None, None))
    saved = 0
    if backward is not None:
        tangents = sum(1 for node in backward.graph.nodes if node.op == "placeholder" and node.name.startswith("tangents"))
        saved = len(backward_in) - tangents
        if tangents != sum(e.needs):
            raise Refused(f"{tangents} gradients for {sum(e.needs)} results that need one")
    return Graphs(forward, forward_in, backward, backward_in, saved)


def check(gr: Graphs, e: Effects, random: bool) -> None:
    import torch

    for gm in (gr.forward, gr.backward):
        if gm is not None:
            check_graph(gm, random)
    outputs = _output_nodes(gr.forward)
    results = len(e.needs)
    if len(outputs) != len(e.mutated) + results + gr.saved:
        raise Refused(f"{len(outputs)} forward results for {len(e.mutated)} buffers changed in place, {results} "
                      f"results and {gr.saved} tensors saved for the backward pass")
    for node in outputs[len(e.mutated):len(e.mutated) + results]:
        if not isinstance(node, torch.fx.Node) or node.op == "placeholder" or _is_view(node):
            raise Refused("a result that is an input or a view")


def package(job: dict, g: Guarded, e: Effects, gr: Graphs, workdir: str) -> None:
    _package(gr.forward, gr.forward_in, os.path.join(workdir, FORWARD), job["options"])
    if gr.backward is not None:
        _package(gr.backward, gr.backward_in, os.path.join(workdir, BACKWARD), job["options"])
    meta = {"index": e.index, "needs": e.needs, "reads": g.reads, "results": len(e.needs), "saved": gr.saved,
            "draws": draws(gr.forward),
            "mutated": e.mutated, "backward_in": [[list(s), list(t)] for s, t, _ in gr.backward_in]
            if gr.backward is not None else None}
    with open(os.path.join(workdir, META), "w") as f:
        json.dump(meta, f)


def draws(gm: Any) -> bool:
    """Whether the graph draws random numbers (from the program's generator: ``fallback_random``)."""
    import torch

    return any(torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
               for node in gm.graph.nodes if node.op == "call_function")


def distinct(tensors) -> tuple[list, list[int]]:
    """The distinct tensors (by identity) in order, and where each of the given ones is among them."""
    uniq: list = []
    index: list[int] = []
    for t in tensors:
        k = next((i for i, u in enumerate(uniq) if u is t), None)
        if k is None:
            k = len(uniq)
            uniq.append(t)
        index.append(k)
    return uniq, index


def _output_nodes(gm: Any) -> list:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return list(out.args[0])


def _is_view(node: Any) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def check_graph(gm: Any, random: bool) -> None:
    """Refuse tensor constants, in-place ops and, unless the package draws random numbers as eager code does
    (inductor's ``fallback_random``), random ones."""
    import torch

    for node in gm.graph.nodes:
        if node.op == "get_attr":
            raise Refused(f"a tensor constant ({node.target})")
        if node.op == "call_function":
            schema = getattr(node.target, "_schema", None)
            if schema is not None and schema.is_mutable:
                raise Refused(f"{node.target}: in-place op")
            if not random and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
                raise Refused(f"{node.target}: random numbers, and fallback_random is off")
            why = refused_node(node)  # an assertion, an op that compiles to other values than eager's
            if why is not None:
                raise Refused(why)


def _package(gm: Any, layouts: list, path: str, options: dict) -> None:
    import torch

    class Graph(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gm = gm

        def forward(self, *a):
            return tuple(self.gm(*a))

    args = tuple(torch.empty_strided(shape, stride, dtype=dtype).zero_() for shape, stride, dtype in layouts)
    torch_internals.aoti_package(Graph(), args, path, options)
