"""A persistent cache of compiled packages safe to share (flowvm/fused/cache.py, flowvm/fused/cachetrust.py):
an entry whose files do not match its manifest (a library swapped for another entry's, flipped bits, a
library with a constructor) is never loaded, evicted, and its step compiled anew; a directory another user
owns or may write is refused with one warning; an entry whose load killed a process is evicted by the next;
a read-only cache is read; a full disk leaves no hint naming an entry that is not there.

Every package here is a real one, compiled once for the module (``filled``: two steps) and copied into each
test's own cache; the runs that could load a bad library run in a child process, so that a crash would not
take pytest with it.  The tests run as root in CI (mounts, chown); a few need root and say so."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from flowvm import CALL, REPEAT, SEQ, FusionWarning, Registers
from flowvm.fused import cache, cachetrust, outofprocess
from flowvm.passes.fuse_torch import fuse_torch

A = ["sin", "exp", "tanh", "sigmoid"]
B = ["cos", "exp", "tanh", "sigmoid"]
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
# the module's fixture compiles two steps in a child process (cold: 20-40 s each, minutes on a busy machine),
# and two tests compile one more
pytestmark = pytest.mark.timeout(900)
NOBODY = 65534

RUN = textwrap.dedent("""
    import json, sys, time, warnings, torch
    from flowvm import CALL, LOOP, REPEAT, SEQ, Registers
    from flowvm.fused import outofprocess
    from flowvm.passes.fuse_torch import fuse_torch
    config = json.loads(sys.argv[1])
    loads, real = [], outofprocess.load_plain

    def load(path):
        loads.append(path)
        return real(path)

    outofprocess.load_plain = load
    runs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for names in config["chains"]:
            reg = Registers(x=torch.linspace(-2, 2, 64))
            ops = [getattr(torch, n) for n in names]
            body = SEQ([CALL(op, reg("x" if i == 0 else "h"), store_to=reg("h")) for i, op in enumerate(ops)])
            want = reg["x"]
            for op in ops:
                want = op(want)
            if config["compile"]:  # a miss compiles at once, in a child process
                drv = fuse_torch(LOOP(body), compile_after=0, payback=0).start()
                rt = drv.program.body.runtime()
                deadline = time.time() + 300
                while rt.hits < 3 and rt.refused is None and time.time() < deadline:
                    drv.run(max_steps=5)
                    time.sleep(0.05)
            else:  # the defaults: nothing compiles in 50 executions; a cached package runs from the first
                fast = fuse_torch(REPEAT(50, body))
                rt = fast.body.runtime()
                fast.run()
            runs.append({"hits": rt.hits, "cached": rt.cached, "refused": rt.refused, "key": rt._cache_key,
                         "close": bool(torch.allclose(reg["h"], want, rtol=1e-5, atol=1e-6))})
    print(json.dumps({"runs": runs, "loads": len(loads), "warnings": [str(w.message) for w in caught]}))
""")


def run(where, chains, compile=False, check=True, **env) -> dict | subprocess.CompletedProcess:
    """The chains run in a child process with the cache at where: what each did (hits, cached, its key,
    results close to eager's), how many packages it loaded, its warnings."""
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                   FLOWVM_CACHE_DIR=str(where), **env)
    out = subprocess.run([sys.executable, "-c", RUN, json.dumps({"chains": chains, "compile": compile})],
                         capture_output=True, text=True, env=environ, timeout=600)
    if not check:
        return out
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache holding the packages of chains A and B, compiled (once for the module) as a run stores them,
    and their keys."""
    where = tmp_path_factory.mktemp("filled") / "compiled"
    got = run(where, [A, B], compile=True)
    assert all(r["hits"] > 0 and not r["cached"] and r["key"] for r in got["runs"]), got
    keys = {"A": got["runs"][0]["key"], "B": got["runs"][1]["key"]}
    for k in keys.values():
        assert sorted(os.listdir(where / k)) == [cache.MANIFEST, outofprocess.LIBRARY]
    assert os.listdir(where / cache.HINTS)  # their hints (the two chains' may be one: a hint is a cheap digest)
    return where, keys


@pytest.fixture
def copy(filled, tmp_path):
    """This test's own copy of the filled cache: (its directory, the keys)."""
    where, keys = filled
    mine = tmp_path / "cache" / "compiled"
    shutil.copytree(where, mine)
    os.chmod(mine.parent, 0o700)
    return mine, keys


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """Two shared libraries whose constructor runs at dlopen: one writes the file named by
    FLOWVM_TEST_MARKER, the other crashes the process (SIGSEGV)."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build a library with a constructor")
    folder = tmp_path_factory.mktemp("libraries")
    (folder / "ctor.c").write_text(textwrap.dedent("""
        #include <stdio.h>
        #include <stdlib.h>
        __attribute__((constructor)) static void ran(void) {
            const char *marker = getenv("FLOWVM_TEST_MARKER");
        #ifdef CRASH
            *(volatile int *)0 = 1;
        #endif
            if (marker) { FILE *f = fopen(marker, "w"); if (f) { fputs("the constructor ran", f); fclose(f); } }
        }
    """))
    for name, flags in (("marker.so", []), ("crash.so", ["-DCRASH"])):
        subprocess.run(["gcc", "-shared", "-fPIC", *flags, "-o", str(folder / name), str(folder / "ctor.c")],
                       check=True, capture_output=True)
    return folder


def test_a_cache_filled_by_a_run_loads_and_runs_in_the_next(copy):
    where, keys = copy
    got = run(where, [A, B])
    assert got["loads"] == 2 and got["warnings"] == []
    # compiled from the first execution on (a trial against eager: no decision was kept)
    assert all(r["cached"] and r["hits"] > 0 and r["close"] for r in got["runs"]), got


def test_a_library_swapped_for_another_entrys_is_refused_and_its_step_compiled_anew(copy):
    """The attack: B's step.so replaced by A's, with a decision kept (so that no first call is checked
    against eager) ran A's kernel for B.  Its digest differs from B's manifest: evicted, compiled anew."""
    where, keys = copy
    cache_env = {"FLOWVM_CACHE_DIR": str(where)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in cache_env.items():
            mp.setenv(k, v)
        cache.note(keys["B"], {"compiled": True, "compiled_s": 1e-6, "eager_s": 2e-6, "periods": 100})
    assert (where / keys["B"] / cache.DECISION).exists()
    shutil.copyfile(where / keys["A"] / outofprocess.LIBRARY, where / keys["B"] / outofprocess.LIBRARY)
    got = run(where, [B], compile=True)
    (b,) = got["runs"]
    assert b["close"] and not b["cached"] and b["hits"] > 0 and b["refused"] is None, got
    assert got["loads"] == 1  # the fresh compile's package, never the swapped one
    with pytest.MonkeyPatch.context() as mp:  # and B's entry is its own again
        mp.setenv("FLOWVM_CACHE_DIR", str(where))
        assert cache.lookup(keys["B"]) is not None


def test_an_entry_copied_whole_under_another_key_is_refused(copy):
    """A's whole entry (its manifest too, and a decision) put under B's name: the manifest names A's key."""
    where, keys = copy
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLOWVM_CACHE_DIR", str(where))
        cache.note(keys["A"], {"compiled": True, "compiled_s": 1e-6, "eager_s": 2e-6, "periods": 100})
    shutil.rmtree(where / keys["B"])
    shutil.copytree(where / keys["A"], where / keys["B"])
    got = run(where, [B])
    (b,) = got["runs"]
    assert b["close"] and not b["cached"] and got["loads"] == 0, got
    assert not (where / keys["B"]).exists() and (where / keys["A"]).exists()


def test_flipped_bits_in_a_library_are_found_before_it_loads_and_the_entry_is_evicted(copy):
    where, keys = copy
    library = where / keys["A"] / outofprocess.LIBRARY
    data = bytearray(library.read_bytes())
    rng = random.Random(36)
    for bit in rng.sample(range(len(data) * 8), 50):
        data[bit // 8] ^= 1 << (bit % 8)
    library.write_bytes(bytes(data))
    for _ in range(2):  # and the next run finds no entry to crash on
        got = run(where, [A])
        (a,) = got["runs"]
        assert a["close"] and not a["cached"] and got["loads"] == 0, got
        assert not (where / keys["A"]).exists()
    assert (where / keys["B"]).exists()


def _hashed(monkeypatch) -> list[str]:
    """The files cachetrust hashes from now on."""
    hashed, real = [], cachetrust.digest
    monkeypatch.setattr(cachetrust, "digest", lambda path: hashed.append(os.path.basename(path)) or real(path))
    return hashed


def test_an_entry_untouched_since_it_was_stored_is_checked_by_its_stamps_without_hashing(filled, monkeypatch):
    where, keys = filled
    monkeypatch.setenv("FLOWVM_CACHE_DIR", str(where))
    hashed = _hashed(monkeypatch)
    assert cache.lookup(keys["A"]) is not None and hashed == []


def test_a_library_rewritten_in_place_with_its_times_set_back_is_hashed_and_refused(copy, monkeypatch):
    """The stamps hold a file's inode, size and times: a write in place keeps the inode and the size, and the
    modification time can be set back, but not the status-change time: the library is hashed, and fails."""
    where, keys = copy
    entry, library = where / keys["A"], where / keys["A"] / outofprocess.LIBRARY
    files = json.loads((entry / cache.MANIFEST).read_text())["files"]
    cachetrust.write_manifest(str(entry), keys["A"], files, stamps={outofprocess.LIBRARY: cachetrust.stamp(
        os.lstat(library))})  # stamps of this copy (a copied entry's are another file's: it is hashed)
    monkeypatch.setenv("FLOWVM_CACHE_DIR", str(where))
    hashed = _hashed(monkeypatch)
    assert cache.lookup(keys["A"]) is not None and hashed == []
    before = os.lstat(library)
    with open(library, "r+b") as f:  # one byte flipped in place: the same inode, the same size
        f.seek(before.st_size // 2)
        byte = f.read(1)
        f.seek(before.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(library, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.lstat(library)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert cache.lookup(keys["A"]) is None and hashed == [outofprocess.LIBRARY]  # hashed, failed, evicted
    assert not entry.exists()


def test_a_library_with_a_constructor_in_place_of_a_package_is_never_loaded(copy, libraries, tmp_path):
    where, keys = copy
    marker = tmp_path / "constructor-ran"
    shutil.copyfile(libraries / "marker.so", where / keys["A"] / outofprocess.LIBRARY)
    got = run(where, [A, B], FLOWVM_TEST_MARKER=str(marker))
    a, b = got["runs"]
    assert not marker.exists()
    assert a["close"] and not a["cached"] and not (where / keys["A"]).exists()
    assert b["cached"] and b["close"] and got["loads"] == 1, got  # B's package, untouched, loads


@pytest.mark.skipif(not ROOT, reason="chown to another user needs root")
def test_an_entry_another_user_wrote_is_refused_even_with_a_manifest_matching_it(copy, libraries, tmp_path):
    """Whoever may write an entry may write its manifest too: the digests protect against damage and swaps,
    the owners against other users."""
    where, keys = copy
    marker = tmp_path / "constructor-ran"
    entry = where / keys["A"]
    shutil.copyfile(libraries / "marker.so", entry / outofprocess.LIBRARY)
    cachetrust.write_manifest(str(entry), keys["A"], {outofprocess.LIBRARY: cachetrust.digest(
        str(entry / outofprocess.LIBRARY))})
    os.chown(entry, NOBODY, NOBODY)
    got = run(where, [A], FLOWVM_TEST_MARKER=str(marker))
    assert not marker.exists() and got["loads"] == 0 and got["runs"][0]["close"], got


def _refused(where, keys, monkeypatch):
    """The cache at where is refused: one warning, no package loaded, nothing written, results right."""
    before = {p: p.stat().st_mtime_ns for p in where.rglob("*")}
    monkeypatch.setenv("FLOWVM_CACHE_DIR", str(where))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.root() is None and cache.root() is None
        reg = Registers(x=torch.linspace(-2, 2, 64))
        body = SEQ([CALL(getattr(torch, n), reg("x" if i == 0 else "h"), store_to=reg("h")) for i, n in enumerate(A)])
        fast = fuse_torch(REPEAT(20, body))
        fast.run()
    ours = [w for w in caught if issubclass(w.category, FusionWarning)]
    assert len(ours) == 1 and "is not used in this process" in str(ours[0].message), [str(w.message) for w in caught]
    assert not fast.body.runtime().cached
    assert torch.allclose(reg["h"], torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"])))))
    assert {p: p.stat().st_mtime_ns for p in where.rglob("*")} == before
    return str(ours[0].message)


def test_a_cache_group_or_others_may_write_is_refused_with_one_warning(copy, monkeypatch):
    where, keys = copy
    os.chmod(where, 0o775)
    assert "writable by group" in _refused(where, keys, monkeypatch)
    other = where.parent / "others"  # another directory, others may write
    shutil.copytree(where, other)
    os.chmod(other, 0o707)
    assert "writable by others" in _refused(other, keys, monkeypatch)


@pytest.mark.skipif(not ROOT, reason="chown to another user needs root")
@pytest.mark.parametrize("owned", ["the cache", "a directory above it"])
def test_a_cache_another_user_owns_is_refused_with_one_warning(copy, monkeypatch, owned):
    where, keys = copy
    os.chown(where if owned == "the cache" else where.parent, NOBODY, NOBODY)
    assert "owned by another user" in _refused(where, keys, monkeypatch)


def test_directories_the_cache_creates_are_its_users_alone(tmp_path, monkeypatch):
    where = tmp_path / "made" / "by" / "flowvm"
    monkeypatch.setenv("FLOWVM_CACHE_DIR", str(where))
    work = tmp_path / "work"
    work.mkdir()
    (work / "step.so").write_bytes(b"library")
    old = os.umask(0)
    try:
        assert cache.store("k" * 40, str(work), ["step.so"]) is not None
        cache.add_hint("h" * 40, "k" * 40)
    finally:
        os.umask(old)
    for folder in (tmp_path / "made", tmp_path / "made" / "by", where, where / cache.HINTS, where / ("k" * 40)):
        assert (folder.stat().st_mode & 0o777) == 0o700, folder
    manifest = json.loads((where / ("k" * 40) / cache.MANIFEST).read_text())
    assert manifest["key"] == "k" * 40 and set(manifest["files"]) == {"step.so"}
    assert cache.lookup("k" * 40) is not None


def test_a_decision_its_manifest_does_not_name_is_none(copy, monkeypatch):
    """A decision kept with an entry lets a later run skip the check of its first call against eager: one
    written beside the manifest, not through it, is ignored (the first call is checked)."""
    where, keys = copy
    monkeypatch.setenv("FLOWVM_CACHE_DIR", str(where))
    entry = where / keys["A"]
    (entry / cache.DECISION).write_text(json.dumps({"compiled": True, "compiled_s": 1, "eager_s": 2, "periods": 3}))
    assert cache.lookup(keys["A"]) is not None and cache.decision(str(entry)) is None
    cache.note(keys["A"], {"compiled": True, "compiled_s": 1, "eager_s": 2, "periods": 3})
    assert cache.decision(str(entry))["periods"] == 3


def test_a_mark_left_by_a_process_that_died_loading_an_entry_evicts_it(copy, monkeypatch):
    where, keys = copy
    monkeypatch.setenv("FLOWVM_CACHE_DIR", str(where))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = cachetrust._host()
    (where / keys["B"] / f"{cachetrust.LOADING}{os.getpid()}@{host}").touch()  # a live process: loading it now
    assert cache.lookup(keys["B"]) is not None
    (where / keys["A"] / f"{cachetrust.LOADING}{gone.pid}@{host}").touch()
    assert cache.lookup(keys["A"]) is None and not (where / keys["A"]).exists()


def test_a_library_that_crashes_its_loader_crashes_one_run_not_every_run(copy, libraries):
    """A package whose digest is right but whose load kills the process (here a constructor's SIGSEGV): the
    run that loaded it dies, leaving its mark; the next run evicts the entry and compiles the step anew."""
    where, keys = copy
    work = where.parent / "work"
    work.mkdir()
    shutil.copyfile(libraries / "crash.so", work / outofprocess.LIBRARY)
    shutil.rmtree(where / keys["A"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLOWVM_CACHE_DIR", str(where))
        assert cache.store(keys["A"], str(work), [outofprocess.LIBRARY]) is not None  # stored, with its digest
    crashed = run(where, [A], check=False)
    assert crashed.returncode == -signal.SIGSEGV, crashed.stderr[-2000:]
    assert [n for n in os.listdir(where / keys["A"]) if n.startswith(cachetrust.LOADING)]
    got = run(where, [A])
    assert got["loads"] == 0 and got["runs"][0]["close"] and not got["runs"][0]["cached"], got
    assert not (where / keys["A"]).exists()


@pytest.fixture
def mounted(tmp_path):
    """A tmpfs of its own for the test (root only), unmounted at the end: (its directory, the size option)."""
    made = []

    def mount(size: str):
        folder = tmp_path / f"mnt{len(made)}"
        folder.mkdir()
        got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(folder)],
                             capture_output=True, text=True)
        if got.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
        made.append(folder)
        return folder

    yield mount
    for folder in reversed(made):
        subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_cache_is_read_and_never_written(copy, mounted):
    """Root may write a directory whatever its mode, so as root the cache is a tmpfs remounted read-only
    (the same as a read-only bind mount of a shared cache); another user makes its copy's modes read-only."""
    where, keys = copy
    if ROOT:
        ro = mounted("8m")
        shutil.copytree(where, ro / "compiled")
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        where = ro / "compiled"
    else:
        for folder, _, _ in os.walk(where):
            os.chmod(folder, 0o500)
    before = {str(p): p.stat().st_mtime_ns for p in where.rglob("*")}
    got = run(where, [A, B])
    assert got["warnings"] == [] and got["loads"] == 2, got
    # compiled from the first execution on (a trial against eager: no decision was kept)
    assert all(r["cached"] and r["hits"] > 0 and r["close"] for r in got["runs"]), got
    assert {str(p): p.stat().st_mtime_ns for p in where.rglob("*")} == before
    if not ROOT:
        for folder, _, _ in os.walk(where):
            os.chmod(folder, 0o700)


@pytest.mark.skipif(not ROOT, reason="mounts a small tmpfs: needs root")
def test_a_full_disk_leaves_no_hint_naming_an_entry_that_is_not_there(filled, mounted):
    where, keys = filled
    size = (where / keys["A"] / outofprocess.LIBRARY).stat().st_size
    assert size > 16 * 1024  # more than the disk holds
    full = mounted("16k") / "compiled"
    got = run(full, [A], compile=True)
    (a,) = got["runs"]
    assert a["hits"] > 0 and a["close"], got  # the compiled package runs all the same
    entries = [n for n in os.listdir(full) if n != cache.HINTS and not n.startswith(cache.TEMP_PREFIX)]
    hints = os.listdir(full / cache.HINTS) if (full / cache.HINTS).exists() else []
    assert entries == [] and hints == [], (entries, hints)


def test_a_put_off_load_checks_the_entry_again(tmp_path, monkeypatch):
    """A package an earlier run measured slower than eager is loaded only when it is timed again, maybe much
    later: its entry is checked again then, and one changed meanwhile is not loaded."""
    from flowvm.fused import choosing, jobs, threadcompile

    monkeypatch.setenv("FLOWVM_CACHE_DIR", str(tmp_path / "compiled"))
    reg = Registers(x=torch.linspace(-2, 2, 64))
    body = SEQ([CALL(getattr(torch, n), reg("x" if i == 0 else "h"), store_to=reg("h")) for i, n in enumerate(A)])
    fast = fuse_torch(REPEAT(400, body))
    rt = fast.body.runtime()
    key = jobs.describe(rt.el, rt.generated, rt.settings.options, (reg["x"],)).key
    work = tmp_path / "work"
    work.mkdir()
    (work / outofprocess.PACKAGE).write_bytes(b"a package")
    assert cache.store(key, str(work), [outofprocess.PACKAGE]) is not None
    cache.add_hint(jobs.hint(rt.generated, rt.settings.options, (reg["x"],)), key)
    cache.note(key, {"compiled": False, "compiled_s": 12e-6, "eager_s": 8e-6, "periods": 20})
    loaded = []
    monkeypatch.setattr(outofprocess, "load_plain", lambda path: loaded.append(path))
    monkeypatch.setattr(threadcompile, "compiler_ready", lambda names: False)
    monkeypatch.setattr(choosing, "RECHECK_FACTOR", 0.1)  # timed again at the 200th execution
    monkeypatch.setattr(type(rt), "_start_compile", lambda self, args: None)
    steps = fast.start()
    steps.run(max_steps=100)
    assert rt.cached and rt.state == "eager" and loaded == []
    (tmp_path / "compiled" / key / outofprocess.PACKAGE).write_bytes(b"another package")
    steps.run()
    assert loaded == [] and not (tmp_path / "compiled" / key).exists() and not rt.cached
    assert torch.allclose(reg["h"], torch.sigmoid(torch.tanh(torch.exp(torch.sin(reg["x"])))))
