"""Files from anyone: every crafted state file and pickle checkpoint header is a CheckpointError naming the
field, with bounded memory, bounded settings and nothing run; saves fail as one CheckpointError, keeping the
previous file; one run per checkpoint."""

from __future__ import annotations

import json
import os
import stat
import warnings

import numpy as np
import pytest
import torch

import flowvm
from flowvm import CheckpointError
from flowvm.base.environment import cores
from flowvm.base.errors import SettingsWarning
from flowvm.persist import state

import crafted
from bounded import bounded


@pytest.fixture
def good(tmp_path):
    return crafted.saved_state(tmp_path / "good.safetensors")


def _load(path, builder=crafted.build):
    return flowvm.load_state(path, builder())


# ------------------------------------------------------------------ 1. settings
def test_a_thread_count_from_a_file_is_capped_at_the_machines_cores(tmp_path, good):
    def threads(env):
        env["settings"]["torch.threads"] = 1_000_000

    path = crafted.edit_state(good, tmp_path / "threads.safetensors", "environment", threads)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _load(path).step()
        assert torch.get_num_threads() <= cores()
        assert any("capped at this machine's" in str(w.message) for w in seen)
    finally:
        torch.set_num_threads(before)


def test_a_setting_that_differs_is_reported_before_it_is_applied(tmp_path, good):
    before = torch.get_num_threads()
    other = 1 if before != 1 else min(2, cores())
    if other == before:
        pytest.skip("one core: no other thread count to set")

    def threads(env):
        env["settings"]["torch.threads"] = other

    path = crafted.edit_state(good, tmp_path / "threads.safetensors", "environment", threads)
    drv = _load(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SettingsWarning)  # a user who stops at the report
        with pytest.raises(SettingsWarning, match="torch.threads"):
            drv.step()
    assert torch.get_num_threads() == before


# ------------------------------------------------------------------ 2. memory
def test_a_listing_row_with_a_huge_depth_is_refused_within_a_memory_limit(tmp_path, good):
    def deep(program):
        program["listing"][0][1] = 10 ** 9

    path = crafted.edit_state(good, tmp_path / "deep.safetensors", "program", deep)
    got = bounded(lambda: state.show_state(path), extra_mb=256)
    assert got[:2] == ("raised", "CheckpointError") and "listing" in got[2], got


def test_a_sparse_file_is_shown_without_reading_and_loaded_with_one_copy(tmp_path):
    source = crafted.saved_state(tmp_path / "a.safetensors", builder=crafted.build_array)
    nbytes = 256 << 20
    path = crafted.sparse_state(source, tmp_path / "sparse.safetensors", "x", nbytes)
    assert os.stat(path).st_blocks * 512 < 1 << 20  # nothing on disk
    shown = bounded(lambda: str(state.show_state(path)[2]["x"].shape), extra_mb=128)
    assert shown == ("ok", str((nbytes // 8,))), shown
    loaded = bounded(lambda: flowvm.load_state(path, crafted.build_array()).registers["x"].nbytes,
                     extra_mb=(nbytes >> 20) + 160)
    assert loaded == ("ok", nbytes), loaded


# ------------------------------------------------------------------ 4. one error type, naming the field
def _generator_program():
    reg = flowvm.Registers(g=torch.Generator(), total=0.0)
    return flowvm.REPEAT(3, flowvm.CALL(crafted.grow, reg("total"), store_to=reg("total")))


def _set_register(name, node):
    def edit(registers):
        for pair in registers:
            if pair[0] == name:
                pair[1] = node(pair[1])
    return edit


@pytest.mark.parametrize("part, edit, builder, field", [
    ("format", lambda f: "\u00b2", crafted.build, "unknown format"),
    ("registers", _set_register("g", lambda n: dict(n, device="evil")), _generator_program, "registers/g"),
    ("registers", _set_register("g", lambda n: dict(n, device="cuda:7")), _generator_program, "registers/g"),
    ("registers", _set_register("total", lambda n: {"torch_device": "evil"}), crafted.build, "registers/total"),
    ("registers", _set_register("x", lambda n: dict(n, device="meta")), crafted.build, "registers/x"),
], ids=["format-superscript", "generator-evil", "generator-cuda7", "device-evil", "meta-tensor"])
def test_malformed_fields_are_checkpoint_errors_naming_them(tmp_path, part, edit, builder, field):
    source = crafted.saved_state(tmp_path / "source.safetensors", builder=builder)
    if builder is crafted.build and part == "registers" and "x" in field:
        source = _with_torch_x(tmp_path)
    path = crafted.edit_state(source, tmp_path / "bad.safetensors", part, edit)
    with pytest.raises(CheckpointError, match=field):
        flowvm.load_state(path, builder())
    try:  # show makes no generator and moves no tensor: it may show what load refuses, never fail otherwise
        state.show_state(path)
    except CheckpointError:
        pass


def _with_torch_x(tmp_path):
    drv = crafted.build().start()
    drv.run(max_steps=2)
    drv.registers["x"] = torch.zeros(4)
    flowvm.save_state(drv, tmp_path / "torch.safetensors")
    return tmp_path / "torch.safetensors"


@pytest.mark.parametrize("part, edit, field", [
    ("header", lambda h: dict(h, meta=["a list"]), "'meta'"),
    ("header", lambda h: dict(h, steps="many"), "'steps'"),
    ("header", lambda h: dict(h, meta=dict(h["meta"], sets=[1, 2])), "'meta.sets'"),
    ("program", lambda p: dict(p, listing=[["0", 0]]), "listing"),
    ("program", lambda p: dict(p, listing=[[None, -1, "x"]]), "listing"),
    ("run", lambda r: dict(r, marks=[["0", 7, "c"]]), "marks"),
    ("run", lambda r: dict(r, marks={"a": 1}), "marks"),
], ids=["meta-list", "steps-text", "sets-ints", "listing-short", "listing-negative", "marks-int", "marks-dict"])
def test_malformed_header_listing_and_marks_are_checkpoint_errors_in_show(tmp_path, good, part, edit, field):
    path = crafted.edit_state(good, tmp_path / "bad.safetensors", part, edit)
    with pytest.raises(CheckpointError, match=field):
        state.show_state(path)


def test_a_stray_temporary_named_with_a_superscript_does_not_block_saves(tmp_path):
    path = crafted.saved_checkpoint(tmp_path / "run.ckpt")
    (tmp_path / ".run.ckpt.\u00b2-x.tmp").write_bytes(b"stray")
    drv = crafted.build().start()
    drv.run(max_steps=4)
    flowvm.save(drv, path)
    assert flowvm.load(path).steps == 4


# ------------------------------------------------------------------ 5. failed saves: one behaviour
@pytest.mark.parametrize("save", [flowvm.save, flowvm.save_state], ids=["pickle", "state"])
def test_a_refused_rename_is_a_checkpoint_error_for_both_formats(tmp_path, monkeypatch, save):
    path = tmp_path / ("run.ckpt" if save is flowvm.save else "run.safetensors")
    drv = crafted.build().start()
    drv.run(max_steps=2)
    save(drv, path)
    before = path.read_bytes()

    def immutable(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "replace", immutable)
    drv.run(max_steps=2)
    with pytest.raises(CheckpointError, match="Operation not permitted; the file there is as it was"):
        save(drv, path)
    monkeypatch.undo()
    assert path.read_bytes() == before


# ------------------------------------------------------------------ 6. one run per checkpoint
def test_a_held_lock_names_its_owner_and_a_dead_owners_lock_is_taken_over(tmp_path):
    from flowvm.persist.lock import holding, lock_name

    path = tmp_path / "run.ckpt"
    with holding(path):
        owner = json.loads(lock_name(path).read_text())
        assert owner["pid"] == os.getpid()
        with pytest.raises(CheckpointError, match=f"in use: process {os.getpid()} on "):
            with holding(path):
                pass
    assert not lock_name(path).exists()
    lock_name(path).write_text(json.dumps({"pid": 2 ** 22 + 7, "host": "gone"}))  # left by a killed run
    with holding(path):
        assert json.loads(lock_name(path).read_text())["pid"] == os.getpid()


def test_a_url_lock_is_an_exclusive_object(tmp_path):
    from flowvm.persist.lock import holding

    url = f"memory://locks/{tmp_path.name}/run.ckpt"
    with holding(url):
        with pytest.raises(CheckpointError, match="in use: process"):
            with holding(url):
                pass
    with holding(url):  # released
        pass


# ------------------------------------------------------------------ 8. permissions
@pytest.mark.parametrize("save", [flowvm.save, flowvm.save_state], ids=["pickle", "state"])
def test_a_new_file_gets_the_permissions_the_umask_gives(tmp_path, save):
    path = tmp_path / ("run.ckpt" if save is flowvm.save else "run.safetensors")
    drv = crafted.build().start()
    old = os.umask(0o022)
    try:
        save(drv, path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    os.chmod(path, 0o600)
    save(drv, path)  # a replaced file keeps its own
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


# ------------------------------------------------------------------ 10. impossible run states
def _frame(kind, change):
    def edit(run):
        for fr in run["stack"]:
            if fr["kind"] == kind:
                new = change(fr["slots"])
                fr["slots"] = fr["slots"] if new is None else new
                return
        raise AssertionError(f"no {kind} frame")
    return edit


@pytest.mark.parametrize("edit, field", [
    (_frame("REPEAT", lambda s: s.__setitem__("i", -5)), "its counter is -5"),
    (_frame("REPEAT", lambda s: s.__setitem__("i", "x")), "its counter is 'x'"),
    (_frame("REPEAT", lambda s: s.__delitem__("last")), "slot 'last' is missing"),
    (_frame("REPEAT", lambda s: s.__setitem__("speed", 1)), "unknown slot 'speed'"),
    (_frame("REPEAT", lambda s: s.__setitem__("failed", 3)), "slots, its layout 3"),
    (_frame("REPEAT", lambda s: s.clear() or s.update({"0": 1})), "unknown slot '0'"),
    (_frame("SEQ", lambda s: s.__setitem__("pos", 7)), "its position is 7"),
    (_frame("SEQ", lambda s: [7]), "its position is 7"),  # slots by number, as formats 1 and 2
    (lambda run: run.__setitem__("steps", 10 ** 30), "the step count"),
    (lambda run: run.__setitem__("fresh", 99), "fresh is 99"),
], ids=["counter-negative", "counter-text", "missing-slot", "unknown-slot", "marker-not-true", "by-number",
        "position", "list-position", "steps-huge", "fresh"])
def test_impossible_run_states_are_refused(tmp_path, good, edit, field):
    path = crafted.edit_state(good, tmp_path / "bad.safetensors", "run", edit)
    with pytest.raises(CheckpointError, match=field):
        _load(path)


def _attribute(name, value):
    def edit(objects):
        for loc, node in objects:
            if isinstance(node, dict) and node.get("type") == "Walker":
                node["attributes"].append([name, value])
                return
        raise AssertionError("no Walker")
    return edit


def _replace_attribute(name, value):
    def edit(objects):
        for loc, node in objects:
            if isinstance(node, dict) and node.get("type") == "Walker":
                for pair in node["attributes"]:
                    if pair[0] == name:
                        pair[1] = value
                return
    return edit


@pytest.mark.parametrize("edit, field", [
    (_attribute("step", 1), "whose class defines it"),
    (_attribute("__class__", 1), "malformed attribute"),
    (_replace_attribute("rng", {"global_generator": "numpy"}), "holds a numpy.random._generator.Generator"),
    (_replace_attribute("position", [1.0, 2.0, 3.0]), "puts a list where"),
], ids=["shadow-method", "dunder", "global-generator", "array-to-list"])
def test_an_object_gets_only_attributes_of_the_kinds_it_has(tmp_path, good, edit, field):
    path = crafted.edit_state(good, tmp_path / "bad.safetensors", "objects", edit)
    with pytest.raises(CheckpointError, match=field):
        _load(path)


def test_the_untouched_file_loads(good):
    drv = _load(good)
    drv.run()
    assert drv.done and isinstance(drv.registers["trace"], list) and np.isfinite(drv.registers["total"])
