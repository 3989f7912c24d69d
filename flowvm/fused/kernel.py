"""The package of a stateful step in the program's process (flowvm/fused/stateful.py plans it,
flowvm/fused/childcompile.py builds it)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from . import torch_internals
from .checks import mismatch
from .childcompile import distinct as _distinct
from .stateful import BACKWARD, FORWARD, META, Plan


def _loader(path: str) -> Any:
    return torch_internals.aoti_loader(path)


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
        self.draws = meta.get("draws", True)
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
        rng = torch.get_rng_state() if self.draws else None
        try:
            if self.backward is None:
                first = len(self.mutated)
                outs = self._forward(state + inputs)[first:first + self.results]
            else:
                outs = self.function.apply(*state, *inputs)
        except Exception:  # the step runs again eagerly (Runtime._direct_failed): with the generator as it was
            if rng is not None:
                torch.set_rng_state(rng)
            raise
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
