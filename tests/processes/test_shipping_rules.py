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


def test_another_python_minor_version_is_refused():
    major, minor = sys.version_info[:2]
    refusals, _ = shipping.check(json.dumps(manifest_with(python=f"{major}.{minor + 1}.0")))
    assert [err.package for err in refusals] == ["python"] and platform.python_version() in str(refusals[0])


def test_the_by_value_registry_is_set_back_even_when_pickling_fails():
    before = cloudpickle.list_registry_pickle_by_value()
    with pytest.raises(RuntimeError):
        with shipping.by_value():
            assert __name__ in cloudpickle.list_registry_pickle_by_value()
            raise RuntimeError("boom")
    assert cloudpickle.list_registry_pickle_by_value() == before


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
    real = shipping.by_value

    def counting():
        calls.append(1)
        return real()

    monkeypatch.setattr(shipping, "by_value", counting)
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
