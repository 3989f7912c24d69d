"""A half-run program copied by any means resumes exactly in another process: the copy carries the global
random states and the settings that change results, sets them at its first step, and loads where the
libraries it does not use are missing."""

from __future__ import annotations

import copy
import os
import pickle
import random
import subprocess
import sys
import warnings

import cloudpickle
import numpy as np
import pytest
import torch

import flowvm
import resume_programs as rp
from flowvm import CALL, REPEAT, CheckpointError, Registers
from flowvm.persist import checkpoint as ckpt
from flowvm import SettingsWarning
from flowvm.base.environment import capture_random
from flowvm.testing import COPIERS, assert_same_run, diff, outcome
import toy

HERE = os.path.dirname(os.path.abspath(__file__))


def in_fresh_process(how: str, source, tmp_path, *options) -> dict:
    out = tmp_path / "child-out.pkl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, str(toy.TESTS), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(toy.TESTS / "resume_child.py"), how, str(source), str(out), *options],
                   check=True, timeout=120, env=env, cwd=str(tmp_path))
    return pickle.loads(out.read_bytes())


def finished(build) -> dict:
    drv = build().start()
    drv.run()
    return outcome(drv)


# ------------------------------------------------------------ global generators
def test_a_plain_pickle_resumes_in_a_fresh_process_drawing_from_numpy_and_random(tmp_path):
    expected = finished(rp.numpy_walk)
    drv = rp.numpy_walk().start()
    drv.run(max_steps=333)
    (tmp_path / "half.pkl").write_bytes(pickle.dumps(drv))
    got = in_fresh_process("pickle", tmp_path / "half.pkl", tmp_path)
    assert "error" not in got, got.get("error")
    assert diff(expected, got["outcome"]) == []


@pytest.mark.parametrize("how", sorted(COPIERS))
def test_every_copy_carries_the_global_states_and_the_original_never_touches_them(how):
    expected = finished(rp.numpy_walk)
    original = rp.numpy_walk().start()
    original.run(max_steps=333)
    at_copy = capture_random()
    clone = COPIERS[how](original)
    assert capture_random() == at_copy  # making the copy changed nothing
    np.random.seed(7)
    random.seed(7)
    moved = capture_random()
    clone.run(max_steps=0)
    assert capture_random() == moved  # nor does a copy that takes no step
    clone.run()
    assert diff(expected, outcome(clone)) == []
    # the original goes on from whatever the process's generators hold: here, not the run's states
    original.run()
    assert diff(expected, outcome(original)) != []


def test_a_copy_of_a_copy_that_has_not_stepped_stands_for_the_same_moment():
    expected = finished(rp.numpy_walk)
    drv = rp.numpy_walk().start()
    drv.run(max_steps=100)
    first = pickle.loads(pickle.dumps(drv))
    np.random.seed(3)
    second = copy.deepcopy(first)  # made later, when the generators had moved on
    np.random.seed(4)
    second.run()
    assert diff(expected, outcome(second)) == []


def test_resume_with_random_false_keeps_the_process_generators():
    drv = rp.numpy_walk().start()
    drv.run(max_steps=10)
    clone = pickle.loads(pickle.dumps(drv)).resume_with(random=False)
    np.random.seed(11)
    random.seed(11)
    clone.step()  # draws from the process's generators as they were
    np.random.seed(11)
    random.seed(11)
    assert clone.registers["history"][-1] == rp.step_walk(0, [])
    assert clone.saved_environment is None


def test_assert_same_run_catches_a_copy_that_does_not_carry_the_global_states(monkeypatch):
    assert_same_run(lambda: rp.numpy_walk(60), cuts=[20], copiers=["pickle"])
    forget = lambda self: {"random": None, "settings": {}, "announce": False}  # noqa: E731
    monkeypatch.setattr(flowvm.Driver, "_resume_for_copy", forget)
    with pytest.raises(AssertionError, match="the copy resumed after 20 steps via pickle differs"):
        assert_same_run(lambda: rp.numpy_walk(60), cuts=[20], copiers=["pickle"])


def test_torch_generator_travels_too():
    def build():
        torch.manual_seed(0)
        reg = Registers()
        return REPEAT(5, CALL(torch.rand, 3, store_to=reg("x")))

    assert_same_run(build)


# ----------------------------------------------------------------------- settings
def test_a_resumed_copy_applies_the_thread_count_it_was_saved_with(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = finished(rp.digits_mlp)
        drv = rp.digits_mlp().start()
        drv.run(max_steps=40)
        flowvm.save(drv, tmp_path / "digits.ckpt")
        (tmp_path / "digits.pkl").write_bytes(pickle.dumps(drv))
        # what 2 threads from step 40 on give here: the original goes on in this process, with 2 threads
        torch.set_num_threads(2)
        drv.run()
        switched = outcome(drv)
        # whether this machine's kernels compute other last digits with 2 threads (MKL splits a matmul over
        # threads, or not, by the kernel it picks for the CPU): an uninterrupted run at each count
        threads_matter = diff(expected, finished(rp.digits_mlp)) != []
    finally:
        torch.set_num_threads(before)
    for how, source in (("checkpoint", "digits.ckpt"), ("pickle", "digits.pkl")):
        got = in_fresh_process(how, tmp_path / source, tmp_path, "--threads", "2")
        assert "error" not in got, got.get("error")
        assert diff(expected, got["outcome"]) == [], how
        assert got["threads"] == 1
        assert any("SettingsWarning" in w and "torch.threads=1" in w and "had 2" in w for w in got["warnings"])
    # keeping the process's settings: the run goes on with 2 threads, as the original did here, which changes
    # the last digits where this machine's kernels differ between 1 and 2 threads
    kept = in_fresh_process("checkpoint", tmp_path / "digits.ckpt", tmp_path, "--threads", "2", "--keep-settings")
    assert kept["threads"] == 2 and not any("SettingsWarning" in w for w in kept["warnings"])
    assert diff(switched, kept["outcome"]) == []
    assert (diff(expected, kept["outcome"]) != []) == threads_matter


def test_settings_are_recorded_as_plain_data_and_applied_at_the_first_step():
    before = (torch.get_num_threads(), torch.get_float32_matmul_precision())
    try:
        torch.set_num_threads(1)
        torch.set_float32_matmul_precision("high")
        drv = rp.numpy_walk(5).start()
        clone = pickle.loads(pickle.dumps(drv))
        saved = clone.saved_environment["settings"]
        assert saved["torch.threads"] == 1 and saved["torch.float32_matmul_precision"] == "high"
        assert saved["torch.default_dtype"] == "float32" and saved["torch.deterministic"] is False
        torch.set_num_threads(2)
        torch.set_float32_matmul_precision("highest")
        with pytest.warns(SettingsWarning, match="torch.threads=1 .this process had 2.*"):
            clone.step()
        assert torch.get_num_threads() == 1 and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_num_threads(before[0])
        torch.set_float32_matmul_precision(before[1])


def test_resume_with_chosen_settings_overrides_the_saved_ones():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        clone = pickle.loads(pickle.dumps(rp.numpy_walk(5).start()))
        torch.set_num_threads(2)
        clone.resume_with(settings={"torch.threads": 2})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            clone.step()
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="unknown setting 'torch.thread'"):
            clone.resume_with(settings={"torch.thread": 2})
    finally:
        torch.set_num_threads(before)


def test_a_bundled_program_declares_its_thread_count_from_python_too():
    from flowvm.programs import mlp

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        prog = mlp.build(samples=200, epochs=1)
        assert prog.process_settings == {"torch.threads": mlp.THREADS}
        drv = prog.start()
        assert torch.get_num_threads() == 2  # start() runs nothing
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the program asked for it: no warning
            drv.step()
        assert torch.get_num_threads() == mlp.THREADS == 1
    finally:
        torch.set_num_threads(before)


def test_process_settings_survive_edits_and_printing_as_source():
    from flowvm import PRINT, from_source, to_source

    reg = Registers(x=0)
    prog = REPEAT(2, CALL(abs, reg("x"), store_to=reg("x"))).with_process_settings({"torch.threads": 1})
    edited = prog.find(abs).insert_after(PRINT("hi"))
    assert edited.process_settings == {"torch.threads": 1}
    assert "with_process_settings({'torch.threads': 1})" in to_source(prog)
    assert from_source(to_source(prog)).process_settings == {"torch.threads": 1}
    with pytest.raises(ValueError, match="torch.threads' must be a positive int"):
        prog.with_process_settings({"torch.threads": 0})


# ------------------------------------------------- what a checkpoint needs to load
def test_a_numpy_only_checkpoint_written_beside_torch_loads_where_torch_is_missing(tmp_path):
    assert "torch" in sys.modules  # this process has torch: its generator state is in the file
    expected = finished(rp.numpy_walk)
    drv = rp.numpy_walk().start()
    drv.run(max_steps=500)
    flowvm.save(drv, tmp_path / "walk.ckpt")
    (tmp_path / "walk.pkl").write_bytes(pickle.dumps(drv))
    for how, source in (("checkpoint", "walk.ckpt"), ("pickle", "walk.pkl")):
        got = in_fresh_process(how, tmp_path / source, tmp_path, "--block-torch")
        assert "error" not in got, got.get("error")
        assert not got["torch_imported"]
        assert diff(expected, got["outcome"]) == []


def test_a_torch_checkpoint_where_torch_is_missing_names_the_module(tmp_path):
    drv = rp.digits_mlp(5).start()
    drv.run(max_steps=2)
    flowvm.save(drv, tmp_path / "digits.ckpt")
    got = in_fresh_process("checkpoint", tmp_path / "digits.ckpt", tmp_path, "--block-torch")
    assert got["error"].startswith("CheckpointError") and "needs the module 'torch'" in got["error"]


def _save_with_state(tmp_path, name, mutate):
    drv = rp.numpy_walk(20).start()
    drv.run(max_steps=5)
    state = {"random": capture_random(), "settings": {}, "announce": True}
    mutate(state["random"])
    drv._resume = state  # as a malformed file would hold it
    path = tmp_path / name
    flowvm.save(drv, path)
    return path


@pytest.mark.parametrize("what, mutate, generator", [
    ("random-string", lambda s: s.__setitem__("random", "not a state"), "'random'"),
    ("numpy-short", lambda s: s["numpy"].__setitem__(1, s["numpy"][1][:100]), "numpy"),
    ("numpy-name", lambda s: s["numpy"].__setitem__(0, "PCG64"), "numpy"),
    ("torch-bytes", lambda s: s.__setitem__("torch", b"\x00" * 7), "torch"),
    ("torch-type", lambda s: s.__setitem__("torch", [1, 2, 3]), "torch"),
])
def test_a_malformed_random_state_is_a_checkpoint_error_that_changes_nothing(tmp_path, what, mutate, generator):
    path = _save_with_state(tmp_path, f"{what}.ckpt", mutate)
    np.random.seed(5)
    random.seed(5)
    torch.manual_seed(5)
    before = capture_random()
    with pytest.raises(CheckpointError, match=f"malformed state of .*{generator}") as ei:
        flowvm.load(path)
    assert str(path) in str(ei.value)
    assert capture_random() == before


def test_a_signed_checkpoint_is_refused_without_its_key(tmp_path):
    drv = rp.numpy_walk(20).start()
    drv.run(max_steps=5)
    flowvm.save(drv, tmp_path / "s.ckpt", key="k")
    with pytest.raises(CheckpointError, match="signed; give its key"):
        flowvm.load(tmp_path / "s.ckpt")
    with pytest.raises(CheckpointError, match="signed; give its key"):
        ckpt.loads((tmp_path / "s.ckpt").read_bytes())
    assert flowvm.load(tmp_path / "s.ckpt", key="k").steps == 5
    assert flowvm.load(tmp_path / "s.ckpt", verify=False).steps == 5


def test_a_cloudpickled_copy_carries_them_too():
    expected = finished(lambda: rp.numpy_walk(50))
    drv = rp.numpy_walk(50).start()
    drv.run(max_steps=20)
    clone = pickle.loads(cloudpickle.dumps(drv))
    np.random.seed(123)
    clone.run()
    assert diff(expected, outcome(clone)) == []
