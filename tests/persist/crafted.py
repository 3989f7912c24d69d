"""A small program (a module the flowvm command can run and resume) and the crafting of its files as anyone
who sends one can craft them: a state file's metadata changed with a valid checksum, a pickle checkpoint's
header changed with valid checksums, a state file declaring a tensor larger than its data on disk."""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import numpy as np

from flowvm import CALL, REPEAT, SEQ, Registers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from state_programs import rewrite  # noqa: E402

SHOW = ["total"]


class Walker:
    """An object a CALL reaches: its own generator, an array, a count."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.position = np.zeros(3)
        self.count = 0

    def step(self, scale: float) -> float:
        self.position += self.rng.normal(size=3) * scale
        self.count += 1
        return float(self.position.sum())


def note(trace: list, value: float) -> list:
    return trace + [round(value, 6)]


def build(n: int = 6, scale: float = 1.0):
    walker = Walker(0)
    reg = Registers(total=0.0, trace=[], x=np.zeros(4))
    return REPEAT(n, SEQ([CALL(walker.step, scale, store_to=reg("total")),
                          CALL(note, reg("trace"), reg("total"), store_to=reg("trace"))]))


def grow(x: np.ndarray) -> np.ndarray:
    return x + 1


def build_array(n: int = 4):
    """A program whose only array is the register x."""
    reg = Registers(x=np.zeros(4))
    return REPEAT(n, CALL(grow, reg("x"), store_to=reg("x")))


def saved_state(path: Path, steps: int = 3, meta: dict | None = None, builder=build) -> Path:
    """A state file of builder() stopped after steps steps, with the meta the flowvm command writes."""
    import flowvm

    drv = builder().start()
    drv.run(max_steps=steps)
    flowvm.save_state(drv, path, meta=meta or {"target": __file__, "sets": [], "show": SHOW})
    return path


def saved_checkpoint(path: Path, steps: int = 3, meta: dict | None = None) -> Path:
    import flowvm

    drv = build().start()
    drv.run(max_steps=steps)
    flowvm.save(drv, path, meta=meta or {"target": __file__, "sets": [], "show": SHOW})
    return path


def edit_state(source: Path, target: Path, part: str, edit) -> Path:
    """source with its metadata part (``run``, ``header``, ...) changed by edit(parsed part) (which may return
    a new value), and a valid checksum."""
    def change(meta):
        key = f"flowvm.{part}"
        value = json.loads(meta[key]) if part != "format" else meta[key]
        new = edit(value)
        value = value if new is None else new
        meta[key] = json.dumps(value) if part != "format" else value

    return rewrite(source, target, change)


def reheader(data: bytes, edit) -> bytes:
    """An unsigned pickle checkpoint's bytes with its header changed by edit(header) and both checksums valid."""
    from flowvm.persist.fileformat import DIGEST, MAGIC

    start = len(MAGIC) + 4
    (hlen,) = struct.unpack(">I", data[len(MAGIC):start])
    header = json.loads(data[start:start + hlen])
    new = edit(header)
    header = header if new is None else new
    text = json.dumps(header).encode()
    head = MAGIC + struct.pack(">I", len(text)) + text
    head += hashlib.sha256(head).digest()
    body = head + data[start + hlen + DIGEST: len(data) - DIGEST]
    return body + hashlib.sha256(body).digest()


def sparse_state(source: Path, target: Path, register: str, nbytes: int) -> Path:
    """source (a state file whose only tensor is the numpy array in register) declaring that array as nbytes
    of zeros, written as a sparse file: nothing of it on disk, all of it in the file's size."""
    from safetensors import safe_open

    from flowvm.persist import statefile

    with safe_open(str(source), framework="np") as f:
        meta = dict(f.metadata())
        assert list(f.keys()) == [f"registers/{register}"]
    name = f"registers/{register}"
    table = {name: {"kind": "numpy", "dtype": "<f8", "shape": [nbytes // 8]}}
    meta["flowvm.tensors"] = json.dumps(table)
    for key in (statefile.MAC, statefile.SHA, statefile.XXH):
        meta.pop(key, None)
    zero = statefile.piece_hash(statefile.XXH)(bytes(statefile.PIECE))
    pieces = nbytes // statefile.PIECE
    assert nbytes % statefile.PIECE == 0
    parts = [b"flowvm-state\0"]  # the hash list of flowvm.persist.statefile.digests, over pieces of zeros
    for key in sorted(meta):
        parts += [statefile._framed(key), statefile._framed(meta[key])]
    parts += [statefile._framed(name), struct.pack(">Q", nbytes), *[zero] * pieces]
    meta[statefile.XXH] = statefile.piece_hash(statefile.XXH)(b"".join(parts)).hex()
    header = json.dumps({"__metadata__": meta, name: {"dtype": "F64", "shape": [nbytes // 8],
                                                      "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(target, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + nbytes)
    return target
