"""Compiling a fused step that calls torch modules (and may have a backward pass after it) in a child
process: the *stateful* kind of flowvm/fused/outofprocess.py.

A step such as ``zero_grad(); logits = net(x); loss = cross_entropy(logits, y)`` reads state of the program's
process, the module's parameters and buffers, and its result is differentiated later (``loss.backward()``).
It compiles out of process as torch.compile would compile it, with the state made explicit:

- the parent (``plan``) lists the modules the step calls, each parameter and buffer once (``state``),
  the modules' training flags and the grad mode, and pickles the step with every tensor replaced by an
  empty one of its layout (``payload``): the job never carries the program's data;
- the child (``compile_job``) makes the step a function of (state, inputs) by putting its arguments in
  the modules' place (``torch.nn.utils.stateless``), traces it with AOTAutograd into a forward graph and,
  when something needs a gradient, a backward graph, and builds an AOTInductor package of each;
- the parent (``Kernel``) runs the zero_grad calls of the step, then the forward package inside a
  ``torch.autograd.Function`` whose backward is the backward package, and hands back the step's results
  (the same tensor where the step returned one tensor twice).

No module may have hooks or parametrizations.  When every module's class is torch's or adds methods
without overriding torch's (``_torch_class``) and every function is torch's, only torch's code runs in the
child.  A step computing with code of the user's (a ``forward`` of theirs, a function of theirs) is
*guarded* (flowvm/fused/guards.py): the child has dynamo trace it first, refusing anything but one graph
with no other effect, and sends back the guards naming every value that code read, which the parent
checks when the package arrives and before each call.
Buffers the step changes in place (BatchNorm's running statistics in training) come back from the forward
package and are written as eager code writes them; random numbers (dropout in training) are drawn from the
program's generator as eager code draws them (inductor's ``fallback_random``).  Steps that change a
parameter or an input in place, or use tensor constants, are refused and compile on the thread.  Before
each call the parent checks that every state tensor, training flag, submodule, setting (a Dropout's
``p``...) and the grad mode is as compiled and that no hook was added (``Kernel.ready``); the first call
is checked against eager (``Kernel.verify``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from .checks import aoti_available, holds_state, mismatch, plain_tensor, settings, torch_code, torch_function

FORWARD, BACKWARD, META = "forward.pt2", "backward.pt2", "meta.json"


@dataclass
class Plan:
    """What the parent knows of a stateful step (see the module's docstring)."""

    head: Callable                       # the step without its zero_grad calls (what the child compiles)
    pre: list[Callable]                  # the zero_grad calls, run eagerly before each compiled call
    modules: list[Any]                   # the modules the step calls
    state: list[Any]                     # each parameter and buffer once
    where: list[list[tuple[Any, str, str]]]  # for each state tensor: (owner module, "_parameters"/"_buffers", name)
    binds: list[dict[str, int]]          # for each module: its dotted names -> index in state
    tree: list[Any]                      # every module and submodule (their training flags are checked)
    grad: bool                           # grad mode when compiled
    layouts: list[tuple] = field(default_factory=list)  # the step's inputs
    guarded: bool = False                # code of the user's runs in it: compiled under dynamo's guards
    ready: Callable[[], list | None] | None = None  # the per-call check, of the modules as planned (_ready)


@functools.lru_cache(maxsize=None)
def _internals() -> frozenset:
    """The attributes every nn.Module has (its hook dicts, _parameters...)."""
    import torch

    return frozenset(vars(torch.nn.Module()))


# methods a subclass of a torch module may override without changing what the module computes
_HARMLESS = frozenset({"__init__", "__repr__", "extra_repr", "reset_parameters", "_get_name", "__doc__",
                       "__module__", "__qualname__", "__dict__", "__weakref__", "__annotations__",
                       "__firstlineno__", "__static_attributes__"})


def _torch_class(cls: type) -> bool:
    """Whether what instances of cls compute is torch's own code: every class of its MRO is torch's, or adds
    attributes without overriding any of its torch bases' (``Classifier(nn.Sequential)`` adding
    ``predict``), except harmless ones (``extra_repr``, ``__init__``...)."""
    torch_names: set[str] = set()
    for base in cls.__mro__:
        if torch_code(base) or base is object:
            torch_names.update(vars(base))
    return all(torch_code(base) or base is object or not (set(vars(base)) - _HARMLESS) & torch_names
               for base in cls.__mro__)


def _module_kind(module: Any) -> str | None:
    """None when every submodule computes with torch's own code (see _torch_class); USER when some compute
    with code of the user's (a ``forward`` of theirs, a function of theirs given to a torch module: compiled
    under dynamo's guards, flowvm/fused/guards.py); otherwise why the module stays on the thread (hooks,
    parametrizations, a method set on an instance)."""
    import torch

    if any(_global_hooks()):
        return "global module hooks"
    user = False
    for sub in module.modules():
        kind = type(sub).__name__
        if torch.nn.utils.parametrize.is_parametrized(sub):
            return f"{kind} has parametrizations"
        if any(getattr(sub, name, None) for name in _HOOKS):
            return f"{kind} has hooks"
        user = user or not _torch_class(type(sub))
        for name, value in vars(sub).items():
            if name in _internals():
                continue
            if hasattr(type(sub), name) and callable(getattr(type(sub), name)):
                return f"{kind}.{name} is set on the instance"
            if callable(value) and not isinstance(value, (torch.nn.Module, torch.Tensor, type)) \
                    and not torch_function(value):
                user = True  # an activation of yours, say
    return USER if user else None


USER = "code of the user's"


def _zero_grad(call: Any) -> bool:
    """A ``zero_grad()`` of an optimizer or a module, storing nothing: it only clears gradients, which the
    step's forward pass does not read, so it runs eagerly before the compiled call."""
    import torch

    owner = getattr(call.fn, "__self__", None)
    return (getattr(call.fn, "__name__", None) == "zero_grad" and isinstance(owner, (torch.optim.Optimizer,
                                                                                    torch.nn.Module))
            and call.store_to is None and not call.args and set(call.kwargs) <= {"set_to_none"}
            and all(isinstance(v, bool) for v in call.kwargs.values()))


def plan(calls: Any, inputs: list, args: tuple) -> Plan | str:
    """The plan for compiling a head with these calls (inputs: its input registers, args: their values)
    out of process, or why it is not of the stateful kind (it compiles on the thread)."""
    import types

    import torch

    from ..program.printer import call_text
    from .codegen import generate

    if not aoti_available():
        return "this torch cannot load AOTInductor packages, or this program cannot start python"
    if not args or not all(plain_tensor(a) and a.device.type == "cpu" for a in args):
        return "an input that is not a plain CPU tensor needing no gradient"
    if torch.is_inference_mode_enabled() or torch._C._is_any_autocast_enabled():
        return "inference mode or autocast"
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return "a torch function or dispatch mode (torch.set_default_device, say)"
    modules: list[Any] = []
    pre: list[Callable] = []
    kept = []
    guarded = False  # some code of the user's runs in the step
    for call in calls:
        if _zero_grad(call):
            pre.append(call.fn)
            continue
        if holds_state(list(call.args)) or holds_state(dict(call.kwargs)):
            return f"CALL {call_text(call)}: a tensor or module among its arguments"
        if isinstance(call.fn, torch.nn.Module):
            kind = _module_kind(call.fn)
            if kind is not None and kind != USER:
                return f"CALL {call_text(call)}: {kind}"
            guarded = guarded or kind == USER
            if not any(m is call.fn for m in modules):
                modules.append(call.fn)
        elif not torch_function(call.fn):
            if getattr(call.fn, "__self__", None) is not None and not isinstance(call.fn.__self__, types.ModuleType):
                return f"CALL {call_text(call)}: a method bound to an object"
            guarded = True
        kept.append(call)
    if not modules or not kept or _zero_grad(calls[-1]):
        return "no module to compile, or a zero_grad call ends the step"
    state: list[Any] = []
    where: list[list[tuple[Any, str, str]]] = []
    binds: list[dict[str, int]] = []
    for module in modules:
        bind: dict[str, int] = {}
        for kind, named in (("_parameters", module.named_parameters), ("_buffers", module.named_buffers)):
            for dotted, tensor in named(remove_duplicate=False):
                if tensor is None:
                    continue
                if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu" \
                        or tensor.layout is not torch.strided or tensor.is_nested or tensor._backward_hooks:
                    return f"{type(module).__name__}.{dotted}: not a plain CPU tensor, or with hooks"
                owner_path, _, leaf = dotted.rpartition(".")
                owner = module.get_submodule(owner_path) if owner_path else module
                k = next((i for i, s in enumerate(state) if s is tensor), None)
                if k is None:
                    k = len(state)
                    state.append(tensor)
                    where.append([])
                where[k].append((owner, kind, leaf))
                bind[dotted] = k
        binds.append(bind)
    if not state:
        return "no parameter or buffer"
    tree = [sub for m in modules for sub in m.modules()]
    head = generate(types.SimpleNamespace(calls=kept, inputs=list(inputs), outputs=_written(kept))).fused
    p = Plan(head=head, pre=pre, modules=modules, state=state, where=where, binds=binds, tree=tree,
             grad=torch.is_grad_enabled(), layouts=[(tuple(a.shape), tuple(a.stride()), a.dtype) for a in args],
             guarded=guarded)
    p.ready = _ready(p)  # now: the child compiles the modules as they are now
    return p


def _written(calls) -> list:
    out: list = []
    for c in calls:
        if c.store_to is not None and all(r.name != c.store_to.name for r in out):
            out.append(c.store_to)
    return out


def _stand_in(parameter: bool, shape: tuple, stride: tuple, dtype: Any, requires_grad: bool) -> Any:
    import torch

    t = torch.empty_strided(shape, stride, dtype=dtype).zero_()
    return torch.nn.Parameter(t, requires_grad) if parameter else t.requires_grad_(requires_grad)


def payload(p: Plan, options: dict) -> bytes:
    """The child's job: the step and its modules with every tensor replaced by zeros of its layout (the
    optimizers' states too), the state's order, the grad mode and the torch settings."""
    import io

    import cloudpickle
    import torch

    class StandIns(cloudpickle.CloudPickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor):
                return _stand_in, (isinstance(obj, torch.nn.Parameter), tuple(obj.shape), tuple(obj.stride()),
                                   obj.dtype, obj.requires_grad)
            return super().reducer_override(obj)

    job = {"kind": "stateful", "head": p.head, "modules": p.modules, "state": p.state, "binds": p.binds,
           "grad": p.grad, "layouts": p.layouts, "guarded": p.guarded, "options": dict(options),
           **settings()}
    buf = io.BytesIO()
    StandIns(buf, protocol=5).dump(job)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- the child
class Refused(Exception):
    """The step is not of a kind the child compiles (the message says why)."""


def compile_job(job: dict, workdir: str) -> None:
    """Trace the stateful step of ``job`` with AOTAutograd and write its packages and meta to workdir
    (raises Refused)."""
    import torch
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.nn.utils.stateless import _reparametrize_module

    head, modules, binds, grad = job["head"], job["modules"], job["binds"], job["grad"]
    n = len(job["state"])
    inputs = [torch.empty_strided(shape, stride, dtype=dtype).zero_() for shape, stride, dtype in job["layouts"]]

    def step(*a):
        with contextlib.ExitStack() as stack:
            for module, bind in zip(modules, binds):
                stack.enter_context(_reparametrize_module(module, {k: a[i] for k, i in bind.items()},
                                                          tie_weights=True, strict=False))
            return head(*a[n:])

    reads = None
    if job.get("guarded"):  # code of the user's: what it reads of the program, as dynamo's guards
        from .guards import Untraceable, trace

        try:
            reads = trace(head, modules, [i.clone() for i in inputs], grad)
        except Untraceable as why:
            raise Refused(str(why)) from None

    def fresh():
        return [s.detach().clone().requires_grad_(s.requires_grad) for s in job["state"]] + [i.clone() for i in inputs]

    # What the step changes in place (BatchNorm's running statistics and batch count): the package returns
    # their new values.  Found from a run on random values (some kernels change a buffer without counting
    # a new version of it).
    numbers = torch.Generator().manual_seed(0)
    args = fresh()
    with torch.no_grad():
        for a in args:
            if a.is_floating_point():
                a.copy_(torch.randn(a.shape, generator=numbers, dtype=a.dtype))
    before = [(a._version, a.detach().clone()) for a in args]
    with torch.set_grad_enabled(grad):
        outs = step(*args)
    mutated = [i for i, (a, (version, value)) in enumerate(zip(args, before))
               if a._version != version or not torch.equal(a.detach(), value)]
    if any(i >= n or args[i].requires_grad for i in mutated):
        raise Refused("it changes a parameter or an input in place")
    random = bool(job["options"].get("fallback_random"))
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise Refused("a result that is not a tensor")
    uniq, index = _distinct(outs)
    if any(u is a or u._base is not None for u in uniq for a in args):
        raise Refused("a result that is an input or a view")
    needs = [bool(u.requires_grad) for u in uniq]

    def unique(*a):
        return tuple(_distinct(step(*a))[0])

    graphs: dict[str, tuple] = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = (gm, [(tuple(e.shape), tuple(e.stride()), e.dtype) for e in example_inputs])
            return make_boxed_func(gm.forward)
        return compiler

    traced = aot_function(unique, fw_compiler=capture("forward"), bw_compiler=capture("backward"),
                          inference_compiler=capture("forward"), partition_fn=min_cut_rematerialization_partition)
    with torch.set_grad_enabled(grad):
        got = traced(*fresh())
        if any(needs):
            torch.autograd.backward([g for g, need in zip(got, needs) if need],
                                    [torch.ones_like(g) for g, need in zip(got, needs) if need])
    forward, forward_in = graphs["forward"]
    backward, backward_in = graphs.get("backward", (None, None))
    for gm in (forward, backward):
        if gm is not None:
            _check_graph(gm, random)
    outputs = _output_nodes(forward)
    if backward is not None:
        tangents = sum(1 for node in backward.graph.nodes if node.op == "placeholder" and node.name.startswith("tangents"))
        saved = len(backward_in) - tangents
        if tangents != sum(needs):
            raise Refused(f"{tangents} gradients for {sum(needs)} results that need one")
    else:
        saved = 0
    if len(outputs) != len(mutated) + len(uniq) + saved:
        raise Refused(f"{len(outputs)} forward results for {len(mutated)} buffers changed in place, {len(uniq)} "
                      f"results and {saved} tensors saved for the backward pass")
    for node in outputs[len(mutated):len(mutated) + len(uniq)]:
        if not isinstance(node, torch.fx.Node) or node.op == "placeholder" or _is_view(node):
            raise Refused("a result that is an input or a view")
    _package(forward, forward_in, os.path.join(workdir, FORWARD), job["options"])
    if backward is not None:
        _package(backward, backward_in, os.path.join(workdir, BACKWARD), job["options"])
    meta = {"index": index, "needs": needs, "reads": reads, "results": len(uniq), "saved": saved, "mutated": mutated,
            "backward_in": [[list(s), list(t)] for s, t, _ in backward_in] if backward is not None else None}
    with open(os.path.join(workdir, META), "w") as f:
        json.dump(meta, f)


def _distinct(tensors) -> tuple[list, list[int]]:
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


def _check_graph(gm: Any, random: bool) -> None:
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


def _package(gm: Any, layouts: list, path: str, options: dict) -> None:
    import torch

    class Graph(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gm = gm

        def forward(self, *a):
            return tuple(self.gm(*a))

    args = tuple(torch.empty_strided(shape, stride, dtype=dtype).zero_() for shape, stride, dtype in layouts)
    exported = torch.export.export(Graph(), args, strict=False)
    torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=options)


# ---------------------------------------------------------------------------------------------- the parent
def _loader(path: str) -> Any:
    import torch

    return torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)


class Kernel:
    """The compiled step in the program's process: ``ready()`` gives the state to call it with (None when
    a state tensor, a training flag or the grad mode is not as compiled), ``kernel(state, inputs)`` runs
    the zero_grad calls and the packages, writes the buffers the step changes and returns its results.
    ``verify`` checks the first call against eager."""

    def __init__(self, p: Plan, workdir: str):
        import torch

        with open(os.path.join(workdir, META)) as f:
            meta = json.load(f)
        self.plan = p
        self.forward = _loader(os.path.join(workdir, FORWARD)).run
        backward = os.path.join(workdir, BACKWARD)
        self.backward = _loader(backward).run if meta["backward_in"] is not None else None
        self.index = meta["index"]
        self.results = meta["results"]
        self.needs = meta["needs"]
        self.mutated = meta["mutated"]
        self.expected = [(tuple(s), tuple(t)) for s, t in meta["backward_in"] or []]
        self.ready = p.ready
        if meta["reads"] is not None:  # and what the user's code read is as the child saw it
            from .guards import check

            state, values = p.ready, check(p.head, p.modules, meta["reads"])
            self.ready = lambda: state() if values() else None
        p.state = []  # the tensors it was planned for: ready() reads the modules' own
        self.before: tuple | None = None  # the first call's buffers and generator state, for verify
        kernel = self
        first, last = len(self.mutated), len(self.mutated) + self.results

        class FusedStep(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                outs = kernel._forward(args)
                ctx.save_for_backward(*outs[last:])
                ctx.mark_non_differentiable(*[o for o, need in zip(outs[first:last], kernel.needs) if not need])
                return tuple(outs[first:last])

            @staticmethod
            def backward(ctx, *grads):
                if torch.is_grad_enabled():  # backward(create_graph=True): its gradients would have no graph
                    raise RuntimeError("flowvm: a fused step compiled in another process cannot be differentiated "
                                       "twice (backward with create_graph=True); compile it with "
                                       "fuse-torch compile_in='thread', or form='eager'")
                given = list(ctx.saved_tensors) + [g for g, need in zip(grads, kernel.needs) if need]
                for k, (g, (shape, stride)) in enumerate(zip(given, kernel.expected)):
                    if g.stride() != stride:
                        given[k] = torch.empty_strided(shape, stride, dtype=g.dtype).copy_(g)
                return tuple(kernel.backward(given))

        self.function = FusedStep

    def _forward(self, args) -> list:
        import torch

        outs = self.forward(list(args))
        if self.mutated:  # the step's in-place updates of buffers, as eager code makes them
            with torch.no_grad():
                for i, new in zip(self.mutated, outs):
                    args[i].copy_(new)
        return outs

    def __call__(self, state: list, inputs: list) -> tuple:
        import torch

        if self.before is None:
            self.before = (state, [state[i].clone() for i in self.mutated], torch.get_rng_state())
        for fn in self.plan.pre:
            fn()
        if self.backward is None:
            first = len(self.mutated)
            outs = self._forward(state + inputs)[first:first + self.results]
        else:
            outs = self.function.apply(*state, *inputs)
        return tuple(outs[k] for k in self.index)

    def _restore(self) -> None:
        import torch

        state, buffers, rng = self.before
        with torch.no_grad():
            for i, value in zip(self.mutated, buffers):
                state[i].copy_(value)
        torch.set_rng_state(rng)

    def verify(self, got: tuple, eager: Callable[[], tuple]) -> str | None:
        """Why the first call's results differ from eager's (None when they agree), with eager run from
        the same buffers and generator state: the results, the parameters' gradients through them, the
        buffers changed and the random numbers drawn.  Agreeing, the buffers and generator are left as
        eager left them; differing, as they were before the call (for eager to run it again)."""
        import torch

        state = self.before[0]
        buffers, rng = [state[i].clone() for i in self.mutated], torch.get_rng_state()
        self._restore()
        want = eager()
        wrong = mismatch(got, want)
        if wrong is None:
            wrong = self._grad_mismatch(got, want)
        if wrong is None and self.mutated:
            wrong = mismatch(buffers, [state[i] for i in self.mutated])
            wrong = None if wrong is None else f"buffers: {wrong}"
        if wrong is None and not torch.equal(rng, torch.get_rng_state()):
            wrong = "random numbers drawn differently"
        if wrong is not None:
            self._restore()
        self.before = ()  # checked: no more copies
        return wrong

    def _grad_mismatch(self, got: tuple, want: tuple) -> str | None:
        import torch

        if self.backward is None:
            return None
        params = [s for s in self.before[0] if s.requires_grad]  # the tensors the first call ran with

        def grads(outs, retain):
            used = [o for o in outs if o.requires_grad]
            found = torch.autograd.grad(used, params, [torch.ones_like(o) for o in used], retain_graph=retain,
                                        allow_unused=True)
            return [torch.zeros_like(p) if g is None else g for p, g in zip(params, found)]

        eager = grads(_distinct(want)[0], False)
        scale = max((float(g.abs().max()) for g in eager if g.numel()), default=0.0)
        wrong = mismatch(grads(_distinct(got)[0], True), eager, scale)  # a gradient near 0 (a bias before BatchNorm) is noise
        return None if wrong is None else f"gradients: {wrong}"


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_module_registration_hooks",
                 "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")


def _global_hooks() -> list:
    from torch.nn.modules import module as nnmodule

    return [getattr(nnmodule, name, None) for name in _GLOBAL_HOOKS]


def _module_checks(k: int, module: Any, ns: dict, guarded: bool) -> list[str]:
    """Source checking that module k computes what it computed when compiled: the same training flag,
    submodules and settings (a Dropout's ``p``, a BatchNorm's ``eps``...), and no hook.  A guarded step's
    settings are those its guards name (flowvm/fused/guards.py), not every attribute: a counter of the
    user's that the step does not read may change."""
    import torch

    internals = _internals()
    plain = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
    attrs = vars(module)
    ns[f"m{k}"] = attrs  # its dicts are read from it at each call (Sequential's del replaces _modules)
    ns[f"mo{k}"], ns[f"mt{k}"] = module, type(module)
    checks = [f"type(mo{k}) is mt{k}", f"m{k}['training'] is {bool(module.training)}",
              f"len(m{k}['_modules']) == {len(attrs['_modules'])}"]
    checks += [f"not m{k}[{name!r}]" for name in _HOOKS if name in attrs] + [f"'forward' not in m{k}"]
    for kind in ("_parameters", "_buffers"):  # the same names (a bias added where there was none...)
        checks.append(f"len(m{k}[{kind!r}]) == {len(attrs[kind])}")
        checks += [f"m{k}[{kind!r}].get({name!r}, 0) is None" for name, t in attrs[kind].items() if t is None]
    for j, (name, child) in enumerate(attrs["_modules"].items()):
        ns[f"mc{k}_{j}"] = child
        checks.append(f"m{k}['_modules'].get({name!r}) is mc{k}_{j}")
    for j, (name, value) in enumerate(attrs.items()):
        if name in internals or guarded:
            continue
        same = all(isinstance(v, plain) for v in value) if isinstance(value, (tuple, list)) else isinstance(value, plain)
        ns[f"mv{k}_{j}"] = (type(value), list(value) if same and isinstance(value, list) else value)
        if same:  # a setting: equal to what was compiled, of the same type
            checks.append(f"type(m{k}.get({name!r})) is mv{k}_{j}[0] and m{k}[{name!r}] == mv{k}_{j}[1]")
        else:  # an object (a function, say): the same one
            checks.append(f"m{k}.get({name!r}) is mv{k}_{j}[1]")
    return checks


def _ready(p: Plan) -> Callable[[], list | None]:
    """A generated function reading the plan's state from its modules, checked against its layouts, and
    checking the modules' flags, submodules, settings and hooks and the grad mode (see _module_checks)."""
    import torch

    ns: dict[str, Any] = {"grad_enabled": torch.is_grad_enabled, "strided": torch.strided,
                          "default_dtype": torch.get_default_dtype, "dtype": torch.get_default_dtype(),
                          "function_modes": torch._C._len_torch_function_stack,
                          "dispatch_modes": torch._C._len_torch_dispatch_stack}
    lines = ["def ready():"]
    # the grad mode, the default dtype the child compiled with, no torch function or dispatch mode (which
    # torch.set_default_device is)
    checks = [f"grad_enabled() is {p.grad}", "default_dtype() is dtype", "not function_modes()",
              "not dispatch_modes()"]
    for k, (tensor, places) in enumerate(zip(p.state, p.where)):
        for j, (owner, kind, leaf) in enumerate(places):
            ns[f"o{k}_{j}"] = vars(owner)  # the module's __dict__: its _parameters may be replaced
            lines.append(f"    s{k}_{j} = o{k}_{j}[{kind!r}].get({leaf!r})")
            if j:
                checks.append(f"s{k}_{j} is s{k}_0")
        ns.update({f"c{k}": type(tensor), f"d{k}": tensor.dtype, f"h{k}": tensor.shape, f"t{k}": tensor.stride()})
        checks.append(f"type(s{k}_0) is c{k} and s{k}_0.dtype is d{k} and s{k}_0.shape == h{k} "
                      f"and s{k}_0.stride() == t{k} and s{k}_0.requires_grad is {tensor.requires_grad} "
                      f"and s{k}_0.is_cpu and s{k}_0.layout is strided and not s{k}_0.is_neg()")
    for k, module in enumerate(p.tree):
        checks += _module_checks(k, module, ns, p.guarded)
    ns["global_hooks"] = _global_hooks
    checks.append("not any(global_hooks())")
    lines.append(f"    if {' and '.join(checks)}:")
    lines.append(f"        return [{', '.join(f's{k}_0' for k in range(len(p.state)))}]")
    lines.append("    return None")
    exec(compile("\n".join(lines) + "\n", "<flowvm FUSED state check>", "exec"), ns)
    return ns["ready"]
