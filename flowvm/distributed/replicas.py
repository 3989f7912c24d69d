"""The check that the ranks of a data-parallel run hold one model: every torch module, parameter and optimizer
the run holds (in its registers, or in the objects its CALLs are bound to) must be bit for bit the same on every
rank, as DistributedDataParallel keeps its replicas, unless the program declares it per-rank.

A model trained on each rank's shard without DDP (or any other averaging of the gradients) becomes one model
per rank: the run would end with rank 0's and say nothing.  ``check(drv, per_rank)`` fingerprints each such
value on each rank (a 64-bit BLAKE2b digest of the bytes of its parameters, or of its optimizer's state),
gathers the short list of digests once through the group, and raises ``ReplicaError`` naming the first value
that differs.  ``Synchronized`` calls it at the first agreement after an optimizer's first step, before every
coordinated checkpoint and at the end of the run (docs/distributed.md, "One model on every rank").

Buffers (a BatchNorm's running statistics) are not compared: DDP broadcasts rank 0's at each forward, after
which each rank's own batch updates them.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any, Iterable, Iterator

from ..pickled import stable
from . import group

__all__ = ["ReplicaError", "check", "digests", "per_rank_names", "OptimizerSteps"]

ANY = "*"  # PER_RANK = "*": no value of the run is checked


@stable("flowvm.distributed")
class ReplicaError(group.AllRanksError):
    """The ranks of a data-parallel run hold different models: ``where`` names the value that differs (a
    register, ``registers/model``, or what a CALL is bound to), ``ranks`` the ranks whose copy differs from
    rank 0's, ``step`` the step it was found at.  The flowvm command prints it as one line and exits with
    status 2."""

    def __init__(self, message: str, where: str = "", ranks: tuple = (), step: int = 0):
        super().__init__(message)
        self.where, self.ranks, self.step = where, tuple(ranks), step


def per_rank_names(value: Any, source: str = "PER_RANK") -> frozenset[str]:
    """The register names a program declares per-rank (``PER_RANK = ("stats",)`` in a program file, or the
    ``per_rank`` argument): a name, a sequence of names, or "*" for every value of the run."""
    if value is None:
        return frozenset()
    if isinstance(value, str):
        value = (value,)
    try:
        names = tuple(value)
    except TypeError:
        raise TypeError(f"{source} must be register names (a tuple of str), got {type(value).__name__} "
                        f"{value!r:.60}") from None
    bad = [n for n in names if not isinstance(n, str) or not (n == ANY or n.isidentifier())]
    if bad:
        raise TypeError(f"{source} must be register names (a tuple of str), got {bad[0]!r:.60}")
    return frozenset(names)


# ------------------------------------------------------------------ what is checked
def _kind(value: Any) -> str | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, torch.nn.Parameter):
        return "parameter"
    return None


def held(drv, per_rank: frozenset[str] = frozenset()) -> list[tuple[str, str, Any]]:
    """(where, kind, value) of every module, optimizer and parameter the run holds, outermost only (a module's
    own parameters are part of it), registers first (so a value is named by its register), each once; the
    registers declared per-rank, and what is reachable only through them, left out."""
    from ..persist.culprit import DEPTH, program_places, values_in
    from ..program.protocol import Element

    if ANY in per_rank or "torch" not in sys.modules:
        return []
    seen: set[int] = set()
    roots: list[tuple[str, Any, bool]] = [(f"registers/{name}", value, name in per_rank)
                                          for name, value in dict(drv.registers).items()]
    roots.sort(key=lambda r: not r[2])  # the per-rank registers first: what they hold is theirs
    roots += [(w, v, False) for w, v in program_places(drv.program) if not isinstance(v, Element)]
    found: list[tuple[str, str, Any]] = []
    for where, value, skip in roots:
        inside: str | None = None
        for place, item in values_in(where, value, DEPTH, seen):
            if inside is not None and place.startswith(inside) and place[len(inside):len(inside) + 1] in ".[ ":
                continue  # part of a value found already
            kind = _kind(item)
            if kind is not None:
                inside = place
                if not skip:
                    found.append((place, kind, item))
    return found


# ------------------------------------------------------------------ digests
def _tensor_bytes(t) -> Any:
    import torch

    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.cpu().contiguous().reshape(-1)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    return t.view(torch.uint8).numpy()


def _feed(h, value: Any) -> None:
    torch = sys.modules["torch"]
    if isinstance(value, torch.Tensor):
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        h.update(memoryview(_tensor_bytes(value)))
    else:
        h.update(repr(value).encode())


def _digest(kind: str, value: Any) -> int:
    h = hashlib.blake2b(digest_size=8)
    if kind == "module":
        for name, p in value.named_parameters():
            h.update(name.encode())
            _feed(h, p)
    elif kind == "parameter":
        _feed(h, value)
    else:  # an optimizer: the state of each of its parameters, in its groups' order (not the parameters)
        for g in value.param_groups:
            for p in g["params"]:
                state = value.state.get(p) or {}
                for key in sorted(state, key=str):
                    h.update(str(key).encode())
                    _feed(h, state[key])
    return int.from_bytes(h.digest(), "little", signed=True)


def digests(drv, per_rank: frozenset[str] = frozenset()) -> list[tuple[str, str, int, Any]]:
    """(where, kind, digest, value) of every value ``held`` finds on this rank."""
    return [(where, kind, _digest(kind, value), value) for where, kind, value in held(drv, per_rank)]


# ------------------------------------------------------------------ the check
_WHAT = {"module": "a torch module", "optimizer": "an optimizer", "parameter": "a torch parameter"}
_DIFFERS = {"module": "its parameters differ", "optimizer": "its state differs", "parameter": "it differs"}


def _register(where: str) -> str | None:
    if not where.startswith("registers/"):
        return None
    name = where[len("registers/"):]
    for i, c in enumerate(name):
        if c in ".[ ":
            return name[:i]
    return name


def check(drv, per_rank: Iterable[str] = (), when: str = "") -> None:
    """Every rank's modules, parameters and optimizers (outside the registers declared per-rank) must be bit
    for bit rank 0's: one gather of a few digests through the group; ReplicaError on every rank alike,
    naming the first value that differs, otherwise.  Call it on every rank at the same step."""
    if group.world_size() <= 1:
        return
    names = per_rank if isinstance(per_rank, frozenset) else per_rank_names(per_rank)
    mine = digests(drv, names)
    differing = _differing(group.gather([(where, kind, d) for where, kind, d, _ in mine]))
    if differing:
        values = {where: value for where, _, _, value in mine}
        raise _refusal(differing, values, f" {when}" if when else f" at step {drv.steps}", drv.steps)


def _differing(every: list) -> list[tuple[str, str, list[int]]]:
    """(where, kind, the ranks whose digest differs from rank 0's) from each rank's (where, kind, digest)s."""
    maps = [{where: d for where, _, d in e} for e in every]
    differing = []
    for where, kind, d in every[0]:
        ranks = [r for r in range(1, len(every)) if maps[r].get(where) != d]
        if ranks:
            differing.append((where, kind, ranks))
    for r in range(1, len(every)):  # held on some rank but not on rank 0
        for where, kind, _ in every[r]:
            if where not in maps[0] and all(w != where for w, _, _ in differing):
                differing.append((where, kind, [r]))
    return differing


def _refusal(differing: list, values: dict, at: str, step: int) -> ReplicaError:
    where, kind, ranks = differing[0]
    rest = [w for w, _, _ in differing[1:]]
    others = f" (and {', '.join(rest[:3])}{', ...' if len(rest) > 3 else ''})" if rest else ""
    on = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    value = values.get(where)
    shown = f" ({type(value).__name__})" if value is not None else ""
    return ReplicaError(
        f"the ranks train different models: {where} holds {_WHAT[kind]}{shown} whose copy on {on} differs from "
        f"rank 0's{at} ({_DIFFERS[kind]}){others}; wrap the model in torch.nn.parallel.DistributedDataParallel so "
        f"that the ranks average their gradients and keep one model, or {_declare(differing)}", where,
        tuple(ranks), step)


def _declare(differing: list) -> str:
    registers = list(dict.fromkeys(r for r in (_register(w) for w, _, _ in differing) if r is not None))
    if all(_register(w) is not None for w, _, _ in differing):  # every one held by a register: named
        names = ", ".join(map(repr, registers)) + ("," if len(registers) == 1 else "")
        return (f"declare {'it' if len(registers) == 1 else 'them'} per-rank if each rank is meant to keep its "
                f"own (PER_RANK = ({names}) in the program file)")
    return "hold it in a register declared per-rank (PER_RANK in the program file) if each rank is meant to keep its own"


# ------------------------------------------------------------------ the first optimizer step
class OptimizerSteps:
    """Whether any torch optimizer of this process has taken a step since ``start()``: a global post-step hook
    of torch.optim (a function call per step until ``stop()``, which the caller makes once it has seen the
    first; nothing without torch)."""

    def __init__(self):
        self.stepped = False
        self._handle = None

    def start(self) -> "OptimizerSteps":
        if "torch" not in sys.modules:  # no torch optimizer in this run
            return self
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:  # an older torch: the checks before saves and at the end remain
            return self
        self._handle = register_optimizer_step_post_hook(self._hook)
        return self

    def _hook(self, optimizer, args, kwargs) -> None:
        self.stepped = True  # removed by stop(), not here: torch is iterating over its hooks

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
