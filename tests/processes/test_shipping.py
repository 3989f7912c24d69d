"""SPAWN to a Dask cluster whose worker does not have the user's code: real ``dask scheduler`` and ``dask worker``
processes on 127.0.0.1, the worker in its own working directory with a PYTHONPATH that holds flowvm and a
probe package at version 2.0 only.  The user's side runs in subprocesses whose working directory holds a
script and a package (``mypkg``), with the probe package at 1.0 or 2.0."""

import json
import os
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

import flowvm

pytest.importorskip("distributed", reason="the Dask engine needs pip install flowvm[dask]")

pytestmark = pytest.mark.timeout(240)

FLOWVM_ROOT = str(Path(flowvm.__file__).resolve().parent.parent)  # holds flowvm (site-packages or src)

MYPKG = {
    "mypkg/__init__.py": "from .maths import Point, scale\n",
    "mypkg/maths.py": """
        import enum

        import numpy as np

        FACTOR = 3


        class Point:
            def __init__(self, x):
                self.x = x


        class Mode(enum.Enum):
            FAST = 1
            SLOW = 2


        def scale(x):
            return np.asarray(x, dtype=np.float64) * FACTOR
        """,
}

TRAIN = """
    import importlib.util
    import os
    import sys
    import time

    from flowvm import CALL, SEQ, SPAWN, WEAVE, Registers, register_executor
    import mypkg


    def trial(i, seconds=0.0):
        time.sleep(seconds)
        return {"value": mypkg.scale([i, i + 1]).sum() + 0.5, "point": mypkg.Point(i), "cwd": os.getcwd(),
                "code": [getattr(importlib.util.find_spec(m), "origin", None) for m in ("mypkg", "train")]}


    def probe(marker):
        open(marker, "w").close()  # never written when the worker refuses the fragment
        import flowvm_probe

        return flowvm_probe.VERSION


    def lazy(x, mode):
        import lazyhelp  # a module of the working directory, imported by no one in the parent
        from mypkg.maths import Mode, scale

        return {"value": lazyhelp.twice(float(scale(x))), "loaded": "lazyhelp" in sys.modules,
                "same_enum": mode is Mode.FAST}  # the register's enum member is the module's own


    def has_module(name):
        return name in sys.modules


    def use_fastbits(x):
        import fastbits  # a compiled extension in the working directory

        return fastbits.double(x)


    def build(executor=None, n=3, seconds=0.0):
        reg = Registers()
        return SEQ([WEAVE(-1, [SPAWN(CALL(trial, i, seconds, store_to=reg(f"r{i}")), executor=executor)
                               for i in range(n)])])


    def connect(versions="error"):
        from dask.distributed import Client

        register_executor("cluster", Client(scheduler_file=os.environ["SCHEDULER_FILE"], timeout=30),
                          versions=versions)
    """

DRIVE = """
    import json
    import sys
    import warnings

    import flowvm
    import train
    from flowvm import CALL, SPAWN, Registers


    def plain(registers):
        return {k: dict(v, value=float(v["value"]), point=[type(v["point"]).__module__,
                                                           isinstance(v["point"], train.mypkg.Point),
                                                           v["point"].x]) for k, v in registers.items()}


    def main(mode, path=None):
        if mode == "compare":
            train.connect()
            a = train.build().start()
            a.run()
            b = train.build("cluster").start()
            b.run()
            print(json.dumps({"local": plain(a.registers), "cluster": plain(b.registers)}))
        elif mode == "probe":
            out = {}
            for versions in ("error", "warn"):
                train.connect(versions)
                drv = SPAWN(CALL(train.probe, path + versions, store_to=Registers()("v")),
                            executor="cluster").start()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        drv.run()
                        out[versions] = {"value": drv.registers["v"]}
                    except flowvm.SpawnError as err:
                        out[versions] = {"error": type(err).__name__, "message": str(err), "package": err.package,
                                         "here": err.here, "there": err.there}
                out[versions]["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught
                                             if issubclass(w.category, flowvm.SpawnVersionWarning)]
            print(json.dumps(out))
        elif mode == "lazy":
            train.connect()
            reg = Registers(x=2, mode=train.mypkg.maths.Mode.FAST)
            SPAWN(CALL(train.lazy, reg("x"), reg("mode"), store_to=reg("y")), executor="cluster").start().run()
            SPAWN(CALL(train.has_module, "lazyhelp", store_to=reg("after")), executor="cluster").start().run()
            print(json.dumps({"y": reg["y"], "after": reg["after"], "parent": "lazyhelp" in sys.modules}))
        elif mode == "compiled":
            train.connect()
            reg = Registers(x=21)
            local = SPAWN(CALL(train.use_fastbits, reg("x"), store_to=reg("y"))).start()
            try:
                SPAWN(CALL(train.use_fastbits, reg("x"), store_to=reg("y")), executor="cluster").start().run()
                refused = None
            except flowvm.SpawnError as err:
                refused = {"error": type(err).__name__, "message": str(err), "package": err.package}
            print(json.dumps({"local": local.run(), "cluster": refused}))
        elif mode == "save":
            train.connect()
            drv = train.build("cluster", seconds=1.0).start()
            for _ in range(8):  # the WEAVE submits the three fragments, none is done yet
                drv.step()
            assert not drv.done
            flowvm.save(drv, path)
            print(json.dumps({"steps": drv.steps}))
        elif mode == "resume":
            train.connect()
            drv = flowvm.load(path)
            drv.run()
            straight = train.build(seconds=0.0).start()
            straight.run()
            print(json.dumps({"resumed": plain(drv.registers), "straight": plain(straight.registers)}))


    if __name__ == "__main__":
        main(*sys.argv[1:])
    """

SWEEPME = """
    from flowvm import CALL, REPEAT, SEQ, Registers
    import mypkg


    def step(w, lr):
        return w - lr * 2 * (w - float(mypkg.scale(1.0)))


    def score(w):
        return -abs(w - float(mypkg.scale(1.0)))


    def build(lr=0.1, steps=20):
        reg = Registers(w=0.0)
        return SEQ([REPEAT(steps, CALL(step, reg("w"), lr, store_to=reg("w"))),
                    CALL(score, reg("w"), store_to=reg("accuracy"))])
    """


def write(root: Path, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())


def probe_wheel(folder: Path, version: str) -> Path:
    """A wheel of the pure-Python package flowvm-probe at version (the format pip installs)."""
    import base64
    import hashlib

    files = {"flowvm_probe/__init__.py": f"VERSION = {version!r}\n",
             f"flowvm_probe-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: flowvm-probe\n"
                                                            f"Version: {version}\n",
             f"flowvm_probe-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\n"
                                                         "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    path = folder / f"flowvm_probe-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            data = text.encode()
            zf.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")
        record.append(f"flowvm_probe-{version}.dist-info/RECORD,,")
        zf.writestr(f"flowvm_probe-{version}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """{version: a folder where pip installed flowvm-probe at that version}."""
    root = tmp_path_factory.mktemp("probes")
    out = {}
    for version in ("1.0", "2.0"):
        target = root / version
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                        str(target), str(probe_wheel(root, version))], check=True)
        out[version] = target
    return out


def _start(args, cwd, env, log):
    return subprocess.Popen([sys.executable, "-m", "dask", *args], cwd=cwd, env=env,
                            stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, probes):
    """(scheduler file, the worker's working directory): a scheduler and one worker, both in a directory of
    their own, PYTHONPATH = flowvm and flowvm-probe 2.0."""
    root = tmp_path_factory.mktemp("cluster")
    worker_dir = root / "worker"
    worker_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([FLOWVM_ROOT, str(probes["2.0"])]))
    env.pop("PYTHONSTARTUP", None)
    scheduler_file = root / "scheduler.json"
    log = open(root / "cluster.log", "wb")
    procs = [_start(["scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                     "--scheduler-file", str(scheduler_file)], worker_dir, env, log)]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists():
            assert time.monotonic() < deadline, (root / "cluster.log").read_text()
            time.sleep(0.1)
        procs.append(_start(["worker", "--scheduler-file", str(scheduler_file), "--nworkers", "1",
                             "--nthreads", "1", "--no-dashboard", "--no-nanny", "--local-directory",
                             str(worker_dir)], worker_dir, env, log))
        from distributed import Client

        with Client(scheduler_file=str(scheduler_file), timeout=30) as client:
            client.wait_for_workers(1, timeout=60)
        yield scheduler_file, worker_dir
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


@pytest.fixture
def project(tmp_path):
    write(tmp_path, {**MYPKG, "train.py": TRAIN, "drive.py": DRIVE, "sweepme.py": SWEEPME,
                     "lazyhelp.py": "def twice(x):\n    return 2 * x\n"})
    return tmp_path


def user(project: Path, cluster, *args, probe: Path | None = None, command=None) -> str:
    """Run the user's side in project (its working directory); its stdout."""
    paths = [FLOWVM_ROOT] + ([str(probe)] if probe is not None else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), SCHEDULER_FILE=str(cluster[0]))
    proc = subprocess.run(command or [sys.executable, "drive.py", *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_code_of_a_script_and_a_local_package_runs_on_a_worker_that_lacks_it(project, cluster):
    out = json.loads(user(project, cluster, "compare").splitlines()[-1])
    local, remote = out["local"], out["cluster"]
    assert sorted(remote) == ["r0", "r1", "r2"]
    for name in local:
        assert remote[name]["value"] == local[name]["value"] == 3 * (2 * int(name[1]) + 1) + 0.5
        # an instance of the shipped class comes back as the parent's own class
        assert remote[name]["point"] == local[name]["point"] == ["mypkg.maths", True, int(name[1])]
        assert local[name]["cwd"] == str(project)
        assert local[name]["code"] == [str(project / "mypkg" / "__init__.py"), str(project / "train.py")]
        # the worker has neither: train's functions came by value, the package mypkg (a module that trial
        # uses as a global) as source, imported from there while the fragment ran
        assert remote[name]["cwd"] == str(cluster[1]) and remote[name]["code"] == ["<shipped mypkg>", None]


def test_a_sweep_of_a_program_file_on_the_cluster_equals_the_local_pool(project, cluster):
    address = json.loads(Path(cluster[0]).read_text())["address"]
    sweep = [sys.executable, "-m", "flowvm", "sweep", "sweepme.py", "--trials", "3", "--space",
             "lr=uniform:0.01:0.3", "--metric", "accuracy"]
    on_cluster = user(project, cluster, command=sweep + ["--executor", address])
    local = user(project, cluster, command=sweep)
    table = local[local.index("search of 3 trials"):]
    assert on_cluster[on_cluster.index("search of 3 trials"):] == table
    assert len(table.splitlines()) == 5  # the best line, the header and a row per trial
    # stopped with its trials in flight, resumed by a fresh process that connects to the same scheduler
    paused = user(project, cluster, command=sweep + ["--executor", address, "--checkpoint", "sweep.ckpt",
                                                     "--max-steps", "4"])
    assert "paused at step 4" in paused and "search of" not in paused
    resumed = user(project, cluster, command=[sys.executable, "-m", "flowvm", "resume", "sweep.ckpt"])
    assert resumed[resumed.index("search of 3 trials"):] == table


def test_a_worker_with_another_version_of_a_package_refuses_the_fragment(project, cluster, probes):
    marker = project / "ran-"
    out = json.loads(user(project, cluster, "probe", str(marker), probe=probes["1.0"]).splitlines()[-1])
    refused = out["error"]
    assert refused["error"] == "SpawnVersionError"
    assert (refused["package"], refused["here"], refused["there"]) == ("flowvm-probe", "1.0", "2.0")
    assert "'flowvm-probe', which is 1.0 in the parent" in refused["message"]
    assert "and 2.0 in the worker" in refused["message"]
    assert not (project / "ran-error").exists()  # refused before running anything
    assert refused["warnings"] == []
    # versions="warn": the fragment runs (with the worker's 2.0) and the parent warns, naming both versions
    warned = out["warn"]
    assert warned["value"] == "2.0"
    assert len(warned["warnings"]) == 1 and "'flowvm-probe', which is 1.0" in warned["warnings"][0]
    assert warned["warnings"][0].startswith("SpawnVersionWarning")


def test_equal_versions_run_without_a_word(project, cluster, probes):
    out = json.loads(user(project, cluster, "probe", str(project / "ran-"), probe=probes["2.0"]).splitlines()[-1])
    assert out["error"] == {"value": "2.0", "warnings": []}
    assert (project / "ran-error").exists()


def test_local_modules_imported_inside_a_shipped_function_come_as_source(project, cluster):
    out = json.loads(user(project, cluster, "lazy").splitlines()[-1])
    assert out == {"y": {"value": 12.0, "loaded": True, "same_enum": True}, "after": False,
                   "parent": False}  # forgotten after the fragment


FASTBITS = r"""
#include <Python.h>
static PyObject *double_(PyObject *self, PyObject *arg) { return PyNumber_Add(arg, arg); }
static PyMethodDef methods[] = {{"double", double_, METH_O, "2 * x"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastbits", NULL, -1, methods};
PyMODINIT_FUNC PyInit_fastbits(void) { return PyModule_Create(&module); }
"""


def test_a_compiled_module_that_cannot_travel_is_named_by_the_worker(project, cluster):
    import sysconfig

    (project / "fastbits.c").write_text(FASTBITS)
    target = project / f"fastbits{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O0", f"-I{sysconfig.get_paths()['include']}", "fastbits.c",
                    "-o", str(target)], cwd=project, check=True)
    out = json.loads(user(project, cluster, "compiled").splitlines()[-1])
    assert out["local"] == 42  # the default pool's workers share the working directory
    refused = out["cluster"]
    assert refused["error"] == "SpawnVersionError" and refused["package"] == "fastbits"
    assert "'fastbits', a compiled extension" in refused["message"] and str(target) in refused["message"]


def test_a_run_saved_with_spawns_in_flight_resumes_in_a_fresh_process_on_the_cluster(project, cluster):
    ckpt = project / "run.ckpt"
    saved = json.loads(user(project, cluster, "save", str(ckpt)).splitlines()[-1])
    assert saved["steps"] > 0 and ckpt.exists()
    out = json.loads(user(project, cluster, "resume", str(ckpt)).splitlines()[-1])
    assert out["resumed"] and set(out["resumed"]) == set(out["straight"])
    for name, value in out["straight"].items():
        resumed = out["resumed"][name]
        assert (resumed["value"], resumed["point"]) == (value["value"], value["point"])
        assert resumed["cwd"] != value["cwd"]  # ran on the worker, the straight run on the local pool
