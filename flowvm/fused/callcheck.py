"""What the compiled form on the compile thread checks before each call besides dynamo's guards, and what a
failed call must not repeat (flowvm/fused/runtime.py, ``Runtime._compiled_call``):

- the inputs' aliasing: which tensor inputs share a storage (and at which offset from each other) is part of
  what was compiled; a step that writes in place, called with inputs overlapping otherwise (two views of one
  tensor where two tensors were), runs eagerly;
- the modules: their hooks, training flags, submodules and an instance's ``forward`` as compiled
  (``statecheck.thread_check``; dynamo's guards leave hooks out);
- a failed call: a step that writes in place or draws random numbers keeps, before each call, copies of the
  tensors it writes (known from the version counters its first call moved; all it may write until then) and
  the generator's state.  When the compiled form raises, they are put back and the step runs eagerly, as a
  failed call always did: the eager calls write and draw once, and raise the user's error if it is one.  A
  step writing more than COPY_BYTES keeps no copies: a failed call that wrote (a version counter moved) is
  raised as it is, never run again (that would write twice)."""

from __future__ import annotations

from typing import Any, Callable

from .statecheck import thread_check

COPY_BYTES = 16 << 20  # a step writing more than this in place is not copied before each call (see undo)


def _tensor_type():
    import torch

    return torch.Tensor


def alias_pattern(args: tuple) -> Any:
    """Which tensor inputs (and tensors in list or tuple inputs) share a storage: ((position, position of the
    first one on it, offset between them), ...); () when none does.  An input whose storage cannot be read
    gives a pattern equal to no other."""
    tensor = _tensor_type()
    first: dict = {}
    shared = []
    for k, a in enumerate(args):
        items = ((k, a),) if isinstance(a, tensor) else (
            tuple(((k, j), t) for j, t in enumerate(a) if isinstance(t, tensor)) if type(a) in (list, tuple) else ())
        for key, t in items:
            try:
                ptr = t.untyped_storage().data_ptr()
            except Exception:
                return object()
            if not ptr:  # no memory: overlaps nothing
                continue
            seen = first.get(ptr)
            if seen is None:
                first[ptr] = (key, t)
            else:
                shared.append((key, seen[0], t.storage_offset() - seen[1].storage_offset()))
    return tuple(shared)


def count_tensors(args: tuple) -> int:
    tensor = _tensor_type()
    return sum(1 if isinstance(a, tensor) else sum(isinstance(t, tensor) for t in a) if type(a) in (list, tuple)
               else 0 for a in args)


def step_modules(calls: Any) -> list:
    """The modules a step's calls hold: called, bound methods' objects, among the constants, and those a
    function of yours reads from its globals or closure cells or its object's attributes."""
    import torch

    found: list = []

    def add(value, depth=0):
        if isinstance(value, torch.nn.Module):
            if not any(value is f for f in found):
                found.append(value)
        elif depth < 3 and isinstance(value, (list, tuple, set, frozenset)):
            for v in value:
                add(v, depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for v in value.values():
                add(v, depth + 1)

    for call in calls:
        fn = call.fn
        add(fn)
        owner = getattr(fn, "__self__", None)
        add(owner)
        if owner is not None and not isinstance(owner, torch.nn.Module) and hasattr(owner, "__dict__"):
            for v in vars(owner).values():
                add(v)
        func = getattr(fn, "__func__", fn)
        code = getattr(func, "__code__", None)
        if code is not None and not (getattr(func, "__module__", None) or "").startswith("torch"):
            g = getattr(func, "__globals__", {})
            for name in code.co_names:
                add(g.get(name))
            for cell in getattr(func, "__closure__", None) or ():
                try:
                    add(cell.cell_contents)
                except ValueError:
                    pass
        for v in list(call.args) + list(call.kwargs.values()):
            add(v)
    return found


def state_tensors(calls: Any, modules: list) -> list:
    """The tensors a step may write besides its inputs: the modules' parameters and buffers, tensors among the
    calls' constants."""
    import torch

    out: list = []
    for m in modules:
        out += [t for t in m.parameters()] + [t for t in m.buffers()]
    for call in calls:
        for v in list(call.args) + list(call.kwargs.values()):
            if isinstance(v, torch.Tensor):
                out.append(v)
    uniq: dict = {}
    for t in out:
        uniq.setdefault(id(t), t)
    return list(uniq.values())


class CallCheck:
    """The thread's compiled form's own checks (see the module's docstring), made when its compile starts.
    ``writes`` and ``draws`` are set by the compile from the graphs inductor gets (True for other
    backends)."""

    def __init__(self, calls: Any, args: tuple, backend: Any):
        modules = step_modules(calls)
        self.modules_ok: Callable[[], bool] | None = thread_check(modules)
        self.state = state_tensors(calls, modules)
        self.patterns = {alias_pattern(args)}
        self.several = count_tensors(args) > 1
        exact = backend == "inductor"
        self.writes = not exact
        self.draws = not exact
        self.written: list[int] | None = None  # which of _tensors() the step writes, once a call told
        self.small = False                     # and they total at most COPY_BYTES


    def add(self, args: tuple) -> None:
        """Another compile, for these inputs (its graph may write other tensors)."""
        self.written = None
        self.patterns.add(alias_pattern(args))
        self.several = self.several or count_tensors(args) > 1

    def why_not(self, args: tuple) -> str | None:
        """Why these inputs, or the modules as they are now, must run eagerly (None: the compiled form may run)."""
        if self.writes and self.several and alias_pattern(args) not in self.patterns:
            return "inputs overlap in memory otherwise than when compiled, and the step writes in place"
        if self.modules_ok is not None and not self.modules_ok():
            return "a module's hooks, training flag or submodules differ from when compiled"
        return None

    def _tensors(self, args: tuple) -> list:
        import torch

        tensor = torch.Tensor
        out = list(self.state)
        for a in args:
            if isinstance(a, tensor):
                out.append(a)
            elif type(a) in (list, tuple):
                out += [t for t in a if isinstance(t, tensor)]
        return out

    def before(self, args: tuple) -> tuple | None:
        """What a failed call needs to be undone (None for a step that neither writes nor draws): copies of the
        tensors it writes (those its first call wrote; until then all it may write, with their version
        counters) while they total at most COPY_BYTES, else the version counters alone, and the generator's
        state."""
        if not (self.writes or self.draws):
            return None
        import torch

        rng = torch.get_rng_state() if self.draws else None
        if not self.writes:
            return None, None, None, rng
        tensors = self._tensors(args)
        written = self.written
        if written is not None and self.small:  # the usual case: copies of what it writes, no counters
            return tensors, None, _copies(tensors, written), rng
        chosen = range(len(tensors)) if written is None else written
        big = sum(tensors[k].nbytes for k in chosen if k < len(tensors)) > COPY_BYTES
        return tensors, [t._version for t in tensors], None if big else _copies(tensors, chosen), rng

    def after(self, saved: tuple | None) -> None:
        """A call went through: the first one tells which tensors the step writes (their versions moved)."""
        if self.written is None and saved is not None and saved[1] is not None:
            tensors, versions = saved[0], saved[1]
            self.written = [k for k, (t, v) in enumerate(zip(tensors, versions)) if t._version != v]
            self.small = sum(tensors[k].nbytes for k in self.written) <= COPY_BYTES

    def undo(self, saved: tuple | None) -> bool:
        """Undo a failed call: put back the tensors it wrote and the generator's state.  False when it wrote a
        tensor with no copy kept (the call must not be run again)."""
        if saved is None:
            return True
        import torch

        tensors, versions, copies, rng = saved
        if tensors is not None:
            moved = [k for k, _ in copies] if versions is None else \
                [k for k, (t, v) in enumerate(zip(tensors, versions)) if t._version != v]
            kept = dict(copies or ())
            if any(k not in kept for k in moved):
                return False
            with torch.no_grad():
                for k in moved:
                    tensors[k].copy_(kept[k])
        if rng is not None:
            torch.set_rng_state(rng)
        return True


def _copies(tensors: list, chosen) -> list:
    """(position, copy) for each chosen tensor there is."""
    return [(k, tensors[k].detach().clone()) for k in chosen if k < len(tensors)]
