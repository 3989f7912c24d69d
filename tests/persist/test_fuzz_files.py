"""Fuzzing the files a stranger may send: real state files and pickle checkpoints, mutated field by field (with
valid checksums, as anyone who writes a file can make them) and through their byte layout, each read by
load_state / load, show, plot and resume in a forked child under a memory limit and an audit hook.  Every
outcome must be a success or a refusal (CheckpointError, DataError, or the command's one line and exit 2):
never another exception, a crash, a timeout, an import of a module outside the known libraries, an unpickled
name in a state file, a process started, or more torch threads than cores.

In CI it runs FLOWVM_FUZZ_N variants (default 200, under a minute); a long run is one command::

    FLOWVM_FUZZ_N=20000 FLOWVM_FUZZ_SEED=7 python -m pytest -q -s tests/persist/test_fuzz_files.py
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

import flowvm
from flowvm.base.environment import cores
from flowvm.command import cli
from flowvm.persist import checkpoint, state

import crafted
from bounded import bounded

N = int(os.environ.get("FLOWVM_FUZZ_N", "200"))
SEED = int(os.environ.get("FLOWVM_FUZZ_SEED", "0"))
KNOWN = {"flowvm", "numpy", "torch", "safetensors", "xxhash", "matplotlib", "PIL", "kiwisolver", "pyparsing",
         "cycler", "dateutil", "fontTools", "packaging", "six", "tqdm", "fsspec", "cloudpickle", "crafted",
         "state_programs", "contourpy", "mpl_toolkits", "typing_extensions", "sympy", "mpmath", "filelock",
         "jinja2", "markupsafe", "networkx", "_distutils_hack"} | set(sys.stdlib_module_names)
EVIL = [-5, -1, 0, 10 ** 30, 2 ** 63, 1e308, float("inf"), "\u00b2", "x", "\x1b]0;t\x07", "", None, True, [], {},
        [[[[[]]]]], {"ref": 9999}, {"int": "9" * 4000}, {"torch_device": "meta"}, {"torch_device": "evil"},
        {"global_generator": "numpy"}, {"tensor": "nope"}, {"list": [1], "id": "x"}, {"dict": [[1]]},
        {"bytes": "!!"}, {"numpy_scalar": "|O", "hex": ""}, {"ndarray": "registers/x"}, "cuda:7", 10 ** 9]


def _paths(value, here=()):
    """Every path into a JSON value (dict keys and list indexes)."""
    yield here
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, here + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, here + (i,))


def _mutate_json(value, rng: random.Random):
    paths = [p for p in _paths(value) if p]
    if not paths:
        return rng.choice(EVIL)
    where = rng.choice(paths)
    parent = value
    for k in where[:-1]:
        parent = parent[k]
    kind = rng.random()
    if kind < 0.15 and isinstance(parent, list):
        del parent[where[-1]]
    elif kind < 0.25 and isinstance(parent, dict):
        del parent[where[-1]]
    else:
        parent[where[-1]] = rng.choice(EVIL)
    return value


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    kind = rng.random()
    if kind < 0.2:
        return bytes(data[: rng.randrange(len(data))])
    if kind < 0.3:
        return bytes(data) + bytes(rng.randrange(1, 64))
    for _ in range(rng.randrange(1, 4)):
        at = rng.randrange(min(len(data), 4096)) if rng.random() < 0.7 else rng.randrange(len(data))
        data[at] = rng.randrange(256)
    return bytes(data)


def _state_variant(good: Path, target: Path, rng: random.Random) -> str:
    if rng.random() < 0.75:
        part = rng.choice(["header", "program", "tensors", "objects", "registers", "run", "environment", "format"])
        crafted.edit_state(good, target, part, lambda v: _mutate_json(v, rng) if part != "format" else rng.choice(
            ["\u00b2", "0", "3", "1", "x", "99999999999"]))
        return f"field:{part}"
    target.write_bytes(_mutate_bytes(good.read_bytes(), rng))
    return "bytes"


def _pickle_variant(good: Path, target: Path, rng: random.Random) -> str:
    if rng.random() < 0.6:
        target.write_bytes(crafted.reheader(good.read_bytes(), lambda h: _mutate_json(h, rng)))
        return "field:header"
    target.write_bytes(_mutate_bytes(good.read_bytes(), rng))
    return "bytes"


def _command(*argv) -> str:
    """The flowvm command in this process: its exit status, or the exception it let out."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            status = cli.main([str(a) for a in argv])
        except SystemExit as stop:
            code = stop.code
            status = 2 if isinstance(code, str) and code.startswith("flowvm: ") else code
        except Exception as step:  # the program's own step raised on the file's values: saved, as any run's
            if any(n.startswith("flowvm: the run is saved at step") for n in getattr(step, "__notes__", ())):
                return "a step raised"
            raise
    if status == 1 and "\nflowvm: the run is saved at step" in err.getvalue():  # the program's own step raised on
        return "a step raised"                                                      # the file's values: saved
    if status not in (0, 2) or "Traceback" in err.getvalue():
        raise AssertionError(f"exit {status}: {err.getvalue()[-300:]}")
    return f"exit {status}"


def _refusal(fn) -> str:
    try:
        fn()
        return "ok"
    except (flowvm.CheckpointError, flowvm.DataError) as err:
        return type(err).__name__


def _run_a_little(drv) -> None:
    """Two steps of a loaded run: the program's own functions may raise on the file's values (a register
    holding None), as on any values; the driver stays as a failed step leaves it."""
    try:
        drv.run(max_steps=2)
    except Exception as err:
        if not isinstance(err, flowvm.FlowError) and not getattr(err, "__notes__", None):
            raise


def _operations(path: Path, work: Path, pickle_file: bool) -> dict:
    """The outcome of each reading of path."""
    out = {}
    if pickle_file:
        out["read_header"] = _refusal(lambda: checkpoint.read_header(path))
        out["references"] = _refusal(lambda: checkpoint.references(path))
        out["load"] = _refusal(lambda: flowvm.load(path, restore_random=False, restore_settings=False))
    else:
        out["load_state"] = _refusal(lambda: _run_a_little(flowvm.load_state(path, crafted.build())))
        out["show_state"] = _refusal(lambda: state.show_state(path))
    out["show"] = _command("show", path)
    out["plot"] = _command("plot", path, "-o", work / "curves.png")
    suffix = ".ckpt" if pickle_file else ".safetensors"
    out["resume"] = _command("resume", path, "--max-steps", 2, "--progress", "none", "--checkpoint",
                             work / f"resumed{suffix}")
    import torch

    if torch.get_num_threads() > cores():
        raise AssertionError(f"{torch.get_num_threads()} torch threads on {cores()} cores")
    return out


def _bad_events(events: list, pickle_file: bool, allowed: set) -> list:
    bad = []
    for event, what in events:
        if event == "import" and what.partition(".")[0] not in KNOWN:
            bad.append((event, what))
        elif event == "pickle.find_class":
            if not pickle_file or what not in allowed:
                bad.append((event, what))
        elif event not in ("import", "exec", "compile"):
            bad.append((event, what))
    return bad


@pytest.mark.parametrize("kind", ["state", "pickle"])
def test_fuzzed_files_are_read_or_refused_never_anything_else(tmp_path, kind):
    pickle_file = kind == "pickle"
    meta = {"target": crafted.__file__, "sets": [], "show": crafted.SHOW,
            "history": {"every": 1, "auto": True, "names": ["total"], "points": {"total": [[1, 0.5], [2, 0.25]]}}}
    good = (crafted.saved_checkpoint if pickle_file else crafted.saved_state)(
        tmp_path / ("good.ckpt" if pickle_file else "good.safetensors"), meta=meta)
    work = tmp_path / "work"
    work.mkdir()
    warm = _operations(good, work, pickle_file)  # what the untouched file loads, before the audit starts
    assert warm["show"] == warm["resume"] == "exit 0", warm
    allowed = {repr((m, n)) for m, n in checkpoint.references(good)} if pickle_file else set()
    rng = random.Random(f"{SEED}-{kind}")
    outcomes: Counter = Counter()
    failures = []
    for k in range(N // 2):
        variant = work / f"v{k}{good.suffix}"
        how = (_pickle_variant if pickle_file else _state_variant)(good, variant, rng)
        result, events = bounded(lambda: _operations(variant, work, pickle_file), extra_mb=512, timeout=60,
                                 audit=True)
        bad = _bad_events(events, pickle_file, allowed)
        if result[0] != "ok" or bad:
            failures.append((k, how, result[:3], bad[:5]))
        else:
            outcomes.update(f"{op}: {what}" for op, what in result[1].items())
        variant.unlink()
        for leftover in work.iterdir():
            if leftover.name.startswith("resumed"):
                leftover.unlink()
    print(f"\n{kind}: {N // 2} variants (seed {SEED}): " + ", ".join(f"{k} x{n}" for k, n in sorted(outcomes.items())))
    assert not failures, "\n".join(map(str, failures[:10]))
