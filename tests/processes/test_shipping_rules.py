"""How a SPAWN fragment's code travels (flowvm.processes.shipping), in this process: which modules go by value,
what the manifest names, what a worker's check refuses, and that the default pool pays for none of it."""

import concurrent.futures as cf
import importlib
import importlib.machinery
import json
import pickle
import platform
import sys
import types

import cloudpickle
import numpy as np
import pytest

import flowvm
from flowvm import CALL, SPAWN, Registers, SpawnVersionError
from flowvm.processes import job, shipping


def triple(x):
    return 3 * x


def test_modules_are_sorted_by_how_they_travel():
    assert shipping.kind_of("json") == (shipping.STDLIB,)
    assert shipping.kind_of("flowvm.processes.job") == (shipping.FLOWVM,)
    assert shipping.kind_of("numpy.linalg") == (shipping.DIST, "numpy")
    assert shipping.kind_of("cloudpickle") == (shipping.DIST, "cloudpickle")
    assert shipping.kind_of(__name__)[0] == shipping.LOCAL  # this test file: no distribution holds it


def test_a_compiled_module_outside_any_distribution_is_named_and_refused_where_missing(tmp_path, monkeypatch):
    path = tmp_path / f"fastbits{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    path.write_bytes(b"")
    fake = types.ModuleType("fastbits")
    fake.__file__ = str(path)
    monkeypatch.setitem(sys.modules, "fastbits", fake)
    assert shipping.kind_of("fastbits") == (shipping.COMPILED, str(path.resolve()))
    manifest = json.loads(shipping.manifest({"fastbits", "numpy", "json", __name__}, "error"))
    assert manifest["compiled"] == {"fastbits": str(path.resolve())}
    assert manifest["packages"] == {"numpy": np.__version__}  # local code and the standard library: no check
    monkeypatch.delitem(sys.modules, "fastbits")  # the worker side: no such module to import
    refusals, warned = shipping.check(json.dumps(manifest))
    assert warned == [] and len(refusals) == 1
    assert "'fastbits', a compiled extension" in str(refusals[0]) and str(path.resolve()) in str(refusals[0])


def manifest_with(**changes):
    wanted = json.loads(shipping.manifest({"numpy"}, "error"))
    wanted.update(changes)
    return wanted


def test_the_check_names_the_package_and_both_versions():
    assert shipping.check(json.dumps(manifest_with())) == ([], [])
    wanted = manifest_with(packages={"numpy": "0.9.1", "no-such-dist": "1.2"})
    refusals, _ = shipping.check(json.dumps(wanted))
    found = {err.package: err for err in refusals}
    assert (found["numpy"].here, found["numpy"].there) == ("0.9.1", np.__version__)
    assert f"'numpy', which is 0.9.1 in the parent" in str(found["numpy"])
    assert found["no-such-dist"].there is None and "not installed" in str(found["no-such-dist"])
    err = shipping.refusal(refusals)
    assert isinstance(err, SpawnVersionError) and err.__notes__  # the first refusal, the others as notes
    assert pickle.loads(pickle.dumps(err)).package == err.package  # it travels back to the parent


def test_warn_mode_downgrades_differences_but_not_missing_code():
    wanted = manifest_with(packages={"numpy": "0.9.1", "no-such-dist": "1.2"}, mode="warn", flowvm="0.0.1")
    refusals, warned = shipping.check(json.dumps(wanted))
    assert [err.package for err in refusals] == ["no-such-dist"]
    assert len(warned) == 2 and any("flowvm is 0.0.1" in w for w in warned)


def test_another_python_minor_version_is_refused_even_in_warn_mode():
    major, minor = sys.version_info[:2]
    for mode in ("error", "warn"):
        refusals, warned = shipping.check(json.dumps(manifest_with(python=f"{major}.{minor + 1}.0", mode=mode)))
        assert [err.package for err in refusals] == ["python"] and platform.python_version() in str(refusals[0])
        assert warned == []


def test_shipping_leaves_cloudpickles_process_wide_registry_alone():
    before = cloudpickle.list_registry_pickle_by_value()
    reg = Registers(x=1)
    manifest, payload = job.shipped_payload(CALL(triple, reg("x"), store_to=reg("y")), reg, ["x"], b"n", "error")
    assert cloudpickle.list_registry_pickle_by_value() == before == set()
    assert len(cloudpickle.dumps(triple)) < 100  # another pickler, meanwhile or after, still writes it by name
    assert f"{__name__}".encode() not in payload or b"triple" in payload


def test_a_payload_notes_what_the_fragment_uses_by_name():
    reg = Registers(x=np.arange(3.0))
    frag = CALL(triple, reg("x"), store_to=reg("y"))
    manifest, payload = job.shipped_payload(frag, reg, ["x"], b"12345678", "warn")
    wanted = json.loads(manifest)
    # the array's type by name; cloudpickle, whose functions rebuild triple (shipped by value)
    assert wanted["packages"] == {"numpy": np.__version__, "cloudpickle": cloudpickle.__version__}
    assert wanted["mode"] == "warn" and wanted["flowvm"] == flowvm.__version__
    assert f"{__name__}\ntriple".encode() not in payload  # triple travels by value: no reference to this file
    outcome = job.decode_outcome(job.run_shipped(manifest, payload))
    assert outcome[0] == "ok" and outcome[2]["y"].tolist() == [0.0, 3.0, 6.0]


def test_a_module_the_worker_cannot_import_is_named():
    payload = pickle.dumps((CALL(print), {}, b"n"))  # a fragment, then a reference to a module nowhere
    payload = payload.replace(b"builtins", b"nowhere9")
    outcome = job.decode_outcome(job.run_job(payload))
    assert outcome[0] == "error" and isinstance(outcome[1], flowvm.SpawnError)
    assert "module 'nowhere9'" in str(outcome[1]) and "install the package" in str(outcome[1])


def test_the_default_pool_never_ships_and_another_executor_always_does(monkeypatch):
    calls = []
    real = job.shipped_payload

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(job, "shipped_payload", counting)
    reg = Registers(x=2)
    assert SPAWN(CALL(triple, reg("x"), store_to=reg("y"))).start().run() == 6
    assert calls == []
    with cf.ProcessPoolExecutor(1) as pool:
        assert SPAWN(CALL(triple, reg("x"), store_to=reg("y")), executor=pool).start().run() == 6
    assert calls == [1]


def test_register_executor_checks_its_versions_option():
    with pytest.raises(ValueError, match="versions must be 'error' or 'warn'"):
        flowvm.register_executor("strict", None, versions="ignore")


def test_sources_of_a_local_package_serve_its_imports_in_a_worker(tmp_path, monkeypatch):
    pkg = tmp_path / "shippedpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub.deep import answer\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "deep.py").write_text("def answer():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert shipping.kind_of("shippedpkg")[0] == shipping.LOCAL  # found without importing it
    sources = shipping.sources_of("shippedpkg")
    assert sorted(sources) == ["shippedpkg", "shippedpkg.sub", "shippedpkg.sub.deep"]
    assert "shippedpkg" not in sys.modules
    monkeypatch.syspath_prepend("/nonexistent")  # the worker: the files are gone, only the sources remain
    sys.path.remove(str(tmp_path))
    importlib.invalidate_caches()
    with shipping.ShippedSources(sources):
        import shippedpkg

        assert shippedpkg.answer() == 42
    assert "shippedpkg" not in sys.modules and "shippedpkg.sub.deep" not in sys.modules


# ------------------------------------------------------------------ a worker without the code: a fresh process
FLOWVM_ROOT = str(__import__("pathlib").Path(flowvm.__file__).resolve().parent.parent)
WORKER = """
import sys
from flowvm.processes import job
manifest, payload = open(sys.argv[1]).read(), open(sys.argv[2], "rb").read()
outcome = job.decode_outcome(job.run_shipped(manifest, payload))
print(repr(outcome[1]) if outcome[0] == "ok" else "error: " + str(outcome[1]))
"""


def in_a_worker(tmp_path, manifest: str, payload: bytes) -> str:
    """What a worker whose path holds flowvm only (not tmp_path's code) makes of a shipped fragment."""
    import os
    import subprocess

    (tmp_path / "m.json").write_text(manifest)
    (tmp_path / "p.bin").write_bytes(payload)
    elsewhere = tmp_path / "worker"
    elsewhere.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path / "m.json"), str(tmp_path / "p.bin")],
                          cwd=elsewhere, env=dict(os.environ, PYTHONPATH=FLOWVM_ROOT), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def project(tmp_path, monkeypatch, files: dict):
    for name, text in files.items():
        path = tmp_path / "code" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    for name in list(sys.modules):  # forget modules of these names from an earlier test
        if name.split(".")[0] in {n.split("/")[0].removesuffix(".py") for n in files}:
            monkeypatch.delitem(sys.modules, name)


def test_a_module_used_as_a_global_travels_as_source_not_as_its_whole_namespace(tmp_path, monkeypatch):
    project(tmp_path, monkeypatch, {
        "helpers.py": "import threading\nimport numpy as np\nLOCK = threading.Lock()\nBIG = np.zeros(2_000_000)\n"
                      "def fit(x):\n    with LOCK:\n        return x + BIG.size\n",
        "user.py": "import helpers as h\ndef run(x):\n    return h.fit(x)\n"})
    import user

    reg = Registers(x=1)
    manifest, payload = job.shipped_payload(CALL(user.run, reg("x"), store_to=reg("y")), reg, ["x"], b"n", "error")
    assert len(payload) < 20_000  # neither the 16 MB array nor the lock is pickled: the module comes as source
    assert set(json.loads(manifest)["sources"]) == {"helpers"}
    assert in_a_worker(tmp_path, manifest, payload) == "2000001"


def test_relative_imports_in_a_function_body_bring_their_package(tmp_path, monkeypatch):
    project(tmp_path, monkeypatch, {"relpkg/__init__.py": "", "relpkg/util.py": "def g():\n    return 41\n",
                                    "relpkg/main.py": "def f():\n    from . import util\n    return util.g() + 1\n"})
    from relpkg import main

    manifest, payload = job.shipped_payload(CALL(main.f), Registers(), [], b"n", "error")
    assert sorted(json.loads(manifest)["sources"]) == ["relpkg", "relpkg.main", "relpkg.util"]
    assert in_a_worker(tmp_path, manifest, payload) == "42"


def test_a_file_of_the_users_named_like_a_standard_module_is_local_code(tmp_path, monkeypatch):
    path = tmp_path / "colorsys.py"
    path.write_text("def fit(x):\n    return x\n")
    fake = types.ModuleType("colorsys")
    fake.__file__ = str(path)
    monkeypatch.setitem(sys.modules, "colorsys", fake)
    assert shipping.kind_of("colorsys") == (shipping.LOCAL, str(path.resolve()))
    monkeypatch.delitem(sys.modules, "colorsys")
    import colorsys  # the real one

    assert shipping.kind_of("colorsys") == (shipping.STDLIB,)
    assert colorsys.__file__


def test_a_worker_checks_installed_versions_afresh(tmp_path, monkeypatch):
    wanted = manifest_with(packages={"flowvm-latepkg": "1.0"})
    refusals, _ = shipping.check(json.dumps(wanted))
    assert "not installed" in str(refusals[0])
    info = tmp_path / "flowvm_latepkg-1.0.dist-info"  # installed while the worker runs
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flowvm-latepkg\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert shipping.check(json.dumps(wanted)) == ([], [])


def test_distributions_sharing_a_top_level_name_are_told_apart_by_their_files(tmp_path, monkeypatch):
    for dist, sub in (("nsx_a", "a"), ("nsx_b", "b")):
        (tmp_path / "nsx").mkdir(exist_ok=True)
        (tmp_path / "nsx" / f"{sub}.py").write_text("")
        info = tmp_path / f"{dist}-1.{sub == 'b'}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\n"
                                       f"Version: 1.{int(sub == 'b')}\n")
        (info / "RECORD").write_text(f"nsx/{sub}.py,,\n{info.name}/METADATA,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(shipping, "_top_dists", None)  # read the distributions again
    importlib.invalidate_caches()
    import nsx.a
    import nsx.b

    assert shipping.kind_of("nsx.a") == (shipping.DIST, "nsx-a")
    assert shipping.kind_of("nsx.b") == (shipping.DIST, "nsx-b")
    monkeypatch.setattr(shipping, "_top_dists", None)


def test_fragments_carrying_sources_of_one_module_run_one_at_a_time_in_a_worker():
    import threading

    reg = Registers()
    manifest, payload = job.shipped_payload(CALL(read_shipmod), reg, [], b"n", "error")
    results = {}

    def run(value):
        wanted = dict(json.loads(manifest), sources={"flowvm_shipmod": f"VALUE = {value}\n"})
        results[value] = job.decode_outcome(job.run_shipped(json.dumps(wanted), payload))[1]

    threads = [threading.Thread(target=run, args=(v,)) for v in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {1: 1, 2: 2, 3: 3}
    assert "flowvm_shipmod" not in sys.modules


def read_shipmod():
    import time

    import flowvm_shipmod  # served from the fragment's sources only

    time.sleep(0.05)
    return flowvm_shipmod.VALUE


def run_inner(manifest, payload):
    import flowvm_shipmod

    inner = job.decode_outcome(job.run_shipped(manifest, payload))
    return inner[1], flowvm_shipmod.VALUE


@pytest.mark.timeout(30)
def test_a_fragment_running_another_with_the_same_sources_in_its_worker_does_not_wait_for_itself():
    with_sources = lambda manifest: json.dumps(dict(json.loads(manifest), sources={"flowvm_shipmod": "VALUE = 7\n"}))
    inner_manifest, inner_payload = job.shipped_payload(CALL(read_shipmod), Registers(), [], b"n", "error")
    reg = Registers(m=with_sources(inner_manifest), p=inner_payload)
    manifest, payload = job.shipped_payload(CALL(run_inner, reg("m"), reg("p")), reg, ["m", "p"], b"n", "error")
    outcome = job.decode_outcome(job.run_shipped(with_sources(manifest), payload))
    assert outcome[0] == "ok" and outcome[1] == (7, 7)
    assert "flowvm_shipmod" not in sys.modules


def test_a_shipped_packages_own_imports_travel_and_are_checked(tmp_path, monkeypatch):
    project(tmp_path, monkeypatch, {
        "pkga/__init__.py": "import localdep\n\ndef go(x):\n    return localdep.double(x)\n",
        "localdep.py": "import numpy as np\n\ndef double(x):\n    return float(np.float64(x) * 2)\n",
        "caller.py": "import pkga\n\ndef run(x):\n    return pkga.go(x)\n"})
    import caller

    reg = Registers(x=21)
    manifest, payload = job.shipped_payload(CALL(caller.run, reg("x"), store_to=reg("y")), reg, ["x"], b"n", "error")
    wanted = json.loads(manifest)
    assert set(wanted["sources"]) == {"pkga", "localdep"} and wanted["source_packages"] == ["pkga"]
    assert wanted["packages"]["numpy"] == np.__version__  # localdep's import, checked on the worker
    assert in_a_worker(tmp_path, manifest, payload) == "42.0"


def test_a_shipped_module_knows_its_file_as_the_parent_has_it(tmp_path, monkeypatch):
    project(tmp_path, monkeypatch, {
        "datapkg/__init__.py": "from pathlib import Path\nDATA = Path(__file__).parent / 'conf.json'\n"
                               "def where():\n    return str(DATA)\n",
        "usesdata.py": "import datapkg\ndef run():\n    return datapkg.where()\n"})
    import usesdata

    manifest, payload = job.shipped_payload(CALL(usesdata.run), Registers(), [], b"n", "error")
    assert json.loads(manifest)["source_files"]["datapkg"] == str(tmp_path / "code" / "datapkg" / "__init__.py")
    # the import works on the worker; the path is the parent's (found there on a shared file system)
    assert in_a_worker(tmp_path, manifest, payload) == repr(str(tmp_path / "code" / "datapkg" / "conf.json"))
