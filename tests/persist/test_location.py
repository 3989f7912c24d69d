"""A checkpoint's place is resolved once into a Location (flowvm.persist.location), and its suffix chooses
its format in one registry (flowvm.persist.formats)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import flowvm
from flowvm import CALL, REPEAT, Registers
from flowvm.persist import location, storage
from flowvm.persist.checkpoint import MAGIC
from flowvm.persist.formats import FORMATS, MAGIC_BYTES, PICKLE, STATE, format_of
from flowvm.persist.location import Location


@pytest.mark.parametrize("given, path, url", [
    ("run.ckpt", Path("run.ckpt"), None),
    (Path("/tmp/a b/run.ckpt"), Path("/tmp/a b/run.ckpt"), None),
    ("file:///abs/run.ckpt", Path("/abs/run.ckpt"), None),
    ("file://localhost/abs/run.ckpt", Path("/abs/run.ckpt"), None),
    ("file://rel/run.ckpt", Path("rel/run.ckpt"), None),
    ("FILE:///abs/run.ckpt", Path("/abs/run.ckpt"), None),
    ("s3://bucket/runs/run.ckpt", None, "s3://bucket/runs/run.ckpt"),
    ("memory://runs/run.safetensors", None, "memory://runs/run.safetensors"),
])
def test_a_place_is_a_local_file_or_a_url(given, path, url):
    loc = Location.of(given)
    assert (loc.path, loc.url, loc.given) == (path, url, given)
    assert loc.is_local is (path is not None) and loc.saved == (path if path is not None else url)
    assert Location.of(loc) is loc and str(loc) == os.fspath(given)
    assert loc.name == ("run.safetensors" if str(given).endswith("safetensors") else "run.ckpt")


def test_a_place_that_is_no_path_is_refused_naming_its_type():
    with pytest.raises(TypeError, match="a path or a URL .* got int 3"):
        Location.of(3)


def _program():
    reg = Registers(n=0)
    return REPEAT(6, CALL(lambda n: n + 1, reg("n"), store_to=reg("n")))


@pytest.mark.parametrize("suffix", [".ckpt", ".safetensors"])
def test_save_and_load_resolve_the_place_once(monkeypatch, suffix):
    made, found = [], []
    real_init, real_fs = Location.__init__, location.filesystem

    def init(self, given, *rest):
        made.append(given)
        real_init(self, given, *rest)

    def fs(url):
        found.append(url)
        return real_fs(url)

    monkeypatch.setattr(Location, "__init__", init)
    monkeypatch.setattr(location, "filesystem", fs)
    url = f"memory://flowvm-tests/{os.getpid()}/once{suffix}"
    drv = _program().start()
    drv.run(max_steps=2)
    fmt = format_of(url)
    made.clear()
    fmt.save(drv, url)
    assert made == [url] and found == [url]
    made.clear(), found.clear()
    loaded = fmt.load(url) if fmt.holds_code else fmt.load(url, _program())
    assert made == [url] and found == [url]
    made.clear(), found.clear()
    assert fmt.read_header(url)["steps"] == 2
    assert made == [url] and found == [url]
    loaded.run()
    assert loaded.registers["n"] == 6


def test_the_suffix_chooses_the_format():
    assert format_of("run.safetensors") is STATE and format_of("RUN.SAFETENSORS") is STATE
    assert format_of("s3://bucket/x/run.safetensors") is STATE
    assert format_of(Location.of("run.safetensors")) is STATE
    for name in ("run.ckpt", "run", "run.safetensors.bak", "s3://bucket/x/run.ckpt"):
        assert format_of(name) is PICKLE
    assert FORMATS[-1] is PICKLE and PICKLE.holds_code and not STATE.holds_code
    assert (PICKLE.save, PICKLE.load, PICKLE.read_header) == (flowvm.save, flowvm.load, flowvm.read_header)
    assert (STATE.save, STATE.load) == (flowvm.save_state, flowvm.load_state)


def test_each_format_knows_its_files_by_their_first_bytes(tmp_path):
    drv = _program().start()
    pickle_start = flowvm.save(drv, tmp_path / "a.ckpt").read_bytes()[:MAGIC_BYTES]
    state_start = flowvm.save_state(drv, tmp_path / "a.safetensors").read_bytes()[:MAGIC_BYTES]
    assert PICKLE.starts_like(pickle_start) and not PICKLE.starts_like(state_start)
    assert STATE.starts_like(state_start) and not STATE.starts_like(pickle_start)
    assert PICKLE.starts_like(MAGIC[:3])  # a file cut short is still one of its own (damaged: replaceable)
    assert not STATE.starts_like(b"precious\n") and not PICKLE.starts_like(b"precious\n")


def test_a_run_a_format_cannot_hold_is_refused_by_its_check(tmp_path):
    reg = Registers(f=print, n=0)
    drv = REPEAT(2, CALL(abs, reg("n"), store_to=reg("n"))).start()
    drv.registers.update(reg)
    PICKLE.check(drv, tmp_path / "x.ckpt")
    with pytest.raises(flowvm.CheckpointError, match="registers/f holds a function"):
        STATE.check(drv, tmp_path / "x.safetensors")


@pytest.mark.parametrize("suffix", [".ckpt", ".safetensors"])
def test_a_location_is_asked_what_is_in_the_way_of_a_save(tmp_path, suffix):
    # the command asks the place's format what of a file already there must not be replaced silently
    loc = Location.of(tmp_path / f"run{suffix}")
    fmt = format_of(loc)
    assert fmt.in_the_way(loc) is None  # nothing there
    reg = Registers(i=0)
    drv = REPEAT(3, CALL(int, reg("i"), store_to=reg("i"))).start()
    drv.run(max_steps=1)
    fmt.save(drv, loc)
    what, text = fmt.in_the_way(loc)
    assert what == "unfinished" and text.startswith(f"{loc} holds an unfinished run (") and "step 1)" in text
    drv.run()
    fmt.save(drv, loc)
    assert fmt.in_the_way(loc) is None  # a finished run: nothing lost
    loc.path.write_bytes(b"some notes of mine, not a checkpoint\n")
    what, text = fmt.in_the_way(loc)
    assert what == "foreign" and text.startswith(f"{loc} exists and is not a flowvm ")
    loc.path.write_bytes(b"")
    assert fmt.in_the_way(Location.of(tmp_path / "no-such" / f"x{suffix}")) is None


def test_a_location_says_before_a_save_whether_one_can_go_there(tmp_path):
    with pytest.raises(flowvm.CheckpointError, match="is a directory; give a file name"):
        storage.check_target(Location.of(tmp_path))
    with pytest.raises(flowvm.CheckpointError, match="no directory"):
        storage.check_target(Location.of(tmp_path / "missing" / "run.ckpt"))
    storage.check_target(Location.of(tmp_path / "run.ckpt"))
    assert storage.read_start(Location.of(tmp_path / "run.ckpt"), 4, missing_ok=True) is None
