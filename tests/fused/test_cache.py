"""The persistent cache of packages compiled in child processes (flowvm/fused/cache.py): a second run of a
program starts with its steps compiled, keys tell apart what compiles differently, bad entries are evicted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.fused import cache, choosing, compiler, jobs, outofprocess, threadcompile
from flowvm.passes.fuse_torch import fuse_torch


def python_env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **extra)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    where = tmp_path / "compiled"
    monkeypatch.setenv("FLOWVM_CACHE_DIR", str(where))
    return where


def test_where_the_cache_is_and_how_to_turn_it_off(monkeypatch, tmp_path):
    monkeypatch.delenv("FLOWVM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.root() == os.path.join(str(tmp_path), "flowvm", "compiled")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.root() == os.path.join(os.path.expanduser("~"), ".cache", "flowvm", "compiled")
    for off in ("off", "", "0"):
        monkeypatch.setenv("FLOWVM_CACHE_DIR", off)
        assert cache.root() is None
    monkeypatch.setenv("FLOWVM_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.root() == str(tmp_path / "mine")


def _entry(tmp_path, name: str, size: int) -> str:
    work = tmp_path / f"work-{name}"
    work.mkdir()
    (work / "step.pt2").write_bytes(b"x" * size)
    return str(work)


def test_entries_are_stored_whole_and_the_least_recently_used_go_first(cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWVM_CACHE_MAX_BYTES", "2500")
    for k, name in enumerate("abc"):
        assert cache.store(name * 40, _entry(tmp_path, name, 1000), ["step.pt2"]) is not None
        then = time.time() - 100 + k
        os.utime(cache_dir / (name * 40), (then, then))
        if name == "b":
            assert cache.lookup("a" * 40) is not None  # "a" used after "b" was stored: "b" is the oldest now
    assert sorted(os.listdir(cache_dir)) == ["a" * 40, "c" * 40]  # 3000 bytes: the least recently used went
    assert (cache_dir / ("a" * 40) / "step.pt2").read_bytes() == b"x" * 1000
    # a second writer of the same key keeps the first entry whole
    assert cache.store("a" * 40, _entry(tmp_path, "d", 10), ["step.pt2"]) is not None
    assert (cache_dir / ("a" * 40) / "step.pt2").stat().st_size == 1000
    assert not [n for n in os.listdir(cache_dir) if n.startswith(cache.TEMP_PREFIX)]
    cache.evict("a" * 40)
    assert cache.lookup("a" * 40) is None and os.listdir(cache_dir) == ["c" * 40]


def _put(tmp_path, key: str, files: dict[str, bytes]) -> None:
    """An entry of the cache as a compile stores it: its files, and the manifest of their digests."""
    work = tmp_path / f"work-{key}"
    work.mkdir()
    for name, data in files.items():
        (work / name).write_bytes(data)
    assert cache.store(key, str(work), sorted(files)) is not None


def _job(calls, x, **settings):
    fast = fuse_torch(REPEAT(2, SEQ(calls)), **settings)
    rt = fast.body.runtime()
    return jobs.describe(rt.el, rt.generated, rt.settings.options, (x,))


def test_the_key_differs_when_a_constant_a_layout_or_a_setting_differs(cache_dir, monkeypatch):
    x = torch.ones(4, 3)
    reg = Registers(x=x)

    def calls(shift=1, extra=()):
        return [CALL(torch.roll, reg("x"), [shift], 0, store_to=reg("h")), CALL(torch.sin, reg("h"), *extra,
                                                                                 store_to=reg("h"))]

    key = _job(calls(), x).key
    assert key is not None and _job(calls(), x).key == key  # the same step: the same key
    assert _job(calls(shift=3), x).key != key                # a constant
    assert _job(calls(), x.t().contiguous().t()).key != key  # a layout (strides)
    assert _job(calls(), torch.ones(4, 3, dtype=torch.float64)).key != key
    assert _job(calls(), x, options={"fallback_random": True, "max_autotune": True}).key != key  # compiler options
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert _job(calls(), x).key != key                   # a torch setting
    finally:
        torch.set_default_dtype(before)
    monkeypatch.setenv("FLOWVM_CACHE_DIR", "off")
    assert _job(calls(), x).key is None                      # no cache, no key


KEYS = textwrap.dedent("""
    import json, torch
    from flowvm import CALL, REPEAT, SEQ, Registers
    from flowvm.fused import jobs
    from flowvm.passes.fuse_torch import fuse_torch
    F = torch.nn.functional
    reg = Registers(x=torch.ones(8, 4), y=torch.zeros(8, dtype=torch.long))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                              torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    plain = SEQ([CALL(torch.roll, reg("x"), [1], 0, store_to=reg("h")), CALL(torch.sin, reg("h"), store_to=reg("h"))])
    train = SEQ([CALL(opt.zero_grad), CALL(net, reg("x"), store_to=reg("l")),
                 CALL(F.cross_entropy, reg("l"), reg("y"), store_to=reg("loss")),
                 CALL(torch.Tensor.backward, reg("loss")), CALL(opt.step)])
    keys = []
    for body in (plain, train):
        fast = fuse_torch(REPEAT(2, body))
        el = next(e for e in [fast.body] + list(fast.body.children) if hasattr(e, "runtime"))
        rt = el.runtime()
        job = jobs.describe(rt.el, rt.generated, rt.settings.options, tuple(reg[r.name] for r in rt.el.inputs))
        keys.append(job.key)
    print(json.dumps(keys))
""")


def test_the_key_is_the_same_in_every_process(cache_dir):
    got = [subprocess.run([sys.executable, "-c", KEYS], capture_output=True, text=True, env=python_env(),
                          timeout=120) for _ in range(2)]
    assert all(g.returncode == 0 for g in got), got[0].stderr[-2000:]
    first, second = (json.loads(g.stdout.strip().splitlines()[-1]) for g in got)
    assert first == second and None not in first and first[0] != first[1]


def _chain(n=30):
    reg = Registers(x=torch.linspace(-2, 2, 64))
    ops = [torch.sin, torch.exp, torch.tanh, torch.sigmoid]
    body = SEQ([CALL(op, reg("x" if i == 0 else "h"), store_to=reg("h")) for i, op in enumerate(ops)])
    return REPEAT(n, body), reg


@pytest.mark.parametrize("damaged", [outofprocess.PACKAGE, outofprocess.LIBRARY])
def test_an_entry_that_does_not_load_is_ignored_and_evicted(cache_dir, tmp_path, monkeypatch, damaged):
    prog, reg = _chain()
    fast = fuse_torch(prog)  # the defaults: nothing would compile in 30 executions
    rt = fast.body.runtime()
    key = jobs.describe(rt.el, rt.generated, rt.settings.options, (reg["x"],)).key
    _put(tmp_path, key, {damaged: b"not a package"})  # its digest right: it fails to load
    cache.add_hint(jobs.hint(rt.generated, rt.settings.options, (reg["x"],)))  # as a compile that stored it does
    fast.run()
    assert not rt.cached and rt.hits == 0 and not (cache_dir / key).exists()
    assert torch.equal(reg["h"], torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"])))))


def test_an_entry_whose_first_result_differs_from_eager_is_evicted(cache_dir, tmp_path, monkeypatch):
    prog, reg = _chain()
    fast = fuse_torch(prog)
    rt = fast.body.runtime()
    key = jobs.describe(rt.el, rt.generated, rt.settings.options, (reg["x"],)).key
    _put(tmp_path, key, {outofprocess.PACKAGE: b"a package"})
    cache.add_hint(jobs.hint(rt.generated, rt.settings.options, (reg["x"],)))  # as a compile that stored it does
    head = rt.generated.head
    monkeypatch.setattr(outofprocess, "load_plain", lambda path: lambda inputs: [o + 1 for o in head(*inputs)])
    monkeypatch.setattr(threadcompile, "compiler_ready", lambda names: False)  # the thread's compile: not here
    fast.run()
    assert rt.cached and rt.refused.startswith("its first result differs from eager's")
    assert not (cache_dir / key).exists()
    assert torch.equal(reg["h"], torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"])))))


RUN = textwrap.dedent("""
    import json, sys, time, torch
    from flowvm import CALL, LOOP, REPEAT, SEQ, Registers
    from flowvm.fused import outofprocess
    from flowvm.passes.fuse_torch import fuse_torch
    reg = Registers(x=torch.linspace(-2, 2, 64))
    ops = [torch.sin, torch.exp, torch.tanh, torch.sigmoid]
    body = SEQ([CALL(op, reg("x" if i == 0 else "h"), store_to=reg("h")) for i, op in enumerate(ops)])
    expected = torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"]))))
    if sys.argv[1] == "first":  # compiles at once, in a child process
        drv = fuse_torch(LOOP(body), compile_after=0, payback=0).start()
        rt = drv.program.body.runtime()
        deadline = time.time() + 300
        while rt.hits == 0 and rt.refused is None and time.time() < deadline:
            drv.run(max_steps=5)
            time.sleep(0.05)
    else:  # the defaults: 5,000 executions would never compile; no child process may start
        def no_child(*args, **kwargs):
            raise AssertionError("a child process started")
        outofprocess.Compile = no_child
        fast = fuse_torch(REPEAT(5000, body))
        rt = fast.body.runtime()
        drv = fast.start()
        drv.run(max_steps=3)
        after_three = rt.hits
        drv.run()
    print(json.dumps({"hits": rt.hits, "refused": rt.refused, "cached": rt.cached, "state": rt.state,
                      "close": bool(torch.allclose(reg["h"], expected, rtol=1e-5, atol=1e-6)),
                      "early": after_three if sys.argv[1] != "first" else None, "header": fast.body.header_text()
                      if sys.argv[1] != "first" else ""}))
""")


def test_a_second_run_of_a_program_starts_with_its_step_compiled_from_the_cache(cache_dir):
    runs = []
    for which in ("first", "second"):
        out = subprocess.run([sys.executable, "-c", RUN, which], capture_output=True, text=True, timeout=400,
                             env=python_env(FLOWVM_CACHE_DIR=str(cache_dir)))
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["hits"] > 0 and first["refused"] is None and not first["cached"]
    entries = [n for n in os.listdir(cache_dir) if n != cache.HINTS]
    assert len(entries) == 1  # the package, stored: its library alone (a CPU step holds no weights)
    assert sorted(os.listdir(cache_dir / entries[0])) == sorted([outofprocess.LIBRARY, cache.DECISION, cache.MANIFEST])
    assert len(os.listdir(cache_dir / cache.HINTS)) == 1  # and its hint
    assert second["cached"] and second["refused"] is None and second["close"]
    assert second["early"] >= 1 and second["hits"] > 100  # compiled from its first executions (verified, timed)
    assert "measured compiled" in second["header"]


def test_a_step_the_cache_never_stored_is_not_pickled_for_a_lookup(cache_dir, monkeypatch):
    """The first execution of a step looks it up by a cheap hint first: no hint, no pickling of the step."""
    prog, reg = _chain()
    fast = fuse_torch(prog)
    rt = fast.body.runtime()
    described = []
    real = jobs.describe
    monkeypatch.setattr(jobs, "describe", lambda *a: described.append(1) or real(*a))
    fast.run()
    assert described == [] and not rt.cached
    cache.add_hint(jobs.hint(rt.generated, rt.settings.options, (reg["x"],)))
    prog, reg = _chain()
    again = fuse_torch(prog)
    again.run()
    assert described == [1]  # a hint the cache saw: the step is pickled for its key (not there: a miss)


def _stored(cache_dir, monkeypatch, prog, reg, decision=None):
    """The chain's entry in the cache as a run that compiled it leaves it (its package: the head itself),
    with what that run measured, if it did."""
    fast = fuse_torch(prog)
    rt = fast.body.runtime()
    key = jobs.describe(rt.el, rt.generated, rt.settings.options, (reg["x"],)).key
    _put(cache_dir.parent, key, {outofprocess.PACKAGE: b"a package"})
    cache.add_hint(jobs.hint(rt.generated, rt.settings.options, (reg["x"],)))
    head = rt.generated.head
    monkeypatch.setattr(outofprocess, "load_plain", lambda path: lambda inputs: list(head(*inputs)))
    monkeypatch.setattr(threadcompile, "compiler_ready", lambda names: False)  # the thread's compile: not here
    if decision is not None:
        cache.note(key, decision)
    return fast, rt, cache_dir / key


@pytest.mark.parametrize("compiled", [True, False])
def test_a_warm_start_takes_the_form_an_earlier_run_measured_faster_from_the_first_execution(
        cache_dir, monkeypatch, compiled):
    prog, reg = _chain(40)
    measured = {"compiled": compiled, "compiled_s": 8e-6, "eager_s": 12e-6, "periods": 300}
    fast, rt, _ = _stored(cache_dir, monkeypatch, prog, reg, measured)
    checked = []
    monkeypatch.setattr(compiler, "mismatch", lambda *a: checked.append(1))
    fast.run()
    assert rt.cached and rt.periods == {"eager": [], "compiled": []}  # no trial
    assert checked == []  # nor a check of the first call against eager: the earlier run made it
    assert rt.state == ("compiled" if compiled else "eager") and rt.hits == (40 if compiled else 0)
    assert "measured compiled 8.0 µs vs eager 12.0 µs per execution (by an earlier run)" in fast.body.header_text()
    assert torch.equal(reg["h"], torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"])))))


@pytest.mark.parametrize("loads", [True, False])
def test_a_package_an_earlier_run_measured_slower_is_loaded_only_when_it_is_timed_again(
        cache_dir, monkeypatch, loads):
    """Loading a package costs milliseconds at a warm start: one that ran slower than eager waits until the
    decision is checked again; if it fails to load then, it leaves the cache and the step compiles anew."""
    prog, reg = _chain(400)
    fast, rt, entry = _stored(cache_dir, monkeypatch, prog, reg,
                              {"compiled": False, "compiled_s": 12e-6, "eager_s": 8e-6, "periods": 20})
    real, loaded = outofprocess.load_plain, []

    def load(path):
        loaded.append(rt.el.runtime().hits)
        if not loads:
            raise OSError("a damaged package")
        return real(path)

    monkeypatch.setattr(outofprocess, "load_plain", load)
    monkeypatch.setattr(choosing, "RECHECK_FACTOR", 0.1)  # checked again after 0.1 * 20 * 100 executions
    started = []
    monkeypatch.setattr(type(rt), "_start_compile", lambda self, args: started.append(1))
    steps = fast.start()
    steps.run(max_steps=199)
    assert loaded == [] and rt.state == "eager" and rt.cached
    steps.run()
    assert loaded == [0]  # at the 200th execution, for the trial
    assert entry.exists() is loads and (rt.hits > 0) is loads
    assert bool(started) is not loads  # a package that does not load is compiled again
    if not loads:  # and the step starts over: eager while it compiles, no decision of the package gone
        assert rt.state == "compiling" and not rt.cached and rt.periods == {"eager": [], "compiled": []}
        assert "by an earlier run" not in fast.body.header_text()
    assert torch.equal(reg["h"], torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"])))))


def test_a_package_that_fails_its_put_off_load_is_compiled_again_and_timed_afresh(cache_dir, monkeypatch):
    prog, reg = _chain(400)
    fast, rt, entry = _stored(cache_dir, monkeypatch, prog, reg,
                              {"compiled": False, "compiled_s": 12e-6, "eager_s": 8e-6, "periods": 20})
    head, loads, compiles = rt.generated.head, [], []

    def load(path):
        loads.append(path)
        if len(loads) == 1:
            raise OSError("a damaged package")
        return lambda inputs: list(head(*inputs))

    monkeypatch.setattr(outofprocess, "load_plain", load)
    monkeypatch.setattr(outofprocess, "Compile", lambda payload, load, done, key=None: compiles.append(done))
    monkeypatch.setattr(choosing, "RECHECK_FACTOR", 0.1)  # checked again at the 200th execution
    monkeypatch.setattr(choosing, "MIN_TRIAL_SECONDS", 0)
    checked = []
    real = compiler.mismatch
    monkeypatch.setattr(compiler, "mismatch", lambda *a: checked.append(1) or real(*a))
    steps = fast.start()
    steps.run(max_steps=201)
    assert len(loads) == 1 and not entry.exists() and rt.state == "compiling" and len(compiles) == 1
    compiles[0](load("the child's files"), None)  # the child compiled the step again
    steps.run(max_steps=60)
    assert checked == [1]  # its first call checked against eager, as a fresh compile's is
    assert rt.trials_done >= 1 and rt.measured is not None and rt.hits >= 10  # and timed afresh
    assert "by an earlier run" not in fast.body.header_text()
    steps.run()
    assert torch.equal(reg["h"], torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"])))))


@pytest.mark.parametrize("loads", [True, False])
def test_forcing_the_compiled_form_loads_a_put_off_package(cache_dir, monkeypatch, loads):
    prog, reg = _chain(40)
    fast, rt, entry = _stored(cache_dir, monkeypatch, prog, reg,
                              {"compiled": False, "compiled_s": 12e-6, "eager_s": 8e-6, "periods": 20})
    if not loads:
        monkeypatch.setattr(outofprocess, "load_plain", lambda path: (_ for _ in ()).throw(OSError("damaged")))
    steps = fast.start()
    steps.run(max_steps=5)
    assert rt.state == "eager" and rt.hits == 0
    if not loads:  # nothing compiled is left: the compile needs example inputs
        with pytest.raises(ValueError, match="nothing is compiled yet"):
            rt.force("compiled")
        assert not entry.exists()
        return
    rt.force("compiled")
    steps.run()
    assert rt.state == "compiled" and rt.hits == 35
    assert torch.equal(reg["h"], torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"])))))


def test_a_run_that_timed_a_cached_package_keeps_what_it_measured_with_the_entry(cache_dir, monkeypatch):
    prog, reg = _chain(4000)
    fast, rt, entry = _stored(cache_dir, monkeypatch, prog, reg)
    assert cache.decision(str(entry)) is None
    fast.run()
    got = cache.decision(str(entry))
    assert rt.measured is not None and got is not None, rt.status()
    assert got["compiled"] is (rt.state == "compiled") and (got["compiled_s"], got["eager_s"]) == rt.measured
    (entry / cache.DECISION).write_text("{not json")  # a damaged note is no decision
    assert cache.decision(str(entry)) is None


def test_pickling_a_step_for_its_key_does_not_search_the_modules_for_its_generated_function(monkeypatch):
    """A function with no module makes cloudpickle look through every imported module for it (milliseconds
    at a warm start's first execution); the generated functions name one of their own."""
    import cloudpickle.cloudpickle as cp

    searched = []
    real = cp._whichmodule
    monkeypatch.setattr(cp, "_whichmodule", lambda obj, name: (
        searched.append(name) if getattr(obj, "__module__", None) is None else None) or real(obj, name))
    prog, reg = _chain()
    rt = fuse_torch(prog).body.runtime()
    outofprocess.job_payload(rt.generated.head, (reg["x"],), {})
    assert searched == []


@pytest.mark.parametrize("extra, device, alone", [
    (None, "cpu", True),
    ("step/data/constants/weights.bin", "cpu", False),  # weights: the package is loaded whole
    ("step/data/aotinductor/model/second.wrapper.so", "cpu", False),
    (None, "cuda", False),
])
def test_a_package_is_kept_as_its_library_alone_only_when_that_is_all_it_needs(tmp_path, extra, device, alone):
    import zipfile

    from flowvm.fused import torch_internals

    model = "step/data/aotinductor/model/"
    names = {"step/archive_format": b"pt2", "step/byteorder": b"little", "step/.data/version": b"1",
             model + "w.wrapper.cpp": b"// source", model + "w.wrapper.so": b"\x7fELF library",
             model + "w.wrapper_metadata.json": json.dumps({"AOTI_DEVICE_KEY": device}).encode()}
    if extra:
        names[extra] = b"more"
    with zipfile.ZipFile(tmp_path / "step.pt2", "w") as z:
        for name, data in names.items():
            z.writestr(name, data)
    assert torch_internals.aoti_library(str(tmp_path / "step.pt2"), str(tmp_path / "step.so")) is alone
    assert (tmp_path / "step.so").exists() is alone
    if alone:
        assert (tmp_path / "step.so").read_bytes() == b"\x7fELF library"
    kept = outofprocess._kept(os.listdir(tmp_path) + ["job.pkl"])
    assert kept == (["step.so"] if alone else ["step.pt2"])


@pytest.mark.parametrize("executions", [40, 100_000])
def test_a_short_run_of_a_step_measured_faster_eagerly_does_not_look_up_its_entry(cache_dir, monkeypatch, executions):
    """A hint keeps what the last run measured of its steps: a run too short to measure the step again runs it
    eagerly at once, without pickling the step for its key; a long one looks its entry up, to measure it
    again later."""
    prog, reg = _chain(executions)
    measured = {"compiled": False, "compiled_s": 12e-6, "eager_s": 8e-6, "periods": 20}
    fast, rt, _ = _stored(cache_dir, monkeypatch, prog, reg, measured)
    cache.note_hint(jobs.hint(rt.generated, rt.settings.options, (reg["x"],)), measured)
    described, real = [], jobs.describe
    monkeypatch.setattr(jobs, "describe", lambda *a: described.append(1) or real(*a))
    drv = fast.start()
    drv.run(max_steps=3)
    assert rt.state == "eager" and rt.decision.endswith("per execution (by an earlier run)"), rt.decision
    assert rt.hits == 0 and described == ([] if executions == 40 else [1])
    assert rt.cached is (executions != 40)
