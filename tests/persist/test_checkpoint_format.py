"""Checkpoint format 2: tensors and arrays out of band, format 1 still read, damaged files refused.

The layout is the one documented in flowvm/persist/checkpoint.py:
    MAGIC | header length (4) | header JSON | SHA-256 (32)
    | buffer 0 | buffer 1 | ... | pickle stream | SHA-256 (32) | [HMAC-SHA256 (32)]
with the buffer table ``"buffers": [[nbytes, kind], ...]`` in the header.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import pickle
import platform
import struct
import time
import tracemalloc
import sys

import numpy as np
import pytest
import torch

import flowvm
from flowvm import CALL, SEQ, CheckpointError, Registers
from flowvm.persist import checkpoint as ckpt
from flowvm.persist import pickler

BIG = 1 << 16  # bytes at which a buffer leaves the pickle stream (checkpoint.OUT_OF_BAND_MIN)


def keep(x):
    return x


def driver_with(**values):
    """A driver paused after its first step, whose registers hold values."""
    reg = Registers(**values)
    drv = SEQ([CALL(keep, reg(name)) for name in values] + [CALL(keep, 0)]).start()
    drv.run(max_steps=1)
    return drv


def round_trip(tmp_path, drv, **kw):
    path = tmp_path / "run.ckpt"
    flowvm.save(drv, path, **kw)
    loaded = flowvm.load(path, restore_random=False, key=kw.get("key"))
    return loaded.registers, path


def split(data):
    """(header, offset of the payload, offset of the trailing checksum)."""
    (hlen,) = struct.unpack(">I", data[8:12])
    header = json.loads(data[12:12 + hlen])
    start = 12 + hlen + 32
    return header, start, start + header["payload_bytes"]


def rebuild(header, payload, key=None):
    """A file with header and payload and correct checksums (signed with key)."""
    hb = json.dumps(dict(header, payload_bytes=len(payload))).encode()
    head = ckpt.MAGIC + struct.pack(">I", len(hb)) + hb
    body = head + hashlib.sha256(head).digest() + payload
    out = body + hashlib.sha256(body).digest()
    if key is not None:
        out += hmac.new(key, body, hashlib.sha256).digest()
    return out


def same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# ==================================================================== torch tensors
def test_tensors_go_out_of_band_and_the_pickle_stream_stays_small(tmp_path):
    w = torch.randn(300_000)
    _, path = round_trip(tmp_path, driver_with(w=w))
    header = ckpt.read_header(path)
    assert header["format"] == 2 == ckpt.FORMAT
    assert header["buffers"] == [[w.untyped_storage().nbytes(), "torch"]]
    assert header["payload_bytes"] - w.untyped_storage().nbytes() < 20_000  # the rest: the program, states


def test_shared_storages_stay_shared(tmp_path):
    base = torch.arange(200_000, dtype=torch.float32)
    views = {"base": base, "tail": base[1000:], "grid": base.view(400, 500), "cols": base.view(400, 500)[:, ::3],
             "t": base.view(400, 500).t(), "bits": base.view(torch.int32), "small": torch.arange(10.)}
    views["small_view"] = views["small"][2:5]
    r, path = round_trip(tmp_path, driver_with(**views))
    assert len(ckpt.read_header(path)["buffers"]) == 1  # one storage, written once
    for name, v in views.items():
        assert r[name].dtype == v.dtype and r[name].shape == v.shape, name
        assert r[name].stride() == v.stride() and r[name].storage_offset() == v.storage_offset(), name
        assert torch.equal(r[name], v), name
    for name in ("tail", "grid", "cols", "t", "bits"):
        assert same_storage(r[name], r["base"]), name
    assert same_storage(r["small"], r["small_view"])  # in the stream too
    r["base"][1000] = -1.0  # a write through one view shows through the others
    assert r["tail"][0] == -1.0 and r["grid"][2, 0] == -1.0
    assert not same_storage(r["base"], base)  # a copy, not the live tensor


def test_non_contiguous_views_keep_their_layout(tmp_path):
    x = torch.randn(64, 48, 40)
    views = {"perm": x.permute(2, 0, 1), "step": x[::2, 1::3, ::5], "diag": x[0].diagonal(),
             "expanded": torch.randn(1, 40).expand(512, 40), "offset": x.flatten()[777:777 + 5000]}
    r, _ = round_trip(tmp_path, driver_with(**views))
    for name, v in views.items():
        assert r[name].stride() == v.stride() and r[name].storage_offset() == v.storage_offset(), name
        assert torch.equal(r[name], v), name
    assert same_storage(r["perm"], r["step"]) and same_storage(r["perm"], r["offset"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.float64,
                                   torch.uint8, torch.complex64])
@pytest.mark.parametrize("n", [7, 100_000])
def test_dtypes(tmp_path, dtype, n):
    g = torch.Generator().manual_seed(n)
    if dtype == torch.bool:
        t = torch.rand(n, generator=g) > 0.5
    elif dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(n, generator=g, dtype=dtype)
    else:
        t = torch.randint(0, 100 if dtype == torch.uint8 else 1 << 40, (n,), generator=g, dtype=dtype)
    r, path = round_trip(tmp_path, driver_with(t=t, scalar=t[3].clone()))
    assert r["t"].dtype == dtype and torch.equal(r["t"], t)
    assert r["scalar"].dtype == dtype and r["scalar"].shape == () and torch.equal(r["scalar"], t[3])
    expected = [[t.untyped_storage().nbytes(), "torch"]] if t.untyped_storage().nbytes() >= BIG else []
    assert ckpt.read_header(path)["buffers"] == expected


def test_requires_grad_and_grad_are_kept(tmp_path):
    model = torch.nn.Linear(300, 200)
    leaf = torch.randn(50_000, requires_grad=True)
    (model(torch.randn(4, 300)).sum() + (leaf * 3).sum()).backward()
    frozen = torch.randn(20_000)
    r, path = round_trip(tmp_path, driver_with(model=model, leaf=leaf, frozen=frozen))
    m = r["model"]
    assert isinstance(m.weight, torch.nn.Parameter) and m.weight.requires_grad
    assert torch.equal(m.weight, model.weight) and torch.equal(m.weight.grad, model.weight.grad)
    assert torch.equal(m.bias.grad, model.bias.grad)
    assert r["leaf"].requires_grad and r["leaf"].is_leaf and torch.equal(r["leaf"].grad, leaf.grad)
    assert not r["frozen"].requires_grad and r["frozen"].grad is None
    kinds = [kind for _, kind in ckpt.read_header(path)["buffers"]]
    assert kinds == ["torch"] * len(kinds) and len(kinds) >= 4  # weight, its grad, leaf, its grad, frozen


def test_loaded_and_saved_storages_stay_resizable(tmp_path):
    """Loaded tensors own memory torch allocated; saving leaves the live tensors as they were."""
    t = torch.randn(100_000)
    r, _ = round_trip(tmp_path, driver_with(t=t, small=torch.randn(5)))
    t.resize_(200_000)  # the saved tensor: saving took no hold on its storage
    r["t"].resize_(200_000)
    r["small"].resize_(0)
    torch.add(r["t"][:1000], 1, out=r["small"])  # an out= resizes its output


def test_optimizer_state_round_trip(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(200, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 200), torch.randn(16, 10)

    def step(model, opt):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step(model, opt)
    r, _ = round_trip(tmp_path, driver_with(pair=(model, opt)))
    model2, opt2 = r["pair"]
    assert opt2.param_groups[0]["params"][0] is model2[0].weight  # the optimizer drives the loaded model
    step(model, opt)
    step(model2, opt2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_meta_tensors_use_torchs_own_pickling(tmp_path):
    r, path = round_trip(tmp_path, driver_with(m=torch.empty(1000, 1000, device="meta"), t=torch.randn(100_000)))
    assert r["m"].device.type == "meta" and r["m"].shape == (1000, 1000)
    assert [kind for _, kind in ckpt.read_header(path)["buffers"]] == ["torch"]


def test_storages_from_another_byte_order_are_refused():
    with pytest.raises(CheckpointError) as ei:
        pickler.rebuild_storage(bytearray(8), "big" if sys.byteorder == "little" else "little")
    assert "endian" in ei.value.reason


# ==================================================================== numpy arrays
def test_numpy_arrays(tmp_path):
    rng = np.random.default_rng(1)
    big = rng.standard_normal((300, 400))
    fortran = np.asfortranarray(rng.standard_normal((200, 100)))
    frozen = rng.standard_normal(20_000)
    frozen.flags.writeable = False
    arrays = {"big": big, "strided": big[:, ::3], "fortran": fortran, "frozen": frozen,
              "objects": np.array([1, "two", None, {"three": 3}] * 10_000, dtype=object),
              "records": np.zeros(10_000, dtype=[("a", "<i4"), ("b", "<f8")]), "small": np.arange(5),
              "bools": rng.random(100_000) > 0.5}
    r, path = round_trip(tmp_path, driver_with(**arrays))
    for name, a in arrays.items():
        assert r[name].dtype == a.dtype and r[name].shape == a.shape, name
        assert np.array_equal(r[name], a) if a.dtype != object else list(r[name]) == list(a), name
    assert r["fortran"].flags.f_contiguous
    assert r["big"].flags.writeable and not r["frozen"].flags.writeable
    r["big"][0, 0] = 5.0
    assert r["strided"][0, 0] != 5.0  # two arrays, two copies: numpy views are not shared by pickle
    table = ckpt.read_header(path)["buffers"]
    # out of band: big, fortran, frozen, records, bools; the strided view and the object array go in the stream
    assert sorted(n for n, _ in table) == sorted([big.nbytes, fortran.nbytes, frozen.nbytes,
                                                  arrays["records"].nbytes, arrays["bools"].nbytes])
    assert all(kind == "bytes" for _, kind in table)


def test_saving_copies_no_array_data_and_loading_holds_one_copy(tmp_path):
    """tracemalloc sees numpy's allocations: a save allocates next to nothing, a load the arrays themselves."""
    a = np.random.default_rng(2).standard_normal(2_500_000)  # 20 MB
    drv = driver_with(a=a)
    path = tmp_path / "np.ckpt"
    flowvm.save(drv, path)  # imports and first-time allocations
    tracemalloc.start()
    try:
        flowvm.save(drv, path)
        _, save_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        loaded = flowvm.load(path, restore_random=False)
        _, load_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(loaded.registers["a"], a)
    assert save_peak < 0.1 * a.nbytes, save_peak
    assert load_peak < 1.2 * a.nbytes, load_peak


# ==================================================================== bytes, copies, signatures
def test_dumps_and_loads(tmp_path):
    t = torch.randn(100_000)
    a = np.arange(50_000.0)
    data = ckpt.dumps(driver_with(t=t, a=a, v=t[10:]))
    for given in (data, bytearray(data), memoryview(data)):
        r = ckpt.loads(given, restore_random=False).registers
        assert torch.equal(r["t"], t) and np.array_equal(r["a"], a) and same_storage(r["t"], r["v"])
        if isinstance(given, bytearray):
            given[:] = bytes(len(given))  # the loaded objects do not alias the caller's buffer
            assert torch.equal(r["t"], t) and np.array_equal(r["a"], a)
    (tmp_path / "x.ckpt").write_bytes(data)
    assert torch.equal(flowvm.load(tmp_path / "x.ckpt").registers["t"], t)


@pytest.mark.parametrize("copier", ["pickle", "deepcopy"])
def test_copies_of_a_driver_keep_shared_storages(copier):
    base = torch.randn(100_000)
    drv = driver_with(base=base, view=base[5:], arr=np.arange(30_000.0))
    other = pickle.loads(pickle.dumps(drv)) if copier == "pickle" else copy.deepcopy(drv)
    r = other.registers
    assert torch.equal(r["view"], base[5:]) and same_storage(r["base"], r["view"])
    assert not same_storage(r["base"], base)
    r["base"].resize_(300_000)  # memory torch allocated
    assert np.array_equal(r["arr"], np.arange(30_000.0))


def test_signed_round_trip_and_tampered_buffers(tmp_path):
    t = torch.randn(100_000)
    r, path = round_trip(tmp_path, driver_with(t=t), key=b"secret")
    assert torch.equal(r["t"], t) and ckpt.read_header(path, key=b"secret")["signed"]
    data = path.read_bytes()
    header, start, end = split(data)
    assert header["buffers"][0][0] == t.untyped_storage().nbytes()
    bad = bytearray(data)
    bad[start + 1234] ^= 0x10  # inside the tensor's bytes
    bad[end:end + 32] = hashlib.sha256(bytes(bad[:end])).digest()  # checksum fixed up, signature not
    (tmp_path / "bad.ckpt").write_bytes(bad)
    with pytest.raises(CheckpointError) as ei:
        flowvm.load(tmp_path / "bad.ckpt", key=b"secret")
    assert "signature" in ei.value.reason
    with pytest.raises(CheckpointError):
        ckpt.read_header(tmp_path / "bad.ckpt", key=b"secret")
    with pytest.raises(CheckpointError) as ei:
        flowvm.load(path, key=b"other")
    assert "signature" in ei.value.reason


def test_large_files_hashed_on_threads(tmp_path):
    """Past the threading threshold (saving, loading, signed or not): round trips and damage are found."""
    t = torch.randn(3_000_000)  # 12 MB
    a = np.random.default_rng(3).standard_normal(1_200_000)  # 9.6 MB
    assert t.nbytes + a.nbytes > ckpt.THREADED_MIN
    for key in (None, b"k"):
        r, path = round_trip(tmp_path, driver_with(t=t, a=a), key=key)
        assert torch.equal(r["t"], t) and np.array_equal(r["a"], a)
        data = path.read_bytes()
        assert ckpt.loads(data, key=key, restore_random=False).registers["t"].shape == t.shape
        _, start, end = split(data)
        for pos in (start + 5, start + t.nbytes + 7, end - 3):
            bad = bytearray(data)
            bad[pos] ^= 0x01
            (tmp_path / "bad.ckpt").write_bytes(bad)
            for load in (lambda: flowvm.load(tmp_path / "bad.ckpt", key=key),
                         lambda: ckpt.read_header(tmp_path / "bad.ckpt", key=key),
                         lambda: ckpt.loads(bytes(bad), key=key)):
                with pytest.raises(CheckpointError) as ei:
                    load()
                assert "corrupted: checksum mismatch" in ei.value.reason


def test_a_url_target_goes_through_storage():
    """Targets other than local files are written through storage.open_write (memoryviews) and read
    through storage.read_bytes, then checked in memory."""
    pytest.importorskip("fsspec")
    t, a = torch.randn(100_000), np.arange(20_000.0)
    url = "memory://flowvm-test-format/run.ckpt"
    flowvm.save(driver_with(t=t, a=a, v=t[7:]), url, key=b"k")
    assert [kind for _, kind in ckpt.read_header(url, key=b"k")["buffers"]] == ["torch", "bytes"]
    r = flowvm.load(url, key=b"k").registers
    assert torch.equal(r["t"], t) and np.array_equal(r["a"], a) and same_storage(r["t"], r["v"])
    r["t"].resize_(200_000)


# ==================================================================== damaged format-2 files
@pytest.fixture
def with_buffers(tmp_path):
    drv = driver_with(t=torch.randn(20_000), a=np.arange(10_000.0), small=torch.arange(3))
    path = tmp_path / "b.ckpt"
    flowvm.save(drv, path)
    data = path.read_bytes()
    assert len(split(data)[0]["buffers"]) == 2
    return data


def test_truncated_format_2_files(tmp_path, with_buffers):
    data = with_buffers
    _, start, end = split(data)
    cuts = {0, 5, 12, start - 1, start, start + 1, start + 80_000, start + 80_000 + 40_000, end - 1, end,
            end + 31, len(data) - 1}
    for cut in sorted(cuts):
        (tmp_path / "cut.ckpt").write_bytes(data[:cut])
        for load in (lambda: flowvm.load(tmp_path / "cut.ckpt"), lambda: ckpt.loads(data[:cut]),
                     lambda: ckpt.read_header(tmp_path / "cut.ckpt")):
            with pytest.raises(CheckpointError) as ei:
                load()
            reason = ei.value.reason
            assert "truncated" in reason or (cut == 0 and "empty" in reason), (cut, reason)


def test_flipped_bytes_in_format_2_files(tmp_path, with_buffers):
    data = with_buffers
    _, start, end = split(data)
    positions = set(range(0, start)) | set(range(start, len(data), 97)) | {start + 79_999, start + 80_000, end - 1}
    wrong = []
    for pos in sorted(positions):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        (tmp_path / "bad.ckpt").write_bytes(bad)
        for load in (lambda: flowvm.load(tmp_path / "bad.ckpt"), lambda: ckpt.loads(bytes(bad)),
                     lambda: ckpt.read_header(tmp_path / "bad.ckpt")):
            try:
                load()
                wrong.append(f"byte {pos}: loaded")
            except CheckpointError as err:
                if not ("corrupt" in err.reason or (pos < 8 and "not a flowvm checkpoint" in err.reason)):
                    wrong.append(f"byte {pos}: {err.reason}")
    assert not wrong, wrong[:10]


@pytest.mark.parametrize("table", [[[10 ** 9, "torch"]], [[-1, "bytes"]], [[8, "gpu"]], [[8]], "x", [[1.5, "bytes"]],
                                   None])
def test_a_bad_buffer_table_is_refused_before_unpickling(tmp_path, with_buffers, table):
    """A header with valid checksums (a buggy or hostile writer) but an unusable buffer table."""
    header, start, end = split(with_buffers)
    if table is None:
        del header["buffers"]
    else:
        header["buffers"] = table
    data = rebuild(header, with_buffers[start:end])
    with pytest.raises(CheckpointError) as ei:
        ckpt.loads(data)
    assert "corrupted" in ei.value.reason and "buffer table" in ei.value.reason, ei.value.reason


def test_a_table_that_disagrees_with_the_stream_is_a_checkpoint_error(with_buffers):
    header, start, end = split(with_buffers)
    n0 = header["buffers"][0][0]
    for table in (header["buffers"][:1], header["buffers"] + [[0, "bytes"]], [[n0 - 8, "torch"], header["buffers"][1]]):
        with pytest.raises(CheckpointError) as ei:
            ckpt.loads(rebuild(dict(header, buffers=table), with_buffers[start:end]))
        assert "unpickle" in ei.value.reason, ei.value.reason


# ==================================================================== format 1
def _format_1_file(driver, key=None):
    """A checkpoint as flowvm wrote it in format 1: the whole payload one pickle stream, torch storages
    pickled by torch (through torch.save), no buffer table."""
    from flowvm import __version__

    saved_rules = dict(pickler._RULES)
    pickler._RULES.clear()
    try:
        # the pickler without its storage rules: torch's own pickling, as before format 2
        pickler._RULES.update({torch.storage.TypedStorage: None, torch.UntypedStorage: None})
        payload = pickler.pickle_bytes({"driver": driver})
    finally:
        pickler._RULES.clear()
        pickler._RULES.update(saved_rules)
    assert b"_load_from_bytes" in payload
    # the format-1 encoder
    header = json.dumps({
        "format": 1, "flowvm": __version__, "python": platform.python_version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": driver.steps, "done": driver.done,
        "program": driver.program.kind, "payload_bytes": len(payload), "signed": key is not None, "meta": {},
    }).encode()
    head = ckpt.MAGIC + struct.pack(">I", len(header)) + header
    body = head + hashlib.sha256(head).digest() + payload
    out = body + hashlib.sha256(body).digest()
    if key is not None:
        out += hmac.new(key, body, hashlib.sha256).digest()
    return out


def test_format_1_files_still_load(tmp_path):
    base = torch.randn(100_000, requires_grad=True)
    (base * 2).sum().backward()
    values = {"w": base, "t": torch.arange(50_000), "a": np.arange(20_000.0), "x": 3}
    drv = driver_with(**values)
    for key in (None, b"secret"):
        path = tmp_path / "old.ckpt"
        path.write_bytes(_format_1_file(drv, key))
        header = ckpt.read_header(path, key=key)
        assert header["format"] == 1 and "buffers" not in header and header["signed"] is (key is not None)
        for loaded in (flowvm.load(path, key=key), ckpt.loads(path.read_bytes(), key=key)):
            r = loaded.registers
            assert torch.equal(r["w"], base) and torch.equal(r["w"].grad, base.grad)
            assert torch.equal(r["t"], values["t"]) and np.array_equal(r["a"], values["a"]) and r["x"] == 3
            loaded.run()
            assert loaded.done
        bad = bytearray(path.read_bytes())
        bad[len(bad) // 2] ^= 1
        with pytest.raises(CheckpointError):
            ckpt.loads(bytes(bad), key=key)
