"""Random programs for the resume search (tests/resume/rsearch.py), as plain data: a *spec* is a nested list
that names element kinds (each possibly its module-level subclass) and leaf *mutations*; build(spec) makes the
program with fresh registers, seeded generators and torch's settings reset, each time alike.  A spec is JSON,
so a program file for the command (``flowvm run prog.py``) rebuilds it by value, and a failure shrinks by
editing the spec.

Mutations are an extensible list: each is a kind of leaf (or short SEQ of leaves) that stresses one thing a
resumed copy must carry.  A bug found from outside becomes a new Mutation here.  Each says what it needs:
'plain' (nothing), 'numpy', 'lazy-torch' (imports torch inside the leaf, keeps no torch object in a register:
such a copy loads without torch) or 'torch' (torch objects in registers).  This module never imports torch
at its top: a program without torch mutations resumes without torch.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from flowvm import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Registers


# ----------------------------------------------------------------- subclasses of every kind (module level: they
# pickle by reference)
class SubCALL(CALL): pass        # noqa: E701
class SubPRINT(PRINT): pass      # noqa: E701
class SubSEQ(SEQ): pass          # noqa: E701
class SubREPEAT(REPEAT): pass    # noqa: E701
class SubLOOP(LOOP): pass        # noqa: E701
class SubWHILE(WHILE): pass      # noqa: E701
class SubSWITCH(SWITCH): pass    # noqa: E701
class SubWEAVE(WEAVE): pass      # noqa: E701
class SubBUFFER(BUFFER): pass    # noqa: E701


KINDS = {False: dict(CALL=CALL, PRINT=PRINT, SEQ=SEQ, REPEAT=REPEAT, LOOP=LOOP, WHILE=WHILE, SWITCH=SWITCH,
                     WEAVE=WEAVE, BUFFER=BUFFER),
         True: dict(CALL=SubCALL, PRINT=SubPRINT, SEQ=SubSEQ, REPEAT=SubREPEAT, LOOP=SubLOOP, WHILE=SubWHILE,
                    SWITCH=SubSWITCH, WEAVE=SubWEAVE, BUFFER=SubBUFFER)}

P = 1_000_003


# ------------------------------------------------------------------------------------------ leaf functions
def inc(a):
    return (a + 1) % P


def mix(a, b, k=3):
    return (a * k + b + 1) % P


def mod2(a):
    return int(a) % 2


def below(counter, limit):
    """WHILE condition: counts up to limit, then 0 (stop), which also resets the counter."""
    return counter + 1 if counter + 1 <= limit else 0


def record(log, value):
    log.append(value)
    return len(log)


def py_draw(acc):
    return acc + random.random()


def np_draw(acc):
    return acc + np.random.standard_normal(3)


def np_fold(acc, batch):
    return acc + float(np.asarray(batch, dtype=np.float64).sum())


def next_of(it, log):
    value = next(it, -1)
    log.append(value)
    return value


def torch_draw(log):
    """Imports torch itself (the program may be the first to), draws from torch's global generator."""
    import torch

    log.append(torch.randint(0, 1_000_000, (3,)).tolist())
    if torch.cuda.is_available():
        log.append(torch.randint(0, 1_000_000, (2,), device="cuda").tolist())
    return len(log)


def torch_setting(which, value):
    """Changes a torch setting that changes results; imports torch itself."""
    import torch

    if which == "dtype":
        torch.set_default_dtype(getattr(torch, value))
    elif which == "threads":
        torch.set_num_threads(value)
    elif which == "deterministic":
        torch.use_deterministic_algorithms(value)
    elif which == "precision":
        torch.set_float32_matmul_precision(value)
    return value


def torch_compute(log):
    """Values that depend on the default dtype (and the generator): kept as Python floats."""
    import torch

    a = torch.ones(3) / 3
    m = torch.randn(4, 4)
    log.append([str(a.dtype), a.tolist(), (m @ m).sum().item()])
    return len(log)


def loss_of(net, x, y):
    """The forward pass of a training step: a loss whose backward is a later CALL."""
    import torch

    return torch.nn.functional.mse_loss(net(x), y)


def weight_sum(net):
    return float(sum(p.detach().double().sum() for p in net.parameters()))


def live_graph(value) -> bool:
    """Whether value is a tensor whose autograd graph a backward could still run through (saved tensors not
    freed yet): the oracle for where a copy may be refused."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor) or value.grad_fn is None:
        return False
    fn = value.grad_fn
    for name in dir(fn):
        if name.startswith("_saved_"):
            try:
                getattr(fn, name)
            except RuntimeError:
                return False
    return True


# ------------------------------------------------------------------------------------------------ mutations
@dataclass
class Mutation:
    """A kind of leaf: ``params(rng)`` draws its JSON parameters, ``make(ctx, params, K)`` returns the element
    (K: the element kinds, plain or subclasses)."""
    name: str
    needs: str  # 'plain', 'numpy', 'lazy-torch' or 'torch'
    params: Callable[[Any], Any]
    make: Callable[["Context", Any, dict], Any]
    weight: int = 1
    long_only: bool = False
    state_refused: bool = False  # a state file refuses it (documented: docs/state.md), a pickle copies it
    copy_refused: bool = False  # no copy can hold it (a generator): every copy is refused, naming its register


class Context:
    """What build() makes alongside the elements: the registers and the objects some leaves hold."""

    def __init__(self):
        self.reg = Registers(r0=1, r1=2, r2=3, r3=5, n0=2, log=[], pacc=0.0, nacc=np.zeros(3), facc=0.0)
        self.uid = 0

    def fresh(self, prefix, initial=None):
        self.uid += 1
        name = f"{prefix}{self.uid}"
        self.reg[name] = initial
        return name


def _int_leaf(ctx, p, K):
    r = ctx.reg
    if p[0] == 0:
        return K["CALL"](inc, r(f"r{p[1]}"), store_to=r(f"r{p[2]}"))
    return K["CALL"](mix, r(f"r{p[1]}"), r(f"r{p[2]}"), k=p[0], store_to=r(f"r{p[1]}"))


def _train_step(ctx, p, K):
    import torch

    r = ctx.reg
    g = torch.Generator().manual_seed(p["seed"])
    net = torch.nn.Linear(3, 1)
    with torch.no_grad():
        for q in net.parameters():
            q.copy_(torch.randn(q.shape, generator=g))
    opt = (torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5) if p["opt"] == "sgd"
           else torch.optim.Adam(net.parameters(), lr=0.05))
    m, o, x, y, loss = (ctx.fresh(n) for n in ("net", "opt", "x", "y", "loss"))
    r[m], r[o] = net, opt
    r[x], r[y] = torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)
    return K["SEQ"]([K["CALL"](opt.zero_grad),
                     K["CALL"](loss_of, r(m), r(x), r(y), store_to=r(loss)),
                     K["CALL"](torch.Tensor.backward, r(loss)),
                     K["CALL"](opt.step),
                     K["CALL"](weight_sum, r(m), store_to=r(ctx.fresh("w")))])


def _iterator(ctx, p, K):
    r = ctx.reg
    name = ctx.fresh("it", iter(list(range(p * 10, p * 10 + 7))))
    return K["CALL"](next_of, r(name), r("log"), store_to=r(ctx.fresh("v")))


def _generator(ctx, p, K):
    r = ctx.reg
    name = ctx.fresh("gen", (i * 3 for i in range(p, p + 7)))
    return K["CALL"](next_of, r(name), r("log"), store_to=r(ctx.fresh("v")))


def _batches(ctx, p, K):
    from flowvm import Batches

    r = ctx.reg
    data = Batches(np.arange(30, dtype=np.float64).reshape(10, 3) * (p["seed"] + 1), batch_size=3,
                   seed=p["seed"], workers=p["workers"])
    b = ctx.fresh("batch")
    return K["SEQ"]([K["CALL"](data.next_batch, store_to=r(b)),
                     K["CALL"](np_fold, r("facc"), r(b), store_to=r("facc"))])


SETTINGS_CHOICES = [("dtype", "float64"), ("dtype", "float32"), ("threads", 1), ("threads", 2),
                    ("deterministic", True), ("deterministic", False), ("precision", "high"),
                    ("precision", "highest"), ("precision", "medium")]

MUTATIONS: list[Mutation] = [
    Mutation("int", "plain", lambda c: [c.int(0, 4), c.int(0, 3), c.int(0, 3)], _int_leaf, weight=3),
    Mutation("print", "plain", lambda c: c.int(0, 3),
             lambda ctx, p, K: K["PRINT"]("r", ctx.reg(f"r{p}"))),
    Mutation("record", "plain", lambda c: c.int(0, 3),
             lambda ctx, p, K: K["CALL"](record, ctx.reg("log"), ctx.reg(f"r{p}"))),
    Mutation("py-random", "plain", lambda c: 0,
             lambda ctx, p, K: K["CALL"](py_draw, ctx.reg("pacc"), store_to=ctx.reg("pacc")), weight=2),
    Mutation("iterator", "plain", lambda c: c.int(0, 5), _iterator, state_refused=True),
    Mutation("generator", "plain", lambda c: c.int(0, 5), _generator, copy_refused=True),
    Mutation("np-random", "numpy", lambda c: 0,
             lambda ctx, p, K: K["CALL"](np_draw, ctx.reg("nacc"), store_to=ctx.reg("nacc")), weight=2),
    Mutation("batches", "numpy", lambda c: {"seed": c.int(0, 9), "workers": 0}, _batches),
    Mutation("batches-workers", "numpy", lambda c: {"seed": c.int(0, 9), "workers": 1}, _batches, long_only=True),
    Mutation("torch-draw", "lazy-torch", lambda c: 0,
             lambda ctx, p, K: K["CALL"](torch_draw, ctx.reg("log")), weight=2),
    Mutation("torch-setting", "lazy-torch", lambda c: list(c.choice(SETTINGS_CHOICES)),
             lambda ctx, p, K: K["CALL"](torch_setting, p[0], p[1])),
    Mutation("torch-compute", "lazy-torch", lambda c: 0,
             lambda ctx, p, K: K["CALL"](torch_compute, ctx.reg("log"))),
    Mutation("train-step", "torch", lambda c: {"seed": c.int(0, 99), "opt": c.choice(["sgd", "adam"])},
             _train_step, weight=2),
]
BY_NAME = {m.name: m for m in MUTATIONS}
NEEDS_ORDER = ("plain", "numpy", "lazy-torch", "torch")
#: what a program of each profile may draw: a program's profile caps the mutations it draws
PROFILES = {"plain": ("plain",), "numpy": ("plain", "numpy"), "lazy-torch": ("plain", "numpy", "lazy-torch"),
            "torch": NEEDS_ORDER}


# ------------------------------------------------------------------------------------------------ choosers
class RandomChooser:
    def __init__(self, seed):
        self.rng = random.Random(seed)

    def int(self, lo, hi):
        return self.rng.randint(lo, hi)

    def choice(self, options):
        return options[self.rng.randrange(len(options))]


class DrawChooser:
    def __init__(self, draw):
        from hypothesis import strategies as st

        self.draw, self.st = draw, st

    def int(self, lo, hi):
        return self.draw(self.st.integers(lo, hi))

    def choice(self, options):
        return options[self.draw(self.st.integers(0, len(options) - 1))]


# ------------------------------------------------------------------------------------------------ the specs
class SpecGenerator:
    """Draws a spec: ["seq", sub, [children]] and the like; every program terminates (LOOPs only as WEAVE
    children the WEAVE can abandon, WHILE counters with small limits, small counts)."""

    def __init__(self, chooser, profile="torch", long=False, subclasses=True):
        self.c = chooser
        allowed = PROFILES[profile]
        self.mutations = [m for m in MUTATIONS if m.needs in allowed and (long or not m.long_only)]
        self.subclasses = subclasses

    def sub(self):
        return bool(self.subclasses and self.c.int(0, 2) == 0)

    def leaf(self):
        pool = [m for m in self.mutations for _ in range(m.weight)]
        m = self.c.choice(pool)
        return ["leaf", self.sub(), m.name, m.params(self.c)]

    def finite(self, depth, force=False):
        c = self.c
        if depth <= 0 or (not force and c.int(0, 3) == 0):
            return self.leaf()
        kind = c.int(0, 5)
        sub = lambda first=False: self.finite(depth - 1, force=force and first)  # noqa: E731
        if kind == 0:
            return ["seq", self.sub(), [sub(i == 0) for i in range(c.int(1, 3))]]
        if kind == 1:
            return ["repeat", self.sub(), c.int(1, 3) if force else c.choice([0, 1, 2, 3, "n0"]), sub(True),
                    bool(c.int(0, 1))]
        if kind == 2:
            return ["while", self.sub(), c.int(1, 2), sub(True)]
        if kind == 3:
            return ["switch", self.sub(), sub(True), sub(True)]
        if kind == 4:
            return self.weave(depth, force)
        return ["buffer", self.sub(), c.int(1, 3), sub(True)]

    def weave(self, depth, force=False):
        c = self.c
        n = c.int(1, 3)
        children, finite = [], 0
        for i in range(n):
            if i > 0 and c.int(0, 2) == 0:
                children.append(["loop", self.sub(), ["seq", False, [self.leaf(), self.finite(depth - 2)]]])
            else:
                children.append(self.finite(depth - 1, force=force and i == 0))
                finite += 1
        n_required = -1 if finite == n and c.int(0, 1) else c.int(1, finite)
        weights = [c.choice([1, 2, 3, 0.5]) for _ in range(n)] if c.int(0, 2) == 0 else None
        return ["weave", self.sub(), n_required, children, weights]

    def program(self, depth=3):
        return ["seq", self.sub(), [self.leaf(), self.finite(depth, force=True), self.finite(depth - 1)]]


def random_spec(seed, profile="torch", depth=3, long=False, subclasses=True):
    return SpecGenerator(RandomChooser(seed), profile, long, subclasses).program(depth)


def spec_strategy(profile="torch", depth=3, long=False):
    from hypothesis import strategies as st

    @st.composite
    def specs(draw):
        return SpecGenerator(DrawChooser(draw), profile, long).program(depth)

    return specs()


# -------------------------------------------------------------------------------------------------- building
def reset_process(needs_torch: bool) -> None:
    """Seed the global generators and put torch's settings at their defaults (threads 1), as build() must:
    every build gives the same run."""
    random.seed(1234)
    np.random.seed(1234)
    torch = sys.modules.get("torch")
    if needs_torch and torch is None:
        import torch
    if torch is not None:
        torch.manual_seed(1234)
        torch.set_default_dtype(torch.float32)
        torch.use_deterministic_algorithms(False)
        torch.set_float32_matmul_precision("highest")
        torch.set_num_threads(1)


def build(spec) -> Any:
    """The program of spec, with fresh registers; seeds the generators and resets torch's settings (torch is
    imported only when a leaf of the program uses torch: seeded here, the run is the same whether or not the
    process had imported torch before)."""
    reset_process(needs(spec) in ("lazy-torch", "torch"))
    ctx = Context()
    return _element(ctx, spec)


def build_json(text: str):
    return build(json.loads(text))


def _element(ctx, node):
    kind, sub = node[0], node[1]
    K = KINDS[bool(sub)]
    r = ctx.reg
    if kind == "leaf":
        return BY_NAME[node[2]].make(ctx, node[3], K)
    if kind == "seq":
        return K["SEQ"]([_element(ctx, c) for c in node[2]])
    if kind == "repeat":
        n = r("n0") if node[2] == "n0" else node[2]
        counter = r(ctx.fresh("c")) if node[4] else None
        return K["REPEAT"](n, _element(ctx, node[3]), counter=counter)
    if kind == "while":
        w = ctx.fresh("w", 0)
        body = _element(ctx, node[3])
        return K["WHILE"](K["CALL"](below, r(w), node[2], store_to=r(w)), K["SEQ"]([K["CALL"](inc, r("r0"),
                                                                                         store_to=r("r0")), body]))
    if kind == "switch":
        return K["SWITCH"](K["CALL"](mod2, r("r1")), {0: _element(ctx, node[2]), 1: _element(ctx, node[3])})
    if kind == "weave":
        return K["WEAVE"](node[2], [_element(ctx, c) for c in node[3]], node[4])
    if kind == "loop":
        return K["LOOP"](_element(ctx, node[2]))
    if kind == "buffer":
        return K["BUFFER"](node[2], _element(ctx, node[3]), store_to=r(ctx.fresh("b")))
    raise ValueError(f"unknown node {kind!r}")


# ---------------------------------------------------------------------------------------------- spec queries
def leaves(spec):
    if spec[0] == "leaf":
        yield spec
        return
    for part in spec[2:]:
        if isinstance(part, list) and part and isinstance(part[0], str):
            yield from leaves(part)
        elif isinstance(part, list):
            for c in part:
                if isinstance(c, list) and c and isinstance(c[0], str):
                    yield from leaves(c)


def mutations_of(spec) -> list[str]:
    return sorted({leaf[2] for leaf in leaves(spec)})


def state_refused(spec) -> bool:
    """Whether a state file may refuse the run (it holds a value docs/state.md says a state file cannot hold)."""
    return any(BY_NAME[n].state_refused for n in mutations_of(spec))


def copy_refused(spec) -> bool:
    """Whether no copy of the run can hold it (it keeps a generator in a register ``gen<n>``): every copy must be
    refused, naming that register."""
    return any(BY_NAME[n].copy_refused for n in mutations_of(spec))


def needs(spec) -> str:
    """The program's profile: the most its mutations need."""
    found = {BY_NAME[n].needs for n in mutations_of(spec)}
    return max(found, key=NEEDS_ORDER.index, default="plain")


def has_subclasses(spec) -> bool:
    return _any(spec, lambda node: bool(node[1]))


def _any(node, test):
    if test(node):
        return True
    return any(_any(c, test) for c in children(node))


def children(node):
    kind = node[0]
    if kind == "leaf":
        return []
    if kind in ("seq",):
        return list(node[2])
    if kind in ("repeat", "while", "buffer"):
        return [node[3]]
    if kind == "switch":
        return [node[2], node[3]]
    if kind == "weave":
        return list(node[3])
    if kind == "loop":
        return [node[2]]
    return []


def plain_kinds(spec):
    """The same spec with every subclass replaced by its kind."""
    node = list(spec)
    node[1] = False
    kind = node[0]
    if kind == "seq":
        node[2] = [plain_kinds(c) for c in node[2]]
    elif kind in ("repeat", "while", "buffer"):
        node[3] = plain_kinds(node[3])
    elif kind == "switch":
        node[2], node[3] = plain_kinds(node[2]), plain_kinds(node[3])
    elif kind == "weave":
        node[3] = [plain_kinds(c) for c in node[3]]
    elif kind == "loop":
        node[2] = plain_kinds(node[2])
    return node


def smaller(spec):
    """Specs one edit smaller than spec (for shrinking a failure): a compound replaced by a finite child, a
    child dropped from a SEQ or WEAVE, a count lowered, a subclass made its kind."""
    out = []
    kind = spec[0]
    if kind == "leaf":
        return [["leaf", False, *spec[2:]]] if spec[1] else []
    for c in children(spec):
        if c[0] != "loop":
            out.append(c)
    if spec[1]:
        out.append([spec[0], False, *spec[2:]])
    if kind == "seq" and len(spec[2]) > 1:
        for i in range(len(spec[2])):
            out.append([kind, spec[1], spec[2][:i] + spec[2][i + 1:]])
    if kind == "weave" and len(spec[3]) > 1:
        for i in range(len(spec[3])):
            rest = spec[3][:i] + spec[3][i + 1:]
            finite = sum(1 for c in rest if c[0] != "loop")
            if finite == 0:
                continue
            nreq = spec[2] if spec[2] == -1 and finite == len(rest) else min(max(spec[2], 1), finite)
            w = None if spec[4] is None else spec[4][:i] + spec[4][i + 1:]
            out.append([kind, spec[1], nreq, rest, w])
    if kind in ("repeat", "buffer") and spec[2] not in (1, "n0"):
        out.append([kind, spec[1], 1, *spec[3:]])
    # an edit inside one child
    for idx, c in enumerate(children(spec)):
        for smaller_c in smaller(c):
            out.append(_replace_child(spec, idx, smaller_c))
    return out


def _replace_child(node, idx, new):
    node = json.loads(json.dumps(node))
    kind = node[0]
    if kind == "seq":
        node[2][idx] = new
    elif kind in ("repeat", "while", "buffer"):
        node[3] = new
    elif kind == "switch":
        node[2 + idx] = new
    elif kind == "weave":
        node[3][idx] = new
    elif kind == "loop":
        node[2] = new
    return node


def size(spec) -> int:
    return 1 + sum(size(c) for c in children(spec))


PROGRAM_FILE = '''"""A generated program for the resume search (tests/resume/rgen.py): `flowvm run` this file."""
import sys
sys.path.insert(0, {here!r})
import rgen

SPEC = {spec!r}


def build():
    return rgen.build_json(SPEC)
'''


def program_file(spec) -> str:
    import os

    return PROGRAM_FILE.format(here=os.path.dirname(os.path.abspath(__file__)), spec=json.dumps(spec))
