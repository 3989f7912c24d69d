"""State checkpoints: a half-run driver's state in one safetensors file that holds no code.

``save_state(driver, path)`` writes the run's state: every tensor and numpy array as a safetensors tensor,
everything else as JSON in the file's metadata (all values are strings holding JSON)::

    flowvm.format       "1"
    flowvm.header       format, flowvm and Python versions, date, steps, done, position, signed, the user's
                        meta (target and options for the command line), the program's fingerprint, settings
    flowvm.program      the program's structure (kind and child count by path, the register names it uses),
                        which load_state compares, and its listing (for ``flowvm show``)
    flowvm.tensors      the tensor table: name -> kind ("numpy"/"torch"), dtype, shape (see statevalues)
    flowvm.objects      [location, state] for every object the program's elements reach (see stateobjects)
    flowvm.registers    [name, value] for every register, in order
    flowvm.run          step count, done, result, the frames (each: element path, kind, counters by slot name), the
                        value in transit, the listing's position marks
    flowvm.environment  the global random states and the settings the run resumes with
    flowvm.xxh3         the checksum of an unsigned file; a signed one (key=) has flowvm.sha256 and
                        flowvm.hmac, the signature, instead

``load_state(path, program)`` checks the file (readable by safetensors, flowvm's metadata, the format, the
checksum, then with a key the signature), compares ``program`` (built again from code) with the saved
structure, and only then restores: the objects' states into the program's own objects, the registers, the
frames (elements found by path in ``program``), the random states and settings (set at the first step, as for
every copy of a run).  It never unpickles, imports or calls anything named in the file.

The checksum is a hash of the metadata (but the checksum and signature) and of the hashes of every 4 MiB
piece of every tensor's bytes, in name order (a hash list): XXH3-128 for an unsigned file, which detects
corruption at memory speed; SHA-256 and an HMAC-SHA256 of the same bytes for a signed one (see statefile).  Loading copies each tensor out of the mapped file into memory of its
own and checks the copy: what is restored is what was checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from typing import Any, Iterable

from .location import Location
from ..base.environment import check_random, check_settings
from ..base.errors import CheckpointError, CopyError
from ..base.sentinels import NOVALUE
from ..base.version import __version__
from ..machine.driver import RunState
from ..machine.frames import child_index, marks
from ..machine.layouts import layout_of
from ..program.analysis import all_registers
from ..program.elements import Element
from ..program.paths import format_path, get, parse_path, walk
from ..program.printer import lines
from .checkpoint import _key_bytes
from .refusals import GRAPH_REASON
from .statefile import FORMAT, MAC, checksum_name, digests, read_state, views_of, write
from .stateframes import LARGEST, check_frame
from .stateobjects import encode_object, has_state_dict, roots
from .staterestore import check_program_objects, restore_object
from .statedecoder import Decoder
from .stateshow import SavedArray, SavedObject, malformed, pairs as _pairs, show_state  # noqa: F401  (flowvm.persist.state.SavedObject, show_state)
from .statevalues import MISSING, Encoder, Refused

__all__ = ["save_state", "load_state", "read_state_header", "show_state", "read_state", "collect", "compare",
           "structure", "SavedObject", "SUFFIX", "FORMAT"]

SUFFIX = ".safetensors"
FAILED = "failed"  # the marker slot a move that failed once leaves past a frame's layout


def structure(program: Element) -> dict:
    """What must match between a saved run and the program it is loaded into: the kind and the number of
    children of every element, by path, and the names of the registers the program uses (not constants)."""
    return {"elements": [[format_path(p), el.kind, len(el.children)] for p, el in walk(program)],
            "registers": sorted({r.name for r in all_registers(program)})}


def _fingerprint(shape: dict) -> str:
    return hashlib.sha256(json.dumps(shape, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


# ====================================================================== saving
def save_state(driver, path: str | os.PathLike, key: bytes | str | None = None, meta: dict | None = None):
    """Write driver's state (with the global random states and settings of this moment) to path, atomically,
    as a safetensors file holding no code; sign it with key if given.  ``meta``: a JSON-serializable dict kept
    in the header.  Refuses (CheckpointError) a run holding something a state file cannot hold, naming the
    register or the CALL and the object's type.  Returns where the file went (a Path, or the URL)."""
    key, loc = _key_bytes(key), Location.of(path)
    metadata, enc = collect(driver, loc.given, key is not None, meta)
    checksum, mac = digests(metadata, enc.table, views_of(enc.table, enc.data), key)
    metadata[checksum_name(key is not None)] = checksum.hex()
    if mac is not None:
        metadata[MAC] = mac.hex()
    write(loc, enc.table, enc.data, metadata)
    return loc.saved


def collect(driver, path: Any = "<state>", signed: bool = False, meta: dict | None = None) -> tuple[dict, Encoder]:
    """The metadata (name -> JSON text) and the tensors (in the Encoder) of driver's state, unsigned."""
    user_meta = _check_saveable(driver, path, meta)
    enc = Encoder(encode_object)
    program = driver.program
    try:
        parts, state = _encode_run(enc, driver)
    except Refused as err:
        raise CheckpointError(path, f"cannot save the run's state: {err}") from None
    if enc.graphs and not driver.done:  # a finished run takes no more steps: the values are all it needs
        raise CopyError(path, GRAPH_REASON, enc.graphs[0])
    doc = enc.finish(parts)
    parts["run"]["marks"] = [[format_path(p), g, c] for p, (g, c) in marks(state.frames).items()] \
        if not driver.done else []
    shape = structure(program)
    header = {"format": FORMAT, "flowvm": __version__, "python": platform.python_version(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": driver.steps, "done": driver.done,
              "program": program.kind, "position": driver.position, "signed": signed, "meta": user_meta,
              "fingerprint": _fingerprint(shape), "settings": state.environment["settings"]}
    listing = [[None if p is None else format_path(p), depth, text] for p, depth, text in lines(program)]
    metadata = {"flowvm.format": str(FORMAT), "flowvm.header": _dumps(header),
                "flowvm.program": _dumps({**shape, "listing": listing}), "flowvm.tensors": _dumps(enc.table)}
    for part in ("objects", "registers", "run", "environment"):
        metadata[f"flowvm.{part}"] = _dumps(doc[part])
    return metadata, enc


def _check_saveable(driver, path: Any, meta: dict | None) -> dict:
    """The user's meta (as JSON gives it back), once driver is a driver whose state a file can hold."""
    from ..machine.driver import Driver

    if not isinstance(driver, Driver):
        raise TypeError(f"save_state expects a flowvm Driver (prog.start()), got {type(driver).__name__}")
    if driver.__dict__.get("dependency_overrides"):
        raise CheckpointError(path, "cannot save the run's state: the driver has dependency_overrides (functions, "
                                    "which a state file does not hold); set them again after load_state, or give "
                                    "them to the program (with_overrides), which build() makes again")
    try:
        return json.loads(_dumps(meta or {}))
    except (TypeError, ValueError) as err:
        raise TypeError(f"save_state: meta must be a JSON-serializable dict ({err})") from None


def _encode_run(enc: Encoder, driver) -> tuple[dict, RunState]:
    """The objects, registers, run and environment parts of driver's state (encoded), and its snapshot."""
    objects = [[loc, enc.value(obj, f"objects/{loc}")] for loc, obj in roots(driver.program)]
    enc.objects_allowed = False
    registers = [[name, _register(enc, name, v)] for name, v in driver.registers.items()]
    state = driver.snapshot()
    run = {"steps": state.steps, "done": state.done, "ready": state.ready, "rotate": state.rotate,
           "fresh": state.fresh, "result": enc.value(state.result, "run/result"),
           "stack": _frames(enc, state.frames, ())}
    if state.carry is not NOVALUE:
        run["carry"] = enc.value(state.carry, "run/carry")
    if state.history is not None:
        run["history"] = enc.value(state.history, "run/history")
    env = state.environment
    environment = {"random": enc.value(env["random"], "environment/random"), "settings": env["settings"]}
    return {"objects": objects, "registers": registers, "run": run, "environment": environment}, state


def _register(enc: Encoder, name: str, value: Any) -> Any:
    """A register's node: plain data, or an object with state_dict() (a model, an optimizer), whose state is
    loaded into the object the rebuilt program's register holds (``Registers(model=net)`` in build())."""
    if not has_state_dict(value):
        return enc.value(value, f"registers/{name}")
    allowed, enc.objects_allowed = enc.objects_allowed, True
    try:
        return enc.value(value, f"registers/{name}")
    finally:
        enc.objects_allowed = allowed


def _frames(enc: Encoder, chain: list, base: tuple) -> list:
    """Each frame of chain as {"path", "kind", "slots"}, its slots by the names its kind's layout gives them
    (a kind without named slots, which a state file cannot load, keeps them as a list)."""
    out, path = [], base
    for k, fr in enumerate(chain):
        if k:
            path = path + (child_index(chain[k - 1]),)
        el, where = fr[0], f"frames/{format_path(path) or '<root>'}"
        layout = layout_of(el)
        names = layout.slots if layout is not None else () if el.is_leaf else None
        segments = None if layout is None else layout.segments
        slots: Any = {} if names is not None else []
        for j, x in enumerate(fr[1:]):
            name = str(j + 1) if names is None else names[j] if j < len(names) else FAILED
            if j + 1 == segments:
                x = [None if seg is None else _frames(enc, seg, path + (i,)) for i, seg in enumerate(x)]
            else:
                x = enc.value(x, f"{where}/{name}")
            if names is None:
                slots.append(x)
            else:
                slots[name] = x
        out.append({"path": format_path(path), "kind": el.kind, "slots": slots})
    return out


# ====================================================================== loading
def read_state_header(path: Any, key: bytes | str | None = None) -> dict:
    """The header of a state file, after checking that the file is complete and uncorrupted (with key: and
    signed with it, so that its ``meta`` can be trusted); nothing in the file is acted upon."""
    return read_state(path, _key_bytes(key), verify=False, keep=False).header


def load_state(path: Any, program: Element, key: bytes | str | None = None, restore_random: bool = True,
               restore_settings: bool = True, verify: bool = True, classes: Iterable[type] = ()):
    """A driver of program (built again from code) positioned where the run saved in path stopped.

    The file is checked first (checksum; with key, the signature; a signed file is refused without its key
    unless ``verify=False``), then program's structure is compared with the saved one (kinds and child
    counts by path, register names: a difference is a CheckpointError naming the first one; constants may
    differ).  The saved states then go into the program's own objects (``load_state_dict``, generator states,
    attributes), its registers and the driver's frames.  Like every copy of a run, the driver sets the saved
    global random states and settings when it takes its first step (``restore_random=False``,
    ``restore_settings=False`` keep this process's).  Nothing named in the file is imported or called.

    An object the run made and left in a register or a frame (a fitted model a CALL returned) is rebuilt from
    its attributes only if its class is in ``classes`` (``cls.__new__(cls)``, then the attributes set): the
    file can choose among the classes you name, and no other.
    """
    if not isinstance(program, Element):
        raise TypeError(f"load_state expects the program (a flowvm element built again from code), got "
                        f"{type(program).__name__}")
    allowed: dict = {}
    for cls in classes:
        if not isinstance(cls, type):
            raise TypeError(f"load_state: classes must be classes, got {type(cls).__name__} {cls!r:.60}")
        allowed.setdefault(cls.__qualname__, cls)
    loc = Location.of(path)
    loaded = read_state(loc, _key_bytes(key), verify=verify, keep=True)
    with malformed(loc.given, "the saved run"):
        drv = _restore(loaded, program, loc.given, allowed)
    return drv.resume_with(random=restore_random, settings=restore_settings)


def _restore_registers(dec: Decoder, registers, saved: Any, path: Any) -> None:
    """The saved registers put into the rebuilt program's: a model or optimizer build() put in a register
    takes its saved state (the object stays the program's)."""
    built = dict(registers)
    restored = [(name, dec.restore(built[name] if has_state_dict(built.get(name)) else MISSING, node,
                                   f"registers/{name}")) for name, node in _pairs(saved, path)]
    registers.clear()
    registers.update(restored)


def _restore(loaded, program: Element, path: Any, allowed: dict):
    """A driver of program holding the run of a checked state file (its settings and random states to be
    set at its first step)."""
    compare(loaded.parts["program"], structure(program), path)
    drv = program.start()
    dec = Decoder(loaded.table, loaded.tensors, path, restore_object, allowed)
    parts = loaded.parts
    objects = parts["objects"]
    if type(objects) is not list:
        raise CheckpointError(path, "malformed: the objects table cannot be read")
    check_program_objects(dec, objects, drv.program, path)
    _restore_registers(dec, drv.registers, parts["registers"], path)
    run = parts["run"]
    try:
        steps, done, ready, rotate, fresh = run["steps"], run["done"], run["ready"], run["rotate"], run["fresh"]
        if type(steps) is not int or not 0 <= steps <= LARGEST:
            raise ValueError(f"the step count is {steps!r:.40}, expected an int in [0, {LARGEST}]")
        if not all(type(b) is bool for b in (done, ready, rotate)):
            raise ValueError("done, ready and rotate must be bools")
        stack = _unframes(dec, run["stack"], drv.program, (), path, steps)
        if not (fresh is None or type(fresh) is int and 0 <= fresh <= len(stack)):
            raise ValueError(f"fresh is {fresh!r:.40}, expected None or an int in [0, {len(stack)}]")
    except (KeyError, TypeError, ValueError, LookupError) as err:
        raise CheckpointError(path, f"malformed: the run's frames cannot be read ({str(err)[:300]})") from None
    result = dec.value(run.get("result"), "run/result")
    carry = dec.value(run["carry"], "run/carry") if "carry" in run else NOVALUE
    saved_history = dec.value(run["history"], "run/history") if "history" in run else None
    env = parts["environment"]
    try:
        random_state = check_random(dec.value(env["random"], "environment/random"), path)
        settings = check_settings(env["settings"], path)
    except (KeyError, TypeError):
        raise CheckpointError(path, "malformed: the environment cannot be read") from None
    state = RunState(steps=steps, done=done, result=result, frames=stack, carry=carry, ready=ready, rotate=rotate,
                     fresh=fresh, history=saved_history,
                     environment={"random": random_state, "settings": settings, "announce": True})
    try:
        return drv.restore(state)
    except ValueError:
        raise CheckpointError(path, "malformed: the run's history cannot be read") from None


def _unframes(dec: Decoder, nodes: list, program: Element, base: tuple, path: Any, steps: int) -> list:
    if type(nodes) is not list:
        raise ValueError("a chain of frames is not a list")
    chain: list = []
    expected = base
    for k, node in enumerate(nodes):
        where = parse_path(node["path"])
        if k:
            expected = expected + (child_index(chain[-1]),)
        if where != expected:
            raise ValueError(f"frame at {node['path']!r} follows the frame at {format_path(expected[:-1])!r}")
        el = get(program, where)
        if el.kind != node["kind"]:
            raise ValueError(f"frame at {node['path']!r} is a {node['kind']!r:.20}, the element a {el.kind}")
        fr = [el]
        layout = layout_of(el)
        segments = None if layout is None else layout.segments
        for j, slot in enumerate(_slot_list(node["slots"], el, node["path"]), 1):
            if j == segments:
                if type(slot) is not list:
                    raise ValueError(f"frame at {node['path']!r}: its segments are not a list")
                fr.append([None if seg is None else _unframes(dec, seg, program, where + (i,), path, steps)
                           for i, seg in enumerate(slot)])
            else:
                fr.append(dec.value(slot, f"frames/{node['path'] or '<root>'}/{j}"))
        try:
            check_frame(fr, steps)
        except ValueError as err:
            raise ValueError(f"frame at {node['path'] or '<root>'!r} of a {el.kind}: {err}") from None
        chain.append(fr)
    return chain


def _slot_list(slots: Any, el: Element, where: str) -> list:
    """The slots of a saved frame in its layout's order: by name (format 3 on) or as a list (formats 1, 2)."""
    if type(slots) is list:
        return slots
    if type(slots) is not dict:
        raise ValueError(f"frame at {where!r}: its slots are {type(slots).__name__}, expected an object")
    if not slots:
        return []
    layout = layout_of(el)
    names = () if layout is None else layout.slots
    unknown = sorted(set(slots) - set(names) - {FAILED})
    if unknown:
        raise ValueError(f"frame at {where!r} of a {el.kind}: unknown slot {unknown[0]!r:.40} (a {el.kind} has "
                         f"{', '.join(names) or 'none'})")
    missing = [name for name in names if name not in slots]
    if missing:
        raise ValueError(f"frame at {where!r} of a {el.kind}: slot {missing[0]!r} is missing")
    return [slots[name] for name in names] + ([slots[FAILED]] if FAILED in slots else [])


def compare(saved: Any, here: dict, path: Any) -> None:
    """Raise a CheckpointError naming the first difference between the saved structure and this program's."""
    try:
        elements, names = saved["elements"], saved["registers"]
    except (TypeError, KeyError):
        raise CheckpointError(path, "malformed: the program's structure cannot be read") from None
    if elements == here["elements"] and names == here["registers"]:
        return
    for a, b in zip(elements, here["elements"]):
        if a != b:
            if type(a) is not list or len(a) != 3:
                raise CheckpointError(path, "malformed: the program's structure cannot be read")
            where = a[0] or "<root>"
            raise CheckpointError(path, f"the program differs from the saved run's at path {where!r}: the saved "
                                        f"run has a {a[1]} with {_children(a[2])} there, this program a {b[1]} "
                                        f"with {_children(b[2])}" if a[0] == b[0] else
                                  f"the program differs from the saved run's: the saved run has an element at "
                                  f"path {a[0]!r}, this program at {b[0]!r}")
    if len(elements) != len(here["elements"]):
        raise CheckpointError(path, f"the program differs from the saved run's: {len(elements)} elements saved, "
                                    f"{len(here['elements'])} here")
    lost, new = sorted(set(names) - set(here["registers"])), sorted(set(here["registers"]) - set(names))
    raise CheckpointError(path, "the program uses other registers than the saved run's"
                          + (f"; the saved run's uses {', '.join(map(repr, lost))}, which it does not" if lost else "")
                          + (f"; it uses {', '.join(map(repr, new))}, which the saved run's does not" if new else ""))


def _children(n: Any) -> str:
    return f"{n} child" if n == 1 else f"{n} children"
