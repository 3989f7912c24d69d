"""Checkpoint files: save/load round trips, file format, atomic writes, damaged, foreign and signed files."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import os
import pickle
import platform
import random
import stat
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import flowvm
from flowvm import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, CheckpointError, Registers
from flowvm.persist import checkpoint as ckpt

import toy as h
import toy

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 20240611


# ------------------------------------------------------------------ programs
def build_all_kinds():
    """Every element kind, plus numpy and torch draws collected by BUFFERs."""
    reg = Registers(x=0, n=3, w=0, log=[])
    return SEQ([
        CALL(h.add, reg("x"), 1, store_to=reg("x")),
        REPEAT(reg("n"), SEQ([CALL(h.inc, reg("x"), store_to=reg("x")), CALL(h.record, reg("log"), reg("x"))]),
               counter=reg("i")),
        WHILE(CALL(h.below, reg("w"), 3, store_to=reg("w")), CALL(h.mix, reg("x"), reg("w"), store_to=reg("x"))),
        SWITCH(CALL(h.mod3, reg("x")), {0: CALL(h.inc, reg("x"), store_to=reg("x")),
                                        1: PRINT("one", reg("x")),
                                        2: CALL(h.record, reg("log"), 2)}),
        WEAVE(1, [REPEAT(4, CALL(h.inc, reg("x"), store_to=reg("x"))), LOOP(CALL(h.record, reg("log"), -1))],
              weights=[2, 1]),
        BUFFER(3, CALL(np.random.rand, 2), store_to=reg("buf")),
        BUFFER(2, CALL(torch.randn, 3), store_to=reg("tbuf")),
        CALL(random.random, store_to=reg("py")),
        CALL(h.total, reg("log")),
    ])


def build_direct_draws():
    """CALLs whose functions are the global generators' own methods."""
    reg = Registers(log=[])
    return SEQ([
        REPEAT(4, SEQ([
            CALL(random.random, store_to=reg("a")),
            CALL(np.random.rand, 3, store_to=reg("b")),
            CALL(torch.randn, 4, store_to=reg("c")),
            CALL(h.append, reg("log"), reg("a"), reg("b"), reg("c"), store_to=reg("log")),
        ])),
        CALL(len, reg("log")),
    ])


def build_helper_draws():
    """CALLs of importable functions that draw from the global generators in their bodies."""
    reg = Registers(log=[])
    return SEQ([
        REPEAT(5, SEQ([
            CALL(h.draw_globals, store_to=reg("d")),
            CALL(h.append, reg("log"), reg("d"), store_to=reg("log")),
        ])),
        CALL(len, reg("log")),
    ])


def build_mixed_draws():
    """The same global generators drawn from both directly (CALL(random.random)) and inside a function."""
    reg = Registers(log=[])
    return SEQ([
        REPEAT(4, SEQ([
            CALL(random.random, store_to=reg("a")),
            CALL(h.draw_global_random, store_to=reg("b")),
            CALL(np.random.rand, 2, store_to=reg("c")),
            CALL(h.draw_global_numpy, 2, store_to=reg("d")),
            CALL(h.append, reg("log"), reg("a"), reg("b"), reg("c"), reg("d"), store_to=reg("log")),
        ])),
        CALL(len, reg("log")),
    ])


def build_lambdas():
    """Lambdas and closures: only cloudpickle can save these (by value)."""
    reg = Registers(x=1, acc=[])
    scale = 7
    offset = {"k": 5}
    return SEQ([
        REPEAT(5, SEQ([
            CALL(lambda x: (x * scale + offset["k"]) % 1009, reg("x"), store_to=reg("x")),
            CALL(lambda: (random.random(), np.random.rand(2), torch.rand(2)), store_to=reg("r")),
            CALL(lambda acc, x, r: acc + [(x, r)], reg("acc"), reg("x"), reg("r"), store_to=reg("acc")),
        ]), counter=reg("i")),
        CALL(lambda acc, i: (len(acc), i), reg("acc"), reg("i")),
    ])


PROGRAMS = {
    "all_kinds": build_all_kinds,
    "direct": build_direct_draws,
    "helpers": build_helper_draws,
    "mixed": build_mixed_draws,
    "lambdas": build_lambdas,
}


# ------------------------------------------------------------------ comparing
def assert_identical(got, expected, where="value"):
    """Bit-for-bit equality that understands numpy arrays, torch tensors and containers."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__} is not a tensor"
        assert got.dtype == expected.dtype and got.shape == expected.shape, f"{where}: dtype/shape differ"
        assert torch.equal(got, expected), f"{where}: {got} != {expected}"
    elif isinstance(expected, (np.ndarray, np.generic)):
        assert isinstance(got, (np.ndarray, np.generic)), f"{where}: {type(got).__name__} is not a numpy value"
        assert np.asarray(got).dtype == np.asarray(expected).dtype, f"{where}: dtypes differ"
        assert np.shape(got) == np.shape(expected), f"{where}: shapes differ"
        assert np.array_equal(got, expected), f"{where}: {got} != {expected}"
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected), f"{where}: {type(got).__name__} != {type(expected).__name__}"
        assert len(got) == len(expected), f"{where}: length {len(got)} != {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_identical(g, e, f"{where}[{i}]")
    elif isinstance(expected, dict):
        assert isinstance(got, dict), f"{where}: {type(got).__name__} is not a dict"
        assert set(got) == set(expected), f"{where}: keys {sorted(got)} != {sorted(expected)}"
        for k in expected:
            assert_identical(got[k], expected[k], f"{where}[{k!r}]")
    else:
        assert type(got) is type(expected), f"{where}: {type(got).__name__} != {type(expected).__name__}"
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def outcome(drv):
    return {"result": drv.result, "steps": drv.steps, "done": drv.done, "registers": dict(drv.registers)}


def reference(build):
    h.seed_all(SEED)
    drv = build().start()
    drv.run()
    return outcome(drv), h.post_draws()


def stopped_at(build, k):
    h.seed_all(SEED)
    drv = build().start()
    drv.run(max_steps=k)
    assert drv.steps == k
    return drv


def scramble_rng():
    """Move every global generator somewhere else, so a resumed run only matches if load restores them."""
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    random.random(), np.random.rand(5), torch.rand(5)


def rng_state():
    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def assert_rng_state(got, expected):
    assert got["random"] == expected["random"]
    g, e = got["numpy"], expected["numpy"]
    assert g[0] == e[0] and np.array_equal(g[1], e[1]) and tuple(g[2:]) == tuple(e[2:])
    assert torch.equal(got["torch"], expected["torch"])


def cuts(total):
    return sorted({0, 1, total // 3, total // 2, total - 1, total})


# ------------------------------------------------------------------ file surgery
# The layout is the one documented in flowvm/persist/checkpoint.py:
#     MAGIC | header length (4, big-endian) | header JSON | [SHA-256 of the bytes so far (32)]
#     | payload | SHA-256 of everything before (32) | [HMAC-SHA256 (32), signed files]
# The header checksum is optional here so that these helpers follow the format either way.
def _head_end(data):
    m = len(ckpt.MAGIC)
    (hlen,) = struct.unpack(">I", data[m:m + 4])
    return m + 4 + hlen


def _has_head_digest(data):
    e = _head_end(data)
    return data[e:e + 32] == hashlib.sha256(data[:e]).digest()


def _layout_has_head_digest():
    return _has_head_digest(ckpt.dumps(REPEAT(1, CALL(h.inc, 1)).start()))


def split(data):
    """(header dict, payload, checksum, signature) of a checkpoint file."""
    e = _head_end(data)
    header = json.loads(data[len(ckpt.MAGIC) + 4:e].decode())
    start = e + (32 if _has_head_digest(data) else 0)
    end = start + header["payload_bytes"]
    return header, data[start:end], data[end:end + 32], data[end + 32:]


def build_file(header, payload, key=None, signature=b""):
    """A checkpoint file with correct plain checksums; signed with key, else followed by signature as given."""
    header = dict(header, payload_bytes=len(payload))
    hb = json.dumps(header).encode()
    head = ckpt.MAGIC + struct.pack(">I", len(hb)) + hb
    if _layout_has_head_digest():
        head += hashlib.sha256(head).digest()
    body = head + payload
    out = body + hashlib.sha256(body).digest()
    if key is not None:
        out += hmac.new(key, body, hashlib.sha256).digest()
    else:
        out += signature
    return out


def trap_payload(marker):
    """A payload that creates the marker file if anything unpickles it."""
    return pickle.dumps({"driver": h.Trap(marker), "rng": {}}, protocol=pickle.HIGHEST_PROTOCOL)


def header_offsets(data):
    """(end of the magic, start of the header JSON, start of the payload)."""
    e = _head_end(data)
    return len(ckpt.MAGIC), len(ckpt.MAGIC) + 4, e + (32 if _has_head_digest(data) else 0)


@pytest.fixture
def saved(tmp_path):
    """A half-run all-kinds driver saved to a file: (path, bytes)."""
    drv = stopped_at(build_all_kinds, 7)
    path = tmp_path / "run.ckpt"
    flowvm.save(drv, path)
    return path, path.read_bytes()


def load_bytes(tmp_path, data, name="x.ckpt", **kw):
    path = tmp_path / name
    path.write_bytes(data)
    return flowvm.load(path, **kw)


def reason_of(excinfo):
    return excinfo.value.reason.lower()


# ==================================================================== round trips
@pytest.mark.parametrize("name", ["all_kinds", "direct", "helpers", "lambdas"])
def test_round_trip_at_every_step_in_process(tmp_path, name, capsys):
    """Stop at every k, save, scramble the RNGs, load, finish: identical to an uninterrupted run."""
    build = PROGRAMS[name]
    expected, _ = reference(build)
    total = expected["steps"]
    assert total > 5
    for k in range(total + 1):
        drv = stopped_at(build, k)
        path = tmp_path / f"{name}-{k}.ckpt"
        assert flowvm.save(drv, path) == path
        del drv
        scramble_rng()
        loaded = flowvm.load(path)
        assert isinstance(loaded, flowvm.Driver)
        assert loaded.steps == k and loaded.done == (k == total)
        loaded.run()
        assert_identical(outcome(loaded), expected, f"{name} resumed after {k} steps")


def test_round_trip_through_several_checkpoints(tmp_path):
    """save, load, run a little, save again, ... : still identical, and the header counts the steps."""
    expected, _ = reference(build_all_kinds)
    h.seed_all(SEED)
    drv = build_all_kinds().start()
    path = tmp_path / "chain.ckpt"
    while not drv.done:
        drv.run(max_steps=3)
        flowvm.save(drv, path)
        assert ckpt.read_header(path)["steps"] == drv.steps
        scramble_rng()
        drv = flowvm.load(path)
    assert_identical(outcome(drv), expected)


def test_resumed_direct_generator_calls_share_the_global_generators(tmp_path):
    """CALL(random.random) and a function calling random.random() draw from one generator, also after load.

    Pickling ``random.random`` / ``np.random.rand`` (bound methods of the global
    generator objects) by value would leave the loaded program drawing from a
    private copy of the generator, out of step with the global one.
    """
    expected, after = reference(build_mixed_draws)
    drv = stopped_at(build_mixed_draws, 6)
    flowvm.save(drv, tmp_path / "m.ckpt")
    scramble_rng()
    loaded = flowvm.load(tmp_path / "m.ckpt")
    loaded.run()
    assert_identical(outcome(loaded), expected, "mixed draws resumed in process")
    assert_identical(h.post_draws(), after, "global generators after the resumed run")


@pytest.mark.parametrize("how", ["partial", "argument"])
def test_global_generator_methods_inside_calls_stay_bound_to_the_global_generators(tmp_path, how):
    """Like CALL(np.random.rand, ...), but the generator's method is wrapped in a partial or passed as an argument."""
    def build():
        reg = Registers(log=[])
        if how == "partial":
            direct = [CALL(functools.partial(np.random.normal, 0.0, 1.0), store_to=reg("a")),
                      CALL(functools.partial(random.uniform, 0.0, 1.0), store_to=reg("c"))]
        else:
            direct = [CALL(h.call, np.random.rand, 2, store_to=reg("a")),
                      CALL(h.call, random.random, store_to=reg("c"))]
        return REPEAT(4, SEQ(direct + [
            CALL(h.draw_global_numpy, 1, store_to=reg("b")),
            CALL(h.draw_global_random, store_to=reg("d")),
            CALL(h.append, reg("log"), reg("a"), reg("b"), reg("c"), reg("d"), store_to=reg("log")),
        ]))

    expected, after = reference(build)
    drv = stopped_at(build, 7)
    flowvm.save(drv, tmp_path / "p.ckpt")
    scramble_rng()
    loaded = flowvm.load(tmp_path / "p.ckpt")
    loaded.run()
    assert_identical(outcome(loaded), expected, f"{how}: resumed in process")
    assert_identical(h.post_draws(), after, f"{how}: global generators after the resumed run")


@pytest.fixture(scope="module")
def resumed_in_subprocess(tmp_path_factory):
    """Save every program at several steps; a fresh interpreter loads and finishes each one."""
    d = tmp_path_factory.mktemp("subproc")
    expected, files = {}, []
    for name, build in PROGRAMS.items():
        ref, after = reference(build)
        expected[name] = (ref, after, cuts(ref["steps"]))
        for k in expected[name][2]:
            path = d / f"{name}-{k}.ckpt"
            flowvm.save(stopped_at(build, k), path)
            files.append(str(path))
    out = d / "out.pkl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, str(toy.TESTS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, toy; toy.resume_main(sys.argv[1:])", *files, str(out)],
        env=env, capture_output=True, text=True, timeout=120, cwd=str(d),
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    with open(out, "rb") as f:
        got = pickle.load(f)
    return expected, got


@pytest.mark.parametrize("name", ["all_kinds", "direct", "helpers", "lambdas", "mixed"])
def test_resume_in_fresh_subprocess_is_bit_for_bit(resumed_in_subprocess, name):
    expected, got = resumed_in_subprocess
    ref, _, ks = expected[name]
    for k in ks:
        res = got[f"{name}-{k}.ckpt"]
        assert res["loaded"] == {"steps": k, "done": k == ref["steps"]}
        assert_identical({key: res[key] for key in ref}, ref, f"{name} resumed in a subprocess after {k} steps")


@pytest.mark.parametrize("name", ["direct", "helpers", "lambdas"])
def test_global_generators_continue_in_step_after_resume_in_subprocess(resumed_in_subprocess, name):
    """After the resumed run, the global generators are where an uninterrupted run leaves them."""
    expected, got = resumed_in_subprocess
    _, after, ks = expected[name]
    for k in ks:
        assert_identical(got[f"{name}-{k}.ckpt"]["after"], after, f"{name}: draws after resuming at step {k}")


def test_unpickle_failure_is_a_checkpoint_error(tmp_path, monkeypatch):
    """A program whose function's module is gone: CheckpointError saying why, not a bare import error."""
    mod = tmp_path / "ckpt_vanishing_module.py"
    mod.write_text("def f(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import ckpt_vanishing_module

    reg = Registers(x=0)
    drv = REPEAT(3, CALL(ckpt_vanishing_module.f, reg("x"), store_to=reg("x"))).start()
    drv.run(max_steps=1)
    flowvm.save(drv, tmp_path / "v.ckpt")
    monkeypatch.delitem(sys.modules, "ckpt_vanishing_module")
    mod.unlink()
    with pytest.raises(CheckpointError) as ei:
        flowvm.load(tmp_path / "v.ckpt")
    assert "cannot be imported" in reason_of(ei) and "ckpt_vanishing_module" in ei.value.reason


# ==================================================================== header
def test_header_has_magic_format_and_versions(tmp_path):
    drv = stopped_at(build_all_kinds, 4)
    path = tmp_path / "h.ckpt"
    flowvm.save(drv, path)
    data = path.read_bytes()
    assert len(ckpt.MAGIC) >= 4 and data.startswith(ckpt.MAGIC)
    header = ckpt.read_header(path)
    assert isinstance(header["format"], int) and header["format"] == ckpt.FORMAT >= 1
    assert header["python"] == platform.python_version()
    assert header["flowvm"] == flowvm.__version__
    assert header["steps"] == 4 and header["done"] is False
    assert header["signed"] is False
    flowvm.save(drv, path, key=b"k")
    assert ckpt.read_header(path)["signed"] is True


def test_file_surgery_helpers_match_the_format(saved, tmp_path):
    """Sanity check for split/build_file, which the damage tests below rely on."""
    path, data = saved
    header, payload, checksum, signature = split(data)
    assert signature == b"" and checksum == hashlib.sha256(data[:-32]).digest()
    assert build_file(header, payload) == data
    assert load_bytes(tmp_path, build_file(header, payload)).steps == 7


# ==================================================================== atomic writes
def _previous(tmp_path):
    path = tmp_path / "run.ckpt"
    flowvm.save(stopped_at(build_all_kinds, 2), path)
    return path, path.read_bytes()


def _assert_previous_intact(path, before):
    assert path.read_bytes() == before
    assert flowvm.load(path).steps == 2
    assert sorted(os.listdir(path.parent)) == [path.name], "temporary files left behind"


@pytest.mark.parametrize("what", ["replace", "fsync", "write", "interrupt"])
def test_failed_save_leaves_previous_file_and_no_temp_files(tmp_path, monkeypatch, what):
    path, before = _previous(tmp_path)
    newer = stopped_at(build_all_kinds, 9)
    if what == "replace":
        def fail(*a, **k):
            raise OSError("simulated rename failure")
        monkeypatch.setattr(os, "replace", fail)
        monkeypatch.setattr(os, "rename", fail)
        expected = flowvm.CheckpointError  # one behaviour for every failed write, as for state files
    elif what == "fsync":
        def fail(*a, **k):
            raise OSError("simulated fsync failure")
        monkeypatch.setattr(os, "fsync", fail)
        monkeypatch.setattr(os, "fdatasync", fail, raising=False)
        expected = flowvm.CheckpointError
    elif what == "write":
        real_fdopen = os.fdopen

        class HalfWriter:
            def __init__(self, f):
                self.f = f

            def write(self, data):
                self.f.write(data[: len(data) // 2])
                self.f.flush()
                raise OSError(28, "No space left on device (simulated)")

            def __getattr__(self, name):
                return getattr(self.f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

        monkeypatch.setattr(os, "fdopen", lambda *a, **k: HalfWriter(real_fdopen(*a, **k)))
        expected = flowvm.CheckpointError
    else:
        def interrupt(*a, **k):
            raise KeyboardInterrupt
        monkeypatch.setattr(os, "fsync", interrupt)
        expected = KeyboardInterrupt
    with pytest.raises(expected):
        flowvm.save(newer, path)
    monkeypatch.undo()
    _assert_previous_intact(path, before)
    flowvm.save(newer, path)  # and a save that works replaces it
    assert flowvm.load(path).steps == 9
    assert sorted(os.listdir(tmp_path)) == [path.name]


@pytest.mark.parametrize("bad", ["lock", "generator"])
def test_unpicklable_register_names_the_register(tmp_path, bad):
    path, before = _previous(tmp_path)
    reg = Registers(x=0)
    reg["naughty_reg"] = threading.Lock() if bad == "lock" else (i for i in range(3))
    drv = REPEAT(3, CALL(h.inc, reg("x"), store_to=reg("x"))).start()
    drv.run(max_steps=1)
    with pytest.raises(CheckpointError) as ei:
        flowvm.save(drv, path)
    assert "naughty_reg" in ei.value.reason
    _assert_previous_intact(path, before)


def test_save_is_not_fooled_by_a_non_driver(tmp_path):
    with pytest.raises((TypeError, CheckpointError)):
        flowvm.save(build_all_kinds(), tmp_path / "p.ckpt")
    assert os.listdir(tmp_path) == []


def test_save_to_a_directory_or_into_a_missing_one_names_the_path(tmp_path):
    drv = CALL(abs, -1).start()
    with pytest.raises(CheckpointError, match="is a directory; give a file name") as err:
        flowvm.save(drv, tmp_path)
    assert str(tmp_path) in str(err.value)
    with pytest.raises(CheckpointError, match=f"no directory {tmp_path / 'missing'}"):
        flowvm.save(drv, tmp_path / "missing" / "x.ckpt")
    assert os.listdir(tmp_path) == []


def test_a_saved_file_gets_the_umask_permissions_or_keeps_those_of_the_file_it_replaces(tmp_path):
    drv = CALL(abs, -1).start()
    old = os.umask(0o027)
    try:
        flowvm.save(drv, tmp_path / "new.ckpt")
        assert stat.S_IMODE(os.stat(tmp_path / "new.ckpt").st_mode) == 0o640  # as open() would create it
        (tmp_path / "kept.ckpt").write_bytes(b"")
        os.chmod(tmp_path / "kept.ckpt", 0o604)
        flowvm.save(drv, tmp_path / "kept.ckpt")
        assert stat.S_IMODE(os.stat(tmp_path / "kept.ckpt").st_mode) == 0o604
    finally:
        os.umask(old)
    assert sorted(os.listdir(tmp_path)) == ["kept.ckpt", "new.ckpt"]  # no temporary file left


def test_a_save_removes_temporary_files_left_by_a_process_killed_while_saving(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # a process id that has exited
    orphan = tmp_path / f".run.ckpt.{dead}-0123456789ab.tmp"
    live = tmp_path / f".run.ckpt.{os.getppid()}-0123456789ab.tmp"  # a live process: perhaps saving now
    other = tmp_path / f".other.ckpt.{dead}-0123456789ab.tmp"
    for p in (orphan, live, other):
        p.write_bytes(b"partial")
    flowvm.save(CALL(abs, -1).start(), tmp_path / "run.ckpt")
    assert sorted(os.listdir(tmp_path)) == sorted(["run.ckpt", live.name, other.name])


# ==================================================================== damaged files
def test_truncated_files(saved, tmp_path):
    path, data = saved
    end_magic, start_header, start_payload = header_offsets(data)
    n = len(data)
    points = {1, 3, end_magic - 1, end_magic, end_magic + 2, start_header + 1, (start_header + start_payload) // 2,
              start_payload - 1, start_payload, start_payload + 1, (start_payload + n) // 2, n - 33, n - 32,
              n - 31, n - 1}
    for cut in sorted(points):
        with pytest.raises(CheckpointError) as ei:
            load_bytes(tmp_path, data[:cut])
        assert "truncated" in reason_of(ei), (cut, ei.value.reason)


def test_truncated_signed_files(tmp_path):
    drv = stopped_at(build_all_kinds, 5)
    data = ckpt.dumps(drv, key=b"secret")
    n = len(data)
    for cut in (n - 1, n - 32, n - 33, n - 64, n - 65, n // 2):
        for key in (None, b"secret"):
            with pytest.raises(CheckpointError) as ei:
                load_bytes(tmp_path, data[:cut], key=key)
            assert "truncated" in reason_of(ei), (cut, key, ei.value.reason)


def test_damaged_files_are_never_unpickled(tmp_path):
    """Truncations and flipped bytes of a (valid) booby-trapped file are refused before unpickling."""
    marker = tmp_path / "MARKER"
    header, _, _, _ = split(ckpt.dumps(REPEAT(1, CALL(h.inc, 1)).start()))
    data = build_file(header, trap_payload(marker))
    assert len(data) < 1000
    for cut in range(len(data)):
        with pytest.raises(CheckpointError):
            ckpt.loads(data[:cut])
    for pos in range(len(data)):
        for mask in (0x01, 0x02, 0x08, 0x80, 0xFF):
            bad = bytearray(data)
            bad[pos] ^= mask
            with pytest.raises(CheckpointError):
                ckpt.loads(bytes(bad))
    with pytest.raises(CheckpointError):
        load_bytes(tmp_path, data[:-1])
    assert not marker.exists()
    # control: the intact file does run the trap when loaded
    with contextlib.suppress(Exception):
        load_bytes(tmp_path, data)
    assert marker.exists()


def _flips(data):
    """(position, mask) pairs: every bit of every header byte, and one bit plus 0xFF for every other byte."""
    _, _, start_payload = header_offsets(data)
    for pos in range(len(data)):
        masks = [1 << b for b in range(8)] + [0xFF] if pos < start_payload + 8 else [1 << (pos % 8), 0xFF]
        for mask in masks:
            yield pos, mask


def test_flipped_byte_anywhere_is_detected(saved):
    """A checksum catches every flipped byte: CheckpointError, never a load or a bare pickle error."""
    _, data = saved
    for pos, mask in _flips(data):
        bad = bytearray(data)
        bad[pos] ^= mask
        with pytest.raises(CheckpointError):
            ckpt.loads(bytes(bad), restore_random=False)


def test_flipped_byte_is_reported_as_corruption(saved):
    """...and the reason says the file is corrupted (or, in the magic, not a flowvm checkpoint)."""
    _, data = saved
    end_magic, _, _ = header_offsets(data)
    wrong = []
    for pos, mask in _flips(data):
        bad = bytearray(data)
        bad[pos] ^= mask
        with pytest.raises(CheckpointError) as ei:
            ckpt.loads(bytes(bad), restore_random=False)
        reason = reason_of(ei)
        ok = "corrupt" in reason or (pos < end_magic and "not a flowvm checkpoint" in reason)
        if not ok:
            wrong.append(f"byte {pos} ^ {mask:#04x} ({chr(data[pos])!r} -> {chr(bad[pos])!r}): {ei.value.reason}")
    assert not wrong, f"{len(wrong)} flips misreported, e.g.:\n" + "\n".join(wrong[:12])


def test_flipped_byte_in_signed_file_is_refused_with_key(tmp_path):
    data = ckpt.dumps(stopped_at(build_all_kinds, 5), key=b"secret")
    for pos in range(0, len(data), 7):
        bad = bytearray(data)
        bad[pos] ^= 0x20
        with pytest.raises(CheckpointError):
            ckpt.loads(bytes(bad), key=b"secret", restore_random=False)
    for pos in range(len(data) - 32, len(data)):  # every byte of the signature
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(CheckpointError) as ei:
            ckpt.loads(bytes(bad), key=b"secret", restore_random=False)
        assert "signature" in reason_of(ei)


# ==================================================================== foreign and newer files
@pytest.mark.parametrize("kind", ["random", "pickle", "pickled_driver", "text", "short"])
def test_foreign_files(tmp_path, kind):
    marker = tmp_path / "MARKER"
    if kind == "random":
        data = random.Random(7).randbytes(4096)
    elif kind == "pickle":
        data = pickle.dumps({"driver": h.Trap(marker), "rng": {}})
    elif kind == "pickled_driver":
        import cloudpickle

        data = cloudpickle.dumps(stopped_at(build_all_kinds, 3))
    elif kind == "text":
        data = b"steps: 3\nthis is not a checkpoint\n" * 10
    else:
        data = b"PK\x03"
    with pytest.raises(CheckpointError) as ei:
        load_bytes(tmp_path, data)
    assert "not a flowvm checkpoint" in reason_of(ei)
    assert not marker.exists()


def test_empty_file_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError) as ei:
        load_bytes(tmp_path, b"")
    reason = reason_of(ei)
    assert "empty" in reason or "not a flowvm checkpoint" in reason, ei.value.reason


def test_newer_format_is_refused_with_a_clear_reason(saved, tmp_path):
    _, data = saved
    header, payload, _, _ = split(data)
    marker = tmp_path / "MARKER"
    for payload_ in (payload, trap_payload(marker)):
        newer = build_file(dict(header, format=99), payload_)
        with pytest.raises(CheckpointError) as ei:
            load_bytes(tmp_path, newer)
        reason = reason_of(ei)
        assert "99" in reason and ("newer" in reason or "upgrade" in reason), ei.value.reason
        with pytest.raises(CheckpointError):
            ckpt.read_header(tmp_path / "x.ckpt")
    assert not marker.exists()


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError) as ei:
        flowvm.load(tmp_path / "nope.ckpt")
    assert "no such file" in reason_of(ei) or "not found" in reason_of(ei) or "does not exist" in reason_of(ei)
    with pytest.raises(CheckpointError):
        flowvm.load(tmp_path)  # a directory


# ==================================================================== signed files
def test_signed_round_trip(tmp_path):
    expected, _ = reference(build_all_kinds)
    for save_key, load_key in ((b"secret", b"secret"), ("secret", b"secret"), (b"secret", "secret")):
        path = tmp_path / "s.ckpt"
        flowvm.save(stopped_at(build_all_kinds, 6), path, key=save_key)
        scramble_rng()
        drv = flowvm.load(path, key=load_key)
        drv.run()
        assert_identical(outcome(drv), expected)
    # a signed file is refused without its key, unless the caller opts out of the signature check
    with pytest.raises(CheckpointError, match="signed; give its key"):
        flowvm.load(path)
    scramble_rng()
    drv = flowvm.load(path, verify=False)
    drv.run()
    assert_identical(outcome(drv), expected)


def test_wrong_key_is_refused(tmp_path):
    path = tmp_path / "s.ckpt"
    flowvm.save(stopped_at(build_all_kinds, 6), path, key=b"secret")
    for key in (b"Secret", b"secre", b"secret!", b"other key"):
        with pytest.raises(CheckpointError) as ei:
            flowvm.load(path, key=key)
        assert "signature" in reason_of(ei) or "key" in reason_of(ei)


def test_unsigned_file_with_key_is_refused(tmp_path, saved):
    path, data = saved
    with pytest.raises(CheckpointError) as ei:
        flowvm.load(path, key=b"secret")
    assert "not signed" in reason_of(ei) or "unsigned" in reason_of(ei)
    # a booby-trapped unsigned file, with a key: refused before unpickling
    marker = tmp_path / "MARKER"
    header, _, _, _ = split(data)
    with pytest.raises(CheckpointError):
        load_bytes(tmp_path, build_file(header, trap_payload(marker)), key=b"secret")
    assert not marker.exists()


def test_tampered_signed_file_is_refused_before_unpickling(tmp_path):
    """Payload swapped and the plain checksum fixed up, old signature kept: refused with the key, nothing run."""
    data = ckpt.dumps(stopped_at(build_all_kinds, 6), key=b"secret")
    header, _, _, signature = split(data)
    assert header["signed"] is True and len(signature) == 32
    marker = tmp_path / "MARKER"
    tampered = build_file(header, trap_payload(marker), signature=signature)
    with pytest.raises(CheckpointError) as ei:
        load_bytes(tmp_path, tampered, key=b"secret")
    assert "signature" in reason_of(ei) or "tamper" in reason_of(ei)
    assert not marker.exists()
    # the same tampering with a header that claims the file is unsigned (signature dropped)
    downgraded = build_file(dict(header, signed=False), trap_payload(marker))
    with pytest.raises(CheckpointError):
        load_bytes(tmp_path, downgraded, key=b"secret")
    assert not marker.exists()
    # signed by someone with another key
    forged = build_file(header, trap_payload(marker), key=b"attacker")
    with pytest.raises(CheckpointError):
        load_bytes(tmp_path, forged, key=b"secret")
    assert not marker.exists()
    # without a key the signed file is refused too, before anything is unpickled
    with pytest.raises(CheckpointError, match="signed"):
        load_bytes(tmp_path, tampered)
    assert not marker.exists()
    # control: opting out of the signature check, the tampered file passes its checksum and the trap runs
    with contextlib.suppress(Exception):
        ckpt.loads(tampered, verify=False)
    assert marker.exists()


@pytest.mark.parametrize("key", [b"", "", 123])
def test_bad_keys_are_rejected(tmp_path, key):
    with pytest.raises((TypeError, ValueError, CheckpointError)):
        flowvm.save(stopped_at(build_all_kinds, 1), tmp_path / "k.ckpt", key=key)
    assert not (tmp_path / "k.ckpt").exists()


# ==================================================================== random states
def test_a_loaded_run_sets_the_global_generators_at_its_first_step(tmp_path):
    drv = stopped_at(build_all_kinds, 8)
    flowvm.save(drv, tmp_path / "r.ckpt")
    state_at_save = rng_state()
    draws_after_save = h.post_draws()
    scramble_rng()
    before_load = rng_state()
    loaded = flowvm.load(tmp_path / "r.ckpt")
    assert_rng_state(rng_state(), before_load)  # loading changes nothing in the process
    loaded.run(max_steps=0)  # moves nothing, sets nothing
    assert_rng_state(rng_state(), before_load)
    loaded.step()  # sets the saved states, then draws as the original's ninth step does
    after_first_step = rng_state()
    from flowvm.base.environment import apply_random
    scramble_rng()
    at_save = flowvm.load(tmp_path / "r.ckpt").saved_environment["random"]
    apply_random(at_save)
    assert_rng_state(rng_state(), state_at_save)
    assert_identical(h.post_draws(), draws_after_save)
    apply_random(at_save)
    drv.step()
    assert_rng_state(after_first_step, rng_state())


def test_restore_random_false_leaves_global_generators_alone(tmp_path):
    drv = stopped_at(build_all_kinds, 8)
    flowvm.save(drv, tmp_path / "r.ckpt")
    scramble_rng()
    before = rng_state()
    loaded = flowvm.load(tmp_path / "r.ckpt", restore_random=False)
    assert loaded.steps == 8
    assert_rng_state(rng_state(), before)
    h.seed_all(5)
    draws = h.post_draws()
    h.seed_all(5)
    ckpt.loads((tmp_path / "r.ckpt").read_bytes(), restore_random=False)
    assert_identical(h.post_draws(), draws)


@pytest.mark.parametrize("payload, says", [
    (pickle.dumps({"weights": [1, 2, 3]}), "unpickles to a dict without a driver"),
    (pickle.dumps([1, 2]), "unpickles to a list"),
])
def test_a_foreign_pickle_with_valid_checksums_is_named_as_no_flowvm_run(tmp_path, payload, says):
    header, _, _, _ = split(ckpt.dumps(REPEAT(1, CALL(h.inc, 1)).start()))
    data = build_file(dict(header, buffers=[]), payload)
    with pytest.raises(CheckpointError) as ei:
        load_bytes(tmp_path, data)
    assert says in reason_of(ei) and "holds no flowvm run" in reason_of(ei)
