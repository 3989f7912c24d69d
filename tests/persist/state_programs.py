"""Programs for the state checkpoint tests (test_state.py), importable by name in the fresh processes that
resume them (state_child.py): the core tests' generated programs with registers of every kind a state file
holds, and small programs with objects.
"""

from __future__ import annotations

import json
import math
import pickle
import random
import struct

import numpy as np
import torch

from flowvm import CALL, REPEAT, SEQ, WEAVE, Registers
from flowvm.program.verify import program_registers

from progen import random_program


def zoo(seed: int, cyclic: bool = False) -> dict:
    """A register value of every kind a state file holds, nested, with shared parts (and with cyclic: a list
    holding itself, which flowvm.testing.same cannot compare)."""
    rng = np.random.default_rng(seed)
    shared = [seed % 5]
    loop: list = ["c"]
    if cyclic:
        loop.append(loop)
    weights = torch.nn.Parameter(torch.from_numpy(rng.standard_normal(3)).float())
    weights.grad = torch.full((3,), 0.25)
    return {
        "none": None, "yes": True, "count": 0, "big": 2 ** 70 + seed, "neg": -(2 ** 64) - 3,
        "f": 0.1 * seed, "nan": float("nan"), "odd_nan": struct.unpack(">d", bytes.fromhex("fff8000000000abc"))[0],
        "inf": math.inf, "-inf": -math.inf, "-0": -0.0, "s": "héllo \x00 \ud800", "b": b"\x00\xff\x10",
        "ba": bytearray(b"mut"), "cx": complex(1.5, -2.0), "tuple": (1, (2.5, "x"), [3]),
        "keys": {1: "int", (1, "t"): "tuple", 2.5: "float", None: "none", b"k": "bytes", frozenset({7}): "fs"},
        "set": {1, 2, 3}, "log": shared, "alias": shared, "cyclic": loop,
        "a": rng.standard_normal(5), "aF": np.asfortranarray(rng.standard_normal((3, 4))),
        "a_be": np.arange(4, dtype=">i4"), "a_u16": np.arange(3, dtype=np.uint16), "a_c128": np.array([1 + 2j, -3j]),
        "a_str": np.array(["ab", "cde"]), "a_dates": np.array(["2020-01-01", "2024-02-29"], dtype="datetime64[D]"),
        "a0": np.array(2.5), "a_empty": np.zeros((0, 3)), "a_bool": np.array([True, False]),
        "s64": np.float64(1.25), "s_i8": np.int8(-3), "s_str": np.str_("np"),
        "t": torch.from_numpy(rng.standard_normal((2, 3))).float(), "t_bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "t_c128": torch.tensor([1 + 1j], dtype=torch.complex128), "t_i64": torch.tensor([2 ** 62, -5]),
        "t_bool": torch.tensor([True, False]), "t_u16": torch.tensor([1, 2], dtype=torch.int32).to(torch.uint16),
        "t0": torch.tensor(3.0), "t_T": torch.arange(6.0).reshape(2, 3).t(), "param": weights,
        "dtype": torch.float16, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
        "gen": np.random.default_rng(seed), "py_random": random.Random(seed),
    }


def zoo_step(z: dict, r: int) -> dict:
    """A deterministic update of every kind of value in z (in place where it is mutable)."""
    z["count"] += 1
    z["log"].append(r % 7)  # z["alias"] is the same list
    z["f"] = z["f"] * 1.5 + r
    z["big"] = z["big"] * 3 + r
    z["s"] = z["s"][-8:] + str(r % 10)
    z["b"] = z["b"][-6:] + bytes([r % 256])
    z["ba"].append(r % 256)
    z["set"].add(r % 11)
    z["keys"][(r % 3, "k")] = np.int64(r)
    z["a"] = z["a"] * 0.5 + r
    z["aF"] *= 1.25
    z["a_be"] = z["a_be"] + np.int32(r % 5)
    z["s64"] = z["s64"] * np.float64(1.5)
    z["t"] = torch.tanh(z["t"] * 1.1 + r)
    z["t_bf16"] = (z["t_bf16"] * 1.5).to(torch.bfloat16)
    z["t_c128"] = z["t_c128"] * (1 + 1j)
    with torch.no_grad():
        z["param"].mul_(0.5).add_(z["param"].grad)
    z["draw"] = (z["gen"].random(), z["py_random"].random())
    return z


def comparable(value):
    """value with random generators replaced by their states and the programs' result objects by their
    attributes (flowvm.testing.same compares such objects by identity)."""
    if isinstance(value, np.random.Generator):
        return ("numpy Generator", value.bit_generator.state)
    if isinstance(value, random.Random):
        return ("random.Random", value.getstate())
    if type(value) is dict:
        return {k: comparable(v) for k, v in value.items()}
    if type(value).__module__.startswith(("flowvm.programs", "state_programs")) and hasattr(value, "__dict__"):
        return (type(value).__qualname__, comparable(vars(value)))  # a result object: by its attributes
    if type(value) in (list, tuple):
        return type(value)(comparable(v) for v in value)
    return value


def rebuild_tensor(dtype: str, data: bytes, shape: list, requires_grad: bool, parameter: bool, grad):
    """A tensor from tensor_reduce's parts (pickle cannot write tensors of some dtypes, uint16 among them)."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape) \
        if data else torch.empty(shape, dtype=getattr(torch, dtype))
    t = torch.nn.Parameter(t, requires_grad=requires_grad) if parameter else t.requires_grad_(requires_grad)
    t.grad = grad
    return t


class Pickler(pickle.Pickler):
    """The child's pickler for what it sends back: every tensor by dtype name and bytes."""

    def reducer_override(self, obj):
        if type(obj) in (torch.Tensor, torch.nn.Parameter):
            t = obj.detach().contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return rebuild_tensor, (str(t.dtype).removeprefix("torch."), data, list(t.shape), obj.requires_grad,
                                    type(obj) is torch.nn.Parameter, obj.grad if obj.is_leaf else None)
        return NotImplemented


def build_random(seed: int, depth: int = 3):
    """One of the core tests' generated programs (tests/progen.py), woven with updates of a register of
    every kind."""
    program = random_program(seed, depth)
    reg = program_registers(program)
    reg["zoo"] = zoo(seed)
    updates = REPEAT(5, CALL(zoo_step, reg("zoo"), reg("r0"), store_to=reg("zoo")))
    return WEAVE(-1, [program, updates], weights=[1, 0.5])


# ------------------------------------------------------------------ crafting files
def rewrite(source, target, edit, key=None):
    """source with its metadata changed by edit(metadata) and a valid checksum (and signature with key), as
    whoever crafts a file can make it."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from flowvm.persist import statefile

    with safe_open(str(source), framework="np") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(meta)
    table = json.loads(meta["flowvm.tensors"])
    tensors = {k: v for k, v in tensors.items() if k in table}
    for name in (statefile.MAC, statefile.SHA, statefile.XXH):
        meta.pop(name, None)
    name = statefile.SHA if meta.get("flowvm.format") == "1" else statefile.checksum_name(key is not None)
    checksum, mac = statefile.digests(meta, table, statefile.views_of(table, tensors), key, checksum=name)
    meta[name] = checksum.hex()
    if mac is not None:
        meta["flowvm.hmac"] = mac.hex()
    save_file(tensors, str(target), metadata=meta)
    return target



# ------------------------------------------------------------------ objects shared between CALLs
def train(model, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


@torch.no_grad()
def evaluate(model, x):
    return model(x).sum().item()


def build_shared(steps: int = 6, lr: float = 0.05, separate: bool = False):
    """A model that two CALLs use (separate=True: the second CALL gets a model of its own)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)) if separate else model
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    reg = Registers(x=torch.randn(16, 4), y=torch.randn(16, 1), history=[])
    return REPEAT(steps, SEQ([
        CALL(train, model, opt, reg("x"), reg("y"), store_to=reg("loss")),
        CALL(evaluate, other, reg("x"), store_to=reg("score")),
    ]))


def add(total, step):
    return total + step


def build_constant(step: float = 0.5, n: int = 8):
    reg = Registers(total=0.0)
    return REPEAT(n, CALL(add, reg("total"), step, store_to=reg("total")))


class Fit:
    """A result a CALL makes and leaves in a register (as the bundled programs' fitted models)."""

    def __init__(self, total):
        self.coef_ = np.full(3, total)
        self.n_iter_ = 3
        self.info_ = {"kind": "fit", "history": [total]}


def build_result():
    reg = Registers(total=0.0)
    return SEQ([REPEAT(3, CALL(add, reg("total"), 1.5, store_to=reg("total"))), CALL(Fit, reg("total"), store_to=reg("fit"))])

