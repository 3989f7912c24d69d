"""The check a stateful step's package runs behind (flowvm/fused/stateful.py, flowvm/fused/kernel.py): before
each call, a generated function reads the plan's state from its modules, checks it against the layouts
compiled, and checks the modules' training flags, submodules, settings and hooks, the grad mode, the default
dtype and that no torch function or dispatch mode is active."""

from __future__ import annotations

import functools
from typing import Any, Callable

from . import torch_internals


@functools.lru_cache(maxsize=None)
def internal_module_classes() -> frozenset:
    """The attributes every nn.Module has (its hook dicts, _parameters...)."""
    import torch

    return frozenset(vars(torch.nn.Module()))


HOOK_ATTRS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_module_registration_hooks",
                 "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")


def global_hooks() -> list:
    from torch.nn.modules import module as nnmodule

    return [getattr(nnmodule, name, None) for name in _GLOBAL_HOOKS]


def _module_checks(k: int, module: Any, ns: dict, guarded: bool, as_compiled: bool = False) -> list[str]:
    """Source checking that module k computes what it computed when compiled: the same training flag,
    submodules and settings (a Dropout's ``p``, a BatchNorm's ``eps``...), and no hook.  A guarded step's
    settings are those its guards name (flowvm/fused/guards.py), not every attribute: a counter of the
    user's that the step does not read may change.  With as_compiled (the thread's compile, which traced the
    hooks and an instance's ``forward`` there were), the same hooks and ``forward`` as when compiled."""
    attrs = vars(module)
    ns[f"m{k}"] = attrs  # its dicts are read from it at each call (Sequential's del replaces _modules)
    ns[f"mo{k}"], ns[f"mt{k}"] = module, type(module)
    checks = [f"type(mo{k}) is mt{k}", f"m{k}['training'] is {bool(module.training)}",
              f"len(m{k}['_modules']) == {len(attrs['_modules'])}"]
    checks += _hook_checks(k, attrs, ns, as_compiled)
    for kind in ("_parameters", "_buffers"):  # the same names (a bias added where there was none...)
        checks.append(f"len(m{k}[{kind!r}]) == {len(attrs[kind])}")
        checks += [f"m{k}[{kind!r}].get({name!r}, 0) is None" for name, t in attrs[kind].items() if t is None]
    for j, (name, child) in enumerate(attrs["_modules"].items()):
        ns[f"mc{k}_{j}"] = child
        checks.append(f"m{k}['_modules'].get({name!r}) is mc{k}_{j}")
    if not guarded:
        checks += _setting_checks(k, attrs, ns)
    return checks


def _hook_checks(k: int, attrs: dict, ns: dict, as_compiled: bool) -> list[str]:
    """No hook and no instance ``forward``; with as_compiled, the same hooks and ``forward`` as when compiled."""
    if not as_compiled:
        return [f"not m{k}[{name!r}]" for name in HOOK_ATTRS if name in attrs] + [f"'forward' not in m{k}"]
    checks = []
    for name in HOOK_ATTRS:
        if name in attrs and attrs[name]:
            ns[f"mh{k}_{name}"] = tuple(attrs[name].items())
            checks.append(f"tuple(m{k}[{name!r}].items()) == mh{k}_{name}")
        elif name in attrs:
            checks.append(f"not m{k}[{name!r}]")
    ns[f"mf{k}"] = attrs.get("forward")
    checks.append(f"m{k}.get('forward') is mf{k}")
    return checks


def _setting_checks(k: int, attrs: dict, ns: dict) -> list[str]:
    """The module's own attributes as compiled: settings equal and of the same type, other objects the same."""
    import torch

    own = internal_module_classes()
    plain = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
    checks = []
    for j, (name, value) in enumerate(attrs.items()):
        if name in own:
            continue
        same = all(isinstance(v, plain) for v in value) if isinstance(value, (tuple, list)) else isinstance(value, plain)
        ns[f"mv{k}_{j}"] = (type(value), list(value) if same and isinstance(value, list) else value)
        if same:  # a setting: equal to what was compiled, of the same type
            checks.append(f"type(m{k}.get({name!r})) is mv{k}_{j}[0] and m{k}[{name!r}] == mv{k}_{j}[1]")
        else:  # an object (a function, say): the same one
            checks.append(f"m{k}.get({name!r}) is mv{k}_{j}[1]")
    return checks


def ready_check(p: Any) -> Callable[[], list | None]:
    """A generated function reading the plan's state from its modules, checked against its layouts, and
    checking the modules' flags, submodules, settings and hooks and the grad mode (see _module_checks)."""
    import torch

    ns: dict[str, Any] = {"grad_enabled": torch.is_grad_enabled, "strided": torch.strided,
                          "default_dtype": torch.get_default_dtype, "dtype": torch.get_default_dtype(),
                          "function_modes": torch_internals.mode_depths()[0], "dispatch_modes": torch_internals.mode_depths()[1]}
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
    ns["global_hooks"] = global_hooks
    checks.append("not any(global_hooks())")
    lines.append(f"    if {' and '.join(checks)}:")
    lines.append(f"        return [{', '.join(f's{k}_0' for k in range(len(p.state)))}]")
    lines.append("    return None")
    exec(compile("\n".join(lines) + "\n", "<flowvm FUSED state check>", "exec"), ns)
    return ns["ready"]


def thread_check(modules: list) -> Callable[[], bool] | None:
    """For a step compiled on the thread: a generated function telling whether its modules (and their
    submodules) are as compiled: type, training flag, submodules, parameter and buffer names, hooks and an
    instance's ``forward``, and torch's global module hooks.  Dynamo's guards leave hooks out
    (``skip_nnmodule_hook_guards``).  None when the step holds no module."""
    import torch

    tree: list = []
    for m in modules:
        for sub in m.modules():
            if not any(sub is t for t in tree):
                tree.append(sub)
    if not tree:
        return None
    ns: dict[str, Any] = {}
    checks = []
    for k, module in enumerate(tree):
        checks += _module_checks(k, module, ns, guarded=True, as_compiled=True)
    from torch.nn.modules import module as nnmodule

    for j, name in enumerate(_GLOBAL_HOOKS):
        hooks = getattr(nnmodule, name, None)
        if isinstance(hooks, dict):
            ns[f"g{j}"], ns[f"gh{j}"] = hooks, tuple(hooks.items())
            checks.append(f"not g{j}" if not hooks else f"tuple(g{j}.items()) == gh{j}")
    del torch
    source = f"def modules_ok():\n    return {' and '.join(checks)}\n"
    exec(compile(source, "<flowvm FUSED module check>", "exec"), ns)
    return ns["modules_ok"]
