"""Coordinated checkpoints of a data-parallel run: every rank saves at the same step, the state they share
once, each rank's own state apart, complete only when every part is written.

A checkpoint location (a local folder or an fsspec URL prefix such as ``s3://bucket/run``) holds::

    manifest.json                 written last, atomically: the complete checkpoint it names
    step-00000120-1a2b3c4d/
        shared.ckpt               rank 0's run (flowvm.save: program, registers, frames; signed with a key)
        rank-00000.json ...       each rank's own state: its random generators and the position of each
                                  Batches it serves (plain data, JSON)

A save writes a new folder, then the manifest naming it, then removes every other step folder (the previous
manifest's, and any a kill left half-written): a kill at any moment leaves a manifest naming a complete
folder.  A rank's part is plain data, read
without unpickling anything; the manifest holds each part's SHA-256 (signed with the key, when one is given).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import pickle
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from ..base.data import Batches
from ..base.errors import CheckpointError
from ..persist import checkpoint, storage
from ..persist.pickler import Pickler, Unpickler, pickle_bytes
from ..base.environment import check_random, check_settings
from . import group

__all__ = ["MANIFEST", "FORMAT", "join", "is_checkpoint", "read_manifest", "save", "load", "find_batches",
           "rank_part", "apply_part"]

MANIFEST = "manifest.json"
FORMAT = "flowvm-distributed"
VERSION = 1


def join(location: Path | str, name: str) -> Path | str:
    """The file name inside a checkpoint location (a folder or a URL prefix)."""
    loc = storage.Location.of(location)
    if loc.url is not None:
        return loc.url.rstrip("/") + "/" + name
    return loc.path / name


def is_checkpoint(location: Path | str | None) -> bool:
    """Whether location holds a coordinated checkpoint (a manifest)."""
    if location is None:
        return False
    try:
        return storage.read_start(join(location, MANIFEST), 1, missing_ok=True) is not None
    except CheckpointError:
        return False


# ------------------------------------------------------------------ the manifest
def _signature(body: dict, key: str | bytes | None) -> str | None:
    if key is None:
        return None
    key = key.encode() if isinstance(key, str) else key
    text = json.dumps(body, sort_keys=True).encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def read_manifest(location: Path | str, key: str | bytes | None = None) -> dict:
    """The manifest of the last complete checkpoint at location, checked (its signature, with key)."""
    where = join(location, MANIFEST)
    try:
        manifest = json.loads(storage.read_bytes(where))
    except ValueError as err:
        raise CheckpointError(where, f"corrupted manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(where, "not the manifest of a flowvm distributed checkpoint")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(where, f"written by a newer flowvm (format version {manifest['version']})")
    signature = manifest.pop("signature", None)
    if signature is not None and key is None:
        raise CheckpointError(where, "is signed: give its key")
    if key is not None and not hmac.compare_digest(signature or "", _signature(manifest, key) or ""):
        raise CheckpointError(where, "refused: the signature does not match the key (or the file was changed)")
    _check_fields(manifest, where)
    return manifest


_FIELDS = {"folder": str, "steps": int, "done": bool, "world_size": int, "parts": list, "meta": dict}


def _check_fields(manifest: dict, where: Any) -> None:
    """Every field a reader uses, of its type (a junk manifest is a CheckpointError naming the field)."""
    for name, kind in _FIELDS.items():
        value = manifest.get(name)
        if type(value) is not kind:
            raise CheckpointError(where, f"corrupted manifest: {name!r} is {value!r:.40}, expected a {kind.__name__}")
    if manifest["world_size"] < 1 or len(manifest["parts"]) != manifest["world_size"] or \
            not all(isinstance(d, str) for d in manifest["parts"]) or "/" in manifest["folder"]:
        raise CheckpointError(where, "corrupted manifest: its folder, world size and parts do not agree")


def verify(location: Path | str, key: str | bytes | None = None) -> dict:
    """The manifest of the last complete checkpoint at location, after checking every file it names: each
    rank's part against its checksum, and the shared run's checksum (and signature, with key).  A damaged or
    missing file is a CheckpointError naming it, found before any rank starts."""
    manifest = read_manifest(location, key)
    for r in range(manifest["world_size"]):
        _read_part(location, manifest, r)
    checkpoint.read_header(join(location, f"{manifest['folder']}/shared.ckpt"), key=key)
    return manifest


# ------------------------------------------------------------------ rank-local state
class _Finder(Pickler):
    """Walks a driver as pickling it would, recording its Batches in the order met (the same order on every
    rank, whose programs are alike); arrays and tensors are not entered, and nothing is kept."""

    def __init__(self):
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=lambda buf: None)
        self.found: list[Batches] = []
        self._seen: set[int] = set()
        torch = sys.modules.get("torch")
        self._skip = (bytes, bytearray) + ((torch.Tensor,) if torch is not None else ())
        import numpy as np

        self._skip += (np.ndarray,)

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Batches):
            if id(obj) not in self._seen:
                self._seen.add(id(obj))
                self.found.append(obj)
            return "batches"
        if isinstance(obj, self._skip):
            return "array"
        return None


def find_batches(drv) -> list[Batches]:
    """The Batches a driver holds (in its registers, or bound in its elements), in a fixed order."""
    finder = _Finder()
    finder.dump(drv)
    return finder.found


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    raise TypeError(f"{type(value).__name__} in a rank's state")


def _unplain(obj: dict) -> Any:
    return base64.b64decode(obj["__bytes__"]) if set(obj) == {"__bytes__"} else obj


def _is_data(value: Any, depth: int = 0) -> bool:
    """Whether a register value is plain data (numbers, text, arrays, tensors, and tuples, lists and dicts of
    them): a value no other part of the run can hold a reference to that matters."""
    import numpy as np

    torch = sys.modules.get("torch")
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, np.ndarray, np.generic)):
        return True
    if torch is not None and isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return True
    if depth < 8 and isinstance(value, (tuple, list)):
        return all(_is_data(v, depth + 1) for v in value)
    if depth < 8 and isinstance(value, dict):
        return all(isinstance(k, str) and _is_data(v, depth + 1) for k, v in value.items())
    return False


def _local_registers(drv) -> bytes:
    """The registers holding plain data whose value differs from rank 0's (the batch a rank took, its
    loss), pickled; found by comparing each register's pickle digest through the group."""
    blobs = {name: pickle_bytes(value) for name, value in drv.registers.items() if _is_data(value)}
    digests = {name: hashlib.sha256(blob).hexdigest() for name, blob in blobs.items()}
    first = group.broadcast(digests)
    local = {name: drv.registers[name] for name in blobs if first.get(name) != digests[name]}
    return pickle_bytes(local) if local else b""


def rank_part(drv) -> dict:
    """This rank's own state: its random generators and settings (what a copy resumes with), the position
    of each Batches of the driver, and its registers of plain data that differ from rank 0's."""
    batches = [dict(b.state_dict(), batch_size=b.batch_size, size=b.size,
                    rank=b.rank, world_size=b.world_size, global_batch=b.global_batch) for b in find_batches(drv)]
    return {"rank": group.rank(), "world_size": max(group.world_size(), 1), "steps": drv.steps,
            "environment": drv.snapshot().environment, "batches": batches, "registers": _local_registers(drv)}


def apply_part(drv, part: dict) -> None:
    """Give a driver loaded from rank 0's file this rank's own state (same world size)."""
    found = find_batches(drv)
    if len(found) != len(part["batches"]):
        raise CheckpointError("<rank state>", f"the run holds {len(found)} Batches but rank {part['rank']}'s "
                                              f"state has {len(part['batches'])}")
    for b, state in zip(found, part["batches"]):
        b.rank, b.world_size = group.rank(), max(group.world_size(), 1)
        b.load_state_dict(state)
    if part.get("registers"):
        drv.registers.update(Unpickler(io.BytesIO(part["registers"])).load())
    drv.saved_environment = _environment(part["environment"])


def _environment(env: dict | None) -> dict | None:
    """A rank's saved random states and settings, checked."""
    if env is None:
        return None
    random = env.get("random")
    return {"random": None if random is None else check_random(random, "<rank state>"),
            "settings": check_settings(env.get("settings") or {}, "<rank state>"),
            "announce": env.get("announce", True)}


def reshard(drv, parts: list[dict]) -> None:
    """Give a driver loaded from rank 0's file the data positions of a world of another size.  Each Batches
    keeps its global batch (flowvm/base/data.py): the saved ranks were all at one position of one epoch,
    the global batches taken so far, and the new ranks share each later global batch out among them, so no
    sample is skipped or taken twice and every loop counted by ``len(batches)`` keeps its count.  The shards
    and the batches' sizes differ from an uninterrupted run's.  The random generators are rank 0's."""
    found = find_batches(drv)
    rank, world = group.rank(), max(group.world_size(), 1)
    for i, b in enumerate(found):
        states = [p["batches"][i] for p in parts]
        at = {(s["epoch"], s["position"]) for s in states}
        if len(at) != 1:
            raise CheckpointError("<rank state>", f"the saved ranks' Batches #{i} are at different positions "
                                                  f"{sorted(at)}: cannot share its epoch out anew")
        b.epoch, b.position = at.pop()
        b.seed, b.rank, b.world_size = states[0]["seed"], rank, world
        b.global_batch_size = states[0].get("global_batch") or states[0]["batch_size"] * states[0]["world_size"]
        try:
            b.check_shards(f"resuming on {world} ranks")
        except ValueError as err:
            raise CheckpointError("<rank state>", f"Batches #{i}: {err}") from None
    drv.saved_environment = _environment(parts[0]["environment"])


def _encode(part: dict) -> bytes:
    return json.dumps(part, default=_plain, sort_keys=True).encode()


def _decode(data: bytes, where: Any) -> dict:
    try:
        return json.loads(data, object_hook=_unplain)
    except ValueError as err:
        raise CheckpointError(where, f"corrupted rank state ({err})") from None


# ------------------------------------------------------------------ saving
def _folder(step: int) -> str:
    return f"step-{step:08d}-{group.broadcast(uuid.uuid4().hex[:8])}"


def _try(fn, *args) -> tuple[Any, str | None]:
    try:
        return fn(*args), None
    except (CheckpointError, OSError) as err:
        return None, str(err)


def _write_part(location, folder: str, part: bytes) -> str:
    where = join(location, f"{folder}/rank-{group.rank():05d}.json")
    if isinstance(where, Path):
        where.parent.mkdir(parents=True, exist_ok=True)
    with storage.open_write(where) as f:
        f.write(part)
    return hashlib.sha256(part).hexdigest()


def save(drv, location: Path | str, key: str | bytes | None = None, meta: dict | None = None) -> dict:
    """Save a coordinated checkpoint of every rank's driver at location (call it on every rank, at the same
    step).  Returns the manifest written; a failure on any rank is a CheckpointError on every rank, and the
    previous checkpoint stays the complete one."""
    folder = _folder(drv.steps)
    digest, error = _try(_write_part, location, folder, _encode(rank_part(drv)))
    if error is None and group.rank() == 0:
        _, error = _try(checkpoint.save, drv, join(location, f"{folder}/shared.ckpt"), key, meta)
    results = group.gather((digest, error))
    failed = [(r, e) for r, (_, e) in enumerate(results) if e is not None]
    if failed:
        r, e = failed[0]
        raise group.SaveFailed(location, f"rank {r} could not save its part ({e}); the previous checkpoint is "
                                         "kept")
    outcome = None
    if group.rank() == 0:
        outcome = _try(_commit, location, folder, drv, [d for d, _ in results], key, meta)
    manifest, error = group.broadcast(outcome)
    if error is not None:
        raise group.SaveFailed(location, f"the manifest could not be written ({error}); the previous "
                                         "checkpoint is kept")
    return manifest


def _commit(location, folder: str, drv, digests: list[str], key, meta) -> dict:
    body = {"format": FORMAT, "version": VERSION, "folder": folder, "steps": drv.steps, "done": drv.done,
            "world_size": len(digests), "parts": digests, "meta": meta or {}}
    signature = _signature(body, key)
    text = json.dumps(dict(body, signature=signature) if signature else body, indent=1).encode()
    with storage.open_write(join(location, MANIFEST)) as f:
        f.write(text)
    for name in _step_folders(location):  # the previous save's, and any a kill left half-written
        if name != folder:
            _remove(join(location, name))
    return body


def _step_folders(location) -> list[str]:
    """The names of the step folders at location (best effort: none when it cannot be listed)."""
    try:
        if isinstance(join(location, MANIFEST), Path):
            names = [p.name for p in Path(join(location, MANIFEST)).parent.iterdir() if p.is_dir()]
        else:
            from ..persist.remote import filesystem

            fs, path = _fs_path(str(location), filesystem)
            fs.invalidate_cache(path)
            names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
    except Exception:  # noqa: BLE001 - a folder left behind costs space, not correctness
        return []
    return [name for name in names if name.startswith("step-")]


def _remove(where: Path | str) -> None:
    """Remove an old checkpoint's folder (best effort: a leftover folder is never read)."""
    try:
        if isinstance(where, Path):
            shutil.rmtree(where, ignore_errors=True)
        else:
            from ..persist.remote import filesystem

            fs, path = _fs_path(where, filesystem)
            fs.rm(path, recursive=True)
    except Exception:  # noqa: BLE001 - a folder left behind costs space, not correctness
        pass


def _fs_path(url: str, filesystem) -> tuple[Any, str]:
    fs, path, _ = filesystem(url.rstrip("/") + "/x")
    return fs, path.rsplit("/", 1)[0]


# ------------------------------------------------------------------ loading
def _read_part(location, manifest: dict, r: int) -> dict:
    where = join(location, f"{manifest['folder']}/rank-{r:05d}.json")
    data = storage.read_bytes(where)
    if hashlib.sha256(data).hexdigest() != manifest["parts"][r]:
        raise CheckpointError(where, "its checksum differs from the manifest's (changed or damaged)")
    part = _decode(data, where)
    if not isinstance(part, dict):
        raise CheckpointError(where, "corrupted rank state (not an object)")
    return part


def load(location: Path | str, key: str | bytes | None = None, restore_settings: bool = True):
    """This rank's driver from the last complete checkpoint at location: rank 0's run with this rank's own
    state (same world size), or with each remaining global batch shared out among the new ranks (another)."""
    manifest = read_manifest(location, key)
    drv = checkpoint.load(join(location, f"{manifest['folder']}/shared.ckpt"), key=key,
                          restore_settings=restore_settings)
    size = max(group.world_size(), 1)
    if size == manifest["world_size"]:
        apply_part(drv, _read_part(location, manifest, group.rank()))
    else:
        reshard(drv, [_read_part(location, manifest, r) for r in range(manifest["world_size"])])
    if not restore_settings:
        drv.resume_with(settings=False)
    return drv
