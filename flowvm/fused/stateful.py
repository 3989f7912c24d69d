"""Compiling a fused step that calls torch modules (and may have a backward pass after it) in a child
process: the *stateful* kind of flowvm/fused/outofprocess.py.

A step such as ``zero_grad(); logits = net(x); loss = cross_entropy(logits, y)`` reads state of the program's
process, the module's parameters and buffers, and its result is differentiated later (``loss.backward()``).
It compiles out of process as torch.compile would compile it, with the state made explicit:

- the parent (``plan``) lists the modules the step calls, each parameter and buffer once (``state``),
  the modules' training flags and the grad mode, and pickles the step with every tensor replaced by an
  empty one of its layout (``payload``): the job never carries the program's data;
- the child (``childcompile.compile_job``, by named stages) makes the step a function of (state, inputs) by putting its arguments in
  the modules' place (``torch.nn.utils.stateless``), traces it with AOTAutograd into a forward graph and,
  when something needs a gradient, a backward graph, and builds an AOTInductor package of each;
- the parent (``kernel.Kernel``) runs the zero_grad calls of the step, then the forward package inside a
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
``p``...) and the grad mode is as compiled and that no hook was added (``statecheck``); the first call
is checked against eager (``Kernel.verify``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from . import torch_internals
from .checks import aoti_available, holds_state, plain_tensor, settings, torch_code, torch_function
from .refused import Refused
from .statecheck import HOOK_ATTRS, global_hooks, internal_module_classes, ready_check

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
    ready: Callable[[], list | None] | None = None  # the per-call check, of the modules as planned (ready_check)


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

    if any(global_hooks()):
        return "global module hooks"
    user = False
    for sub in module.modules():
        kind = type(sub).__name__
        if torch.nn.utils.parametrize.is_parametrized(sub):
            return f"{kind} has parametrizations"
        if any(getattr(sub, name, None) for name in HOOK_ATTRS):
            return f"{kind} has hooks"
        user = user or not _torch_class(type(sub))
        for name, value in vars(sub).items():
            if name in internal_module_classes():
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


def plan(calls: Any, inputs: list, args: tuple) -> Plan:
    """The plan for compiling a head with these calls (inputs: its input registers, args: their values)
    out of process (raises Refused saying why it is not of the stateful kind: it compiles on the thread).
    Its stages: the process's settings (``_process``), the calls (``_calls``), the modules' state
    (``_state``)."""
    import types

    import torch

    from .codegen import generate

    _process(args)
    c = _calls(calls)
    st = _state(c.modules)
    tree = [sub for m in c.modules for sub in m.modules()]
    head = generate(types.SimpleNamespace(calls=c.kept, inputs=list(inputs), outputs=_written(c.kept))).fused
    p = Plan(head=head, pre=c.pre, modules=c.modules, state=st.state, where=st.where, binds=st.binds, tree=tree,
             grad=torch.is_grad_enabled(), layouts=[(tuple(a.shape), tuple(a.stride()), a.dtype) for a in args],
             guarded=c.guarded)
    p.ready = ready_check(p)  # now: the child compiles the modules as they are now
    return p


def _process(args: tuple) -> None:
    """Refuse what no stateful step compiles under: inputs that are not plain CPU tensors, settings the
    package cannot follow."""
    import torch

    if not aoti_available():
        raise Refused("this torch cannot load AOTInductor packages, or this program cannot start python")
    if not args or not all(plain_tensor(a) and a.device.type == "cpu" for a in args):
        raise Refused("an input that is not a plain CPU tensor needing no gradient")
    if torch.is_inference_mode_enabled() or torch_internals.autocast_enabled():
        raise Refused("inference mode or autocast")
    if any(depth() for depth in torch_internals.mode_depths()):
        raise Refused("a torch function or dispatch mode (torch.set_default_device, say)")


@dataclass
class Calls:
    """The step's calls as the child compiles them: the zero_grad calls run eagerly before (``pre``), the
    others (``kept``), the modules they call, and whether code of the user's runs among them."""
    pre: list[Callable]
    kept: list
    modules: list
    guarded: bool


def _calls(calls: Any) -> Calls:
    c = Calls([], [], [], False)
    for call in calls:
        if _zero_grad(call):
            c.pre.append(call.fn)
        else:
            _take(c, call)
    if not c.modules or not c.kept or _zero_grad(calls[-1]):
        raise Refused("no module to compile, or a zero_grad call ends the step")
    return c


def _take(c: Calls, call: Any) -> None:
    """Add a call other than a zero_grad to ``c`` (raises Refused for one no stateful step takes)."""
    import types

    import torch

    from ..program.printer import call_text

    if holds_state(list(call.args)) or holds_state(dict(call.kwargs)):
        raise Refused(f"CALL {call_text(call)}: a tensor or module among its arguments")
    if isinstance(call.fn, torch.nn.Module):
        kind = _module_kind(call.fn)
        if kind is not None and kind != USER:
            raise Refused(f"CALL {call_text(call)}: {kind}")
        c.guarded = c.guarded or kind == USER
        if not any(m is call.fn for m in c.modules):
            c.modules.append(call.fn)
    elif not torch_function(call.fn):
        if getattr(call.fn, "__self__", None) is not None and not isinstance(call.fn.__self__, types.ModuleType):
            raise Refused(f"CALL {call_text(call)}: a method bound to an object")
        c.guarded = True
    c.kept.append(call)


@dataclass
class State:
    """Each parameter and buffer of the modules once (``state``), where each lives, and for each module its
    dotted names' indices in ``state``."""
    state: list = field(default_factory=list)
    where: list[list[tuple[Any, str, str]]] = field(default_factory=list)
    binds: list[dict[str, int]] = field(default_factory=list)


def _state(modules: list) -> State:
    st = State()
    for module in modules:
        bind: dict[str, int] = {}
        for kind, named in (("_parameters", module.named_parameters), ("_buffers", module.named_buffers)):
            for dotted, tensor in named(remove_duplicate=False):
                if tensor is not None:
                    bind[dotted] = _place(st, module, kind, dotted, tensor)
        st.binds.append(bind)
    if not st.state:
        raise Refused("no parameter or buffer")
    return st


def _place(st: State, module: Any, kind: str, dotted: str, tensor: Any) -> int:
    """The index of tensor in ``st.state`` (added when new), noting where it lives."""
    import torch

    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu" \
            or tensor.layout is not torch.strided or tensor.is_nested or tensor._backward_hooks:
        raise Refused(f"{type(module).__name__}.{dotted}: not a plain CPU tensor, or with hooks")
    owner_path, _, leaf = dotted.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    k = next((i for i, s in enumerate(st.state) if s is tensor), None)
    if k is None:
        k = len(st.state)
        st.state.append(tensor)
        st.where.append([])
    st.where[k].append((owner, kind, leaf))
    return k


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
