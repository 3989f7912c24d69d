"""Programs for differential testing of fuse-torch (tests/fused/test_differential.py).

A program is a REPEAT of a SEQ: a clock CALL, then one or two *templates*, each a run of torch calls and
``@flowvm.fusable`` functions over plain CPU tensors that fuse-torch turns into one FUSED step writing a
register ``h<k>``.  Every template reads, besides its inputs, something a compiled trace could take for a
constant: a list or dict among a call's constants, a global, a closure cell, an attribute of the object a
bound method belongs to, or process state (the default dtype, grad mode, deterministic algorithms, matmul
precision).  The clock, a plain CALL of its own and so never fused, records the registers at the start of
each iteration and then makes the mutations scheduled for that iteration, between two steps, in the same
place of the interpreted and of the optimized program.

Other templates meet what a compiled step must not compute differently however its trace was guarded, with
mutation kinds of their own: input registers made overlapping views of one tensor (``alias``), a forward hook
added to or removed from a module (``hook``), an assertion whose condition turns false (``nan``), an error
after in-place writes and random draws (``index``), and extreme values (``extreme``: signed zeros, infinities,
values out of int8's range for casts).  A program that raises records the error's type as its last record;
its final record holds the registers it writes in place and a draw from the global generator.

The templates are few and start from the same constants, so their step graphs are few and inductor's
on-disk cache shares their compiles across examples; what varies is which templates a program holds, how
long it runs and what changes when.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from hypothesis import strategies as st

import flowvm
from flowvm import CALL, REPEAT, SEQ, Registers

SIZE = 8
GAIN = 1.0  # read by by_global: a global of the module


@flowvm.fusable
def by_global(x):
    return torch.tanh(x) * GAIN


@flowvm.fusable
def checked(x):
    torch._assert_async(torch.isfinite(x).all())
    return x * 2.0


@flowvm.fusable
def by_dict(x, cfg):
    return torch.tanh(x) * cfg["gain"] + cfg["bias"]


def closure() -> tuple[Callable, Callable[[float], None]]:
    """A fusable function reading a closure cell, and the setter of that cell."""
    gain = 1.0

    @flowvm.fusable
    def by_cell(x):
        return torch.tanh(x) * gain

    def set_gain(value: float) -> None:
        nonlocal gain
        gain = value

    return by_cell, set_gain


class Scaler:
    def __init__(self) -> None:
        self.gain = 1.0

    @flowvm.fusable
    def by_attribute(self, x):
        return torch.tanh(x) * self.gain


class World:
    """The mutable values one built program reads (each build has its own, but the module's GAIN)."""

    def __init__(self) -> None:
        global GAIN
        GAIN = 1.0
        self.shifts = [1]                      # a list among a call's positional constants
        self.kw_shifts = [1]                   # a list among a call's keyword constants
        self.cfg = {"gain": 1.0, "bias": 0.5}  # a dict among a call's constants
        self.by_cell, self.set_gain = closure()
        self.scaler = Scaler()
        self.leaf = torch.full((SIZE,), 0.5, requires_grad=True)  # a constant tensor needing a gradient
        self.reg: Registers | None = None      # the program's registers (build sets them)
        g = torch.Generator().manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(SIZE, SIZE), torch.nn.Tanh())
        self.bn_net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.3),
                                          torch.nn.Tanh())
        with torch.no_grad():
            for p in list(self.net.parameters()) + list(self.bn_net.parameters()):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.hooks: list = []                  # handles of the hooks the "hook" mutation added


def _roll(w: World, x, t, h):
    return [CALL(torch.roll, x, w.shifts, 0, store_to=t), CALL(torch.mul, t, 2.0, store_to=h)]


def _roll_kw(w: World, x, t, h):
    return [CALL(torch.roll, x, shifts=w.kw_shifts, dims=0, store_to=t), CALL(torch.add, t, 1.0, store_to=h)]


def _dict(w: World, x, t, h):
    return [CALL(by_dict, x, w.cfg, store_to=t), CALL(torch.neg, t, store_to=h)]


def _global(w: World, x, t, h):
    return [CALL(by_global, x, store_to=t), CALL(torch.neg, t, store_to=h)]


def _cell(w: World, x, t, h):
    return [CALL(w.by_cell, x, store_to=t), CALL(torch.neg, t, store_to=h)]


def _attribute(w: World, x, t, h):
    return [CALL(w.scaler.by_attribute, x, store_to=t), CALL(torch.neg, t, store_to=h)]


def _ones(w: World, x, t, h):  # creates a tensor: its dtype is the default dtype
    return [CALL(torch.ones, SIZE, store_to=t), CALL(torch.add, x, t, store_to=h)]


def _leaf(w: World, x, t, h):  # w needs a gradient: the result does too under grad mode
    return [CALL(torch.mul, x, w.leaf, store_to=t), CALL(torch.tanh, t, store_to=h)]


def _cumsum(w: World, x, t, h):
    return [CALL(torch.cumsum, x, 0, store_to=t), CALL(torch.sin, t, store_to=h)]


def _matmul(w: World, x, t, h):
    return [CALL(torch.outer, x, x, store_to=t), CALL(torch.matmul, t, t, store_to=t),
            CALL(torch.sum, t, 0, store_to=h)]


def _alias(w: World, x, t, h):  # writes a, reads b: overlapping a and b, the write shows in b
    r = w.reg
    return [CALL(torch.Tensor.add_, r("a"), 1.0), CALL(torch.mul, r("b"), 2.0, store_to=t),
            CALL(torch.add, t, r("a"), store_to=h)]


def _hook(w: World, x, t, h):
    return [CALL(w.net, x, store_to=t), CALL(torch.mul, t, 2.0, store_to=h)]


def _bn_hook(w: World, x, t, h):  # training: BatchNorm's statistics written, dropout's draws
    return [CALL(torch.reshape, x, (2, 4), store_to=t), CALL(w.bn_net, t, store_to=t),
            CALL(torch.flatten, t, store_to=h)]


def _assert(w: World, x, t, h):
    return [CALL(torch.isfinite, x, store_to=t), CALL(torch.all, t, store_to=t), CALL(torch._assert_async, t),
            CALL(torch.add, x, 1.0, store_to=h)]


def _assert_fn(w: World, x, t, h):  # the assertion inside a function of the program's
    return [CALL(checked, x, store_to=t), CALL(torch.neg, t, store_to=h)]


def _raise(w: World, x, t, h):  # a draw and a write, then an index that may be out of range
    r = w.reg
    return [CALL(torch.rand, SIZE, store_to=t), CALL(torch.Tensor.add_, r("acc"), t),
            CALL(torch.index_select, r("acc"), 0, r("idx"), store_to=h), CALL(torch.mul, h, 2.0, store_to=h)]


def _clamp(w: World, x, t, h):
    return [CALL(torch.clamp, x, min=0, store_to=t), CALL(torch.reciprocal, t, store_to=h)]


def _fmax(w: World, x, t, h):
    return [CALL(torch.zeros_like, x, store_to=t), CALL(torch.neg, t, store_to=t), CALL(torch.fmax, x, t, store_to=t),
            CALL(torch.reciprocal, t, store_to=h)]


def _int8(w: World, x, t, h):
    return [CALL(torch.mul, x, 100.0, store_to=t), CALL(torch.Tensor.to, t, torch.int8, store_to=h)]


def _mul0(w: World, x, t, h):  # inductor folds x * 0 (an int zero) to zeros: infinities and NaN would vanish
    return [CALL(torch.mul, x, 0, store_to=t), CALL(torch.add, t, 1.0, store_to=h)]


# template -> (builder, the mutation kinds it is most sensitive to)
TEMPLATES: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "roll": (_roll, ("list",)),
    "roll_kw": (_roll_kw, ("kwarg",)),
    "dict": (_dict, ("dict",)),
    "global": (_global, ("global",)),
    "cell": (_cell, ("cell",)),
    "attribute": (_attribute, ("attribute",)),
    "ones": (_ones, ("dtype",)),
    "leaf": (_leaf, ("grad",)),
    "cumsum": (_cumsum, ("deterministic",)),
    "matmul": (_matmul, ("precision",)),
    "alias": (_alias, ("alias",)),
    "hook": (_hook, ("hook",)),
    "bn_hook": (_bn_hook, ("hook",)),
    "assert": (_assert, ("nan",)),
    "assert_fn": (_assert_fn, ("nan",)),
    "raise": (_raise, ("index",)),
    "clamp": (_clamp, ("extreme",)),
    "fmax": (_fmax, ("extreme",)),
    "int8": (_int8, ("extreme",)),
    "mul0": (_mul0, ("extreme",)),
}

PROCESS = ("dtype", "grad", "deterministic", "precision")

# kind -> the values it may take (the first is the value every program starts from)
VALUES: dict[str, tuple] = {
    "list": (1, 3, -2),
    "kwarg": (1, 2, -3),
    "dict": (1.0, 3.0, -0.5),
    "global": (1.0, 3.0, -0.5),
    "cell": (1.0, 3.0, -0.5),
    "attribute": (1.0, 3.0, -0.5),
    "dtype": (torch.float32, torch.float64),
    "grad": (True, False),
    "deterministic": (False, True),
    "precision": ("highest", "medium", "high"),
    "alias": ("separate", "overlap"),
    "hook": ("off", "on"),
    "nan": (False, True),
    "index": (1, SIZE + 5),
    "extreme": (False, True),
}

EXTREME = (0.0, -0.0, float("inf"), -float("inf"), 3.0, -2.5, 1e10, -0.0)  # times 100: out of int8's range


def mutate(w: World, kind: str, value: Any) -> None:
    global GAIN
    if kind == "list":
        w.shifts[0] = value
    elif kind == "kwarg":
        w.kw_shifts[0] = value
    elif kind == "dict":
        w.cfg["gain"] = value
    elif kind == "global":
        GAIN = value
    elif kind == "cell":
        w.set_gain(value)
    elif kind == "attribute":
        w.scaler.gain = value
    elif kind == "dtype":
        torch.set_default_dtype(value)
    elif kind == "grad":
        torch.set_grad_enabled(value)
    elif kind == "deterministic":
        torch.use_deterministic_algorithms(value)
    elif kind == "precision":
        torch.set_float32_matmul_precision(value)
    elif kind == "alias":
        if value == "overlap":  # two views of one tensor, one element apart
            base = torch.linspace(0.0, 1.0, SIZE + 1)
            w.reg["a"], w.reg["b"] = base[:SIZE], base[1:]
        else:
            w.reg["a"], w.reg["b"] = torch.linspace(0.0, 1.0, SIZE), torch.linspace(1.0, 2.0, SIZE)
    elif kind == "hook":
        if value == "on":
            for m in (w.net[1], w.bn_net[3]):
                w.hooks.append(m.register_forward_hook(lambda mod, args, out: out * 2.0 + 1.0))
        else:
            while w.hooks:
                w.hooks.pop().remove()
    elif kind == "nan":
        x = w.reg["x"].clone()
        x[3] = float("nan") if value else 0.5
        w.reg["x"] = x
    elif kind == "index":
        w.reg["idx"] = torch.tensor([0, value])
    elif kind == "extreme":
        w.reg["x"] = torch.tensor(EXTREME) if value else torch.randn(SIZE, generator=torch.Generator().manual_seed(0))
    else:  # pragma: no cover - a kind without a mutation is a bug of this module
        raise ValueError(f"no mutation of kind {kind!r}")


@contextlib.contextmanager
def process_state():
    """Put the process state the mutations change back as it was, and the module's GAIN."""
    global GAIN
    saved = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
             torch.get_float32_matmul_precision(), GAIN)
    try:
        yield
    finally:
        torch.set_default_dtype(saved[0])
        torch.set_grad_enabled(saved[1])
        torch.use_deterministic_algorithms(saved[2])
        torch.set_float32_matmul_precision(saved[3])
        GAIN = saved[4]


@dataclass(frozen=True)
class Spec:
    """What a program is: its templates, how many iterations, and (iteration, kind, value) mutations,
    made at the start of that iteration (after the clock recorded the registers)."""

    templates: tuple[str, ...]
    iterations: int
    mutations: tuple[tuple[int, str, Any], ...]
    together: bool = False  # the templates fuse into one step (else a plain CALL separates them)

    def __str__(self) -> str:
        muts = ", ".join(f"@{i} {k}={v}" for i, k, v in self.mutations)
        return f"{('&' if self.together else '+').join(self.templates)} x{self.iterations} [{muts}]"


@st.composite
def specs(draw, templates: tuple[str, ...] = tuple(TEMPLATES), max_templates: int = 2,
          iterations: tuple[int, int] = (3, 6), first_mutation: int = 1, together: bool | None = False) -> Spec:
    """Programs of up to max_templates templates, with one to three mutations from first_mutation on: of
    the kinds the templates read most of the time, of any process state otherwise (together: None draws
    whether the templates fuse into one step)."""
    chosen = tuple(draw(st.lists(st.sampled_from(templates), min_size=1, max_size=max_templates, unique=True)))
    n = draw(st.integers(max(iterations[0], first_mutation + 1), iterations[1]))
    own = [k for t in chosen for k in TEMPLATES[t][1]]
    kinds = st.sampled_from(own) | st.sampled_from([k for k in PROCESS if k not in own] or own)
    muts = draw(st.lists(st.tuples(st.integers(first_mutation, n - 1), kinds), min_size=1, max_size=3))
    mutations = tuple(sorted(((i, k, draw(st.sampled_from(VALUES[k][1:] + VALUES[k][:1]))) for i, k in muts),
                             key=lambda m: m[0]))
    joined = draw(st.booleans()) if together is None else together
    return Spec(chosen, n, mutations, joined and len(chosen) > 1)


@dataclass
class Clock:
    """The program's first CALL each iteration: records its arguments (the registers), then makes the
    mutations of that iteration.  ``before(i)`` runs first at iteration i (the tests wait there)."""

    world: World
    mutations: tuple
    before: Callable[[int], None] | None = None
    iteration: int = 0
    records: list = field(default_factory=list)
    made: int = 0

    def tick(self, *values):
        self.records.append(snapshot(values))
        if self.before is not None:
            self.before(self.iteration)
        for i, kind, value in self.mutations:
            if i == self.iteration:
                mutate(self.world, kind, value)
                self.made += 1
        self.iteration += 1

    def between(self):
        """Separates two templates, so that each fuses into a step of its own."""


def snapshot(values) -> tuple:
    return tuple((v.dtype, tuple(v.shape), v.requires_grad, v.detach().clone()) if isinstance(v, torch.Tensor)
                 else v for v in values)


@dataclass
class Built:
    program: Any
    reg: Registers
    world: World
    clock: Clock
    outputs: list[str]


def build(spec: Spec) -> Built:
    """A fresh program for spec, with its own registers and mutable values."""
    world = World()
    clock = Clock(world, spec.mutations)
    outputs = [f"h{k}" for k in range(len(spec.templates))]
    g = torch.Generator().manual_seed(0)
    reg = Registers(x=torch.randn(SIZE, generator=g), **{h: torch.zeros(SIZE) for h in outputs})
    for name, value in initial().items():
        reg[name] = value
    world.reg = reg
    body = [CALL(clock.tick, *[reg(h) for h in outputs])]
    for k, name in enumerate(spec.templates):
        if k and not spec.together:
            body.append(CALL(clock.between))
        body += TEMPLATES[name][0](world, reg("x"), reg(f"t{k}"), reg(f"h{k}"))
    return Built(REPEAT(spec.iterations, SEQ(body)), reg, world, clock, outputs)


def initial() -> dict:
    """The registers some templates read besides x: a and b (alias), acc and idx (raise)."""
    return {"a": torch.linspace(0.0, 1.0, SIZE), "b": torch.linspace(1.0, 2.0, SIZE), "acc": torch.zeros(SIZE),
            "idx": torch.tensor([0, 1])}


EXTRA = ("a", "b", "acc")  # registers written in place, in the final record


def run(built: Built, program: Any = None) -> list:
    """Run built's program (or program, an optimized form of it over the same registers) to the end under
    restored process state, the global generator seeded; the records of each iteration, the error's type if
    it raised, and the final registers (those written in place too) with a draw from the global generator."""
    error = []
    with process_state():
        torch.manual_seed(1234)
        try:
            (program if program is not None else built.program).run()
        except Exception as err:  # the same error at the same iteration in both runs
            error = [(("raised", type(err).__name__),)]
        final = snapshot([built.reg[h] if h in built.reg else torch.zeros(0) for h in built.outputs]
                         + [built.reg[e] for e in EXTRA] + [torch.rand(4)])
    return built.clock.records + error + [final]


def bit_for_bit(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaNs at the same places, zeros of the same sign."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = torch.isnan(a)
    return (torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])
            and torch.equal(a[~nan].signbit(), b[~nan].signbit()))


def differences(expected: list, got: list, exact: bool) -> list[str]:
    """Where two runs' records differ: dtypes, shapes and gradient flags exactly, values bit for bit
    (exact) or to float rounding."""
    out = []
    if len(expected) != len(got):
        return [f"{len(got)} records instead of {len(expected)}"]
    for i, (a_rec, b_rec) in enumerate(zip(expected, got)):
        if len(a_rec) != len(b_rec) or isinstance(a_rec[0], tuple) and a_rec[0][:1] == ("raised",) or \
                isinstance(b_rec[0], tuple) and b_rec[0][:1] == ("raised",):
            if a_rec != b_rec:
                out.append(f"record {i}: {b_rec[0]} instead of {a_rec[0]}")
            continue
        for k, (a, b) in enumerate(zip(a_rec, b_rec)):
            where = f"iteration {i}, h{k}"
            if a[:3] != b[:3]:
                out.append(f"{where}: (dtype, shape, requires_grad) {b[:3]} instead of {a[:3]}")
            elif exact and not bit_for_bit(a[3], b[3]):
                out.append(f"{where}: not bit for bit, max abs diff {(a[3] - b[3]).abs().max().item():.3g}")
            elif not torch.allclose(a[3], b[3], rtol=1e-5, atol=1e-6, equal_nan=True):
                diff = (a[3].double() - b[3].double()).nan_to_num(float("inf")).abs().max().item()
                out.append(f"{where}: max abs diff {diff:.3g}")
            elif a[3].is_floating_point() and ((a[3] == 0) & (b[3] == 0) & (a[3].signbit() != b[3].signbit())).any():
                out.append(f"{where}: zeros of the other sign")
    return out
