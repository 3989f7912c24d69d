"""A checkpoint written by this interpreter (CPython 3.11 in CI) resumes bit for bit under CPython 3.12 and 3.13.

The claim checked: a numpy-only run saved with ``flowvm.save`` mid-run and finished with
``flowvm.load(path).run()`` by another Python version gives exactly the registers, result and step count
of the run left uninterrupted here, and leaves the global generators where that run leaves them.  The
other interpreter loads flowvm from a wheel built from this checkout (so both sides run the same code),
with the same versions of numpy, cloudpickle and tqdm as this process, and no torch: only the Python
version differs.

Programs: ``crosspy_program.build`` (numpy's global generator, a seeded ``default_rng`` held by an
object the CALLs use, python's ``random``; arrays, floats, ints and dicts in registers) and the bundled
``flowvm.programs.kmeans`` and ``pca`` with small options.  Each is saved at several steps, from before
the first step to after the last.  The same files are resumed in this process too, so that a
difference seen only in another interpreter is known to come from the change of interpreter.

Setup: a session fixture builds the wheel from a copy of the checkout (the checkout itself is left
untouched), finds python3.12 / python3.13 (on PATH, else under ~/.pyenv/versions; a missing one fails
the tests, since CI's machine image has both), and keeps under ~/.cache/flowvm-tests/cross-python a venv
per interpreter and dependency versions (filled from PyPI with pip on first use) and, per wheel content,
the wheel installed with ``pip install --target``, which the child process finds on PYTHONPATH.  Cache
entries are created under a file lock, so concurrent test runs share them safely.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import pickle
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import flowvm
from flowvm.programs import kmeans, pca
from flowvm.testing import diff, outcome, same

import crosspy_program

# A cold cache builds two venvs and downloads numpy for each; warm, the whole file takes seconds.
pytestmark = pytest.mark.timeout(900)

HERE = Path(__file__).resolve().parents[1]  # the tests folder
REPO = HERE.parent
VERSIONS = ("3.12", "3.13")
DEPENDENCIES = ("numpy", "cloudpickle", "tqdm")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flowvm-tests" / "cross-python"
STALE_AFTER_S = 3 * 24 * 3600  # an installed wheel unused this long is removed


# ---------------------------------------------------------------------------- helpers
def _run(cmd: list[str], what: str, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run cmd; fail the test with its output when it fails."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{what} did not finish in {timeout} s: {' '.join(cmd)}\n{err.stdout or ''}{err.stderr or ''}")
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                    f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def _child_env(child: "Child") -> dict:
    """The environment of a child process: this one's, with PYTHONPATH naming only the tests folder and
    the installed wheel, and no user site-packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(child.flowvm_dir)])
    env["PYTHONNOUSERSITE"] = "1"
    return env


@contextmanager
def _locked(name: str):
    """An exclusive lock shared with other test processes on this machine, held while in the block."""
    locks = CACHE / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ignore_for_build(directory: str, names: list[str]) -> set[str]:
    """What the wheel's build does not need: version control, venvs, caches and earlier build outputs."""
    skip = {n for n in names if n in {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache",
                                      ".tox", ".nox"} or n.endswith(".egg-info")
            or (Path(directory, n) / "pyvenv.cfg").exists()}
    if Path(directory).resolve() == REPO:
        skip |= {n for n in names if n in {"build", "dist"}}
    return skip


def _wheel_digest(wheel: Path) -> str:
    """SHA-256 of the wheel's files (names and contents, not the zip's timestamps): the same for two
    builds of the same tree."""
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            h.update(name.encode() + b"\0" + z.read(name) + b"\0")
    return h.hexdigest()


_PROBE = ("import ensurepip, json, sys, venv; print(json.dumps({'executable': sys.executable, "
          "'version': list(sys.version_info[:3]), 'implementation': sys.implementation.name}))")


@functools.lru_cache(maxsize=None)
def find_python(version: str) -> dict | str:
    """The CPython `version` ("3.12") to resume in, as {'executable', 'version', ...}; or, when there is
    none, a message saying where it was looked for.  Candidates: python3.12 on PATH (a pyenv shim that
    does not serve it is passed over), then ~/.pyenv/versions/3.12.N/bin/python3.12, newest first."""
    candidates = []
    if on_path := shutil.which(f"python{version}"):
        candidates.append(on_path)
    versions = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    pattern = re.compile(rf"^{re.escape(version)}\.(\d+)$")
    installed = sorted(((int(m.group(1)), d) for d in versions.glob(f"{version}.*") if (m := pattern.match(d.name))),
                       reverse=True)
    candidates += [str(d / "bin" / f"python{version}") for _, d in installed]
    tried = []
    for exe in candidates:
        try:
            proc = subprocess.run([exe, "-c", _PROBE], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:
            tried.append(f"{exe}: {err}")
            continue
        if proc.returncode != 0:
            tried.append(f"{exe}: exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[0]}")
            continue
        info = json.loads(proc.stdout)
        got = ".".join(map(str, info["version"][:2]))
        if got != version or info["implementation"] != "cpython":
            tried.append(f"{exe}: is {info['implementation']} {got}")
            continue
        return info
    return (f"no CPython {version} with venv and ensurepip found: looked for python{version} on PATH and "
            f"for {versions}/{version}.N/bin/python{version}"
            + (" (tried: " + "; ".join(tried) + ")" if tried else " (none exists)")
            + f". CI's machine image has it (pyenv); install it, e.g. `pyenv install {version}`.")


def _prune(directory: Path, prefix: str, keep: Path) -> None:
    """Remove the entries of directory named prefix* (but keep) that were not used for STALE_AFTER_S
    (each use touches its marker); the caller holds the lock that covers them."""
    now = time.time()
    for entry in directory.glob(f"{prefix}*") if directory.is_dir() else ():
        if entry == keep:
            continue
        marker = entry / ".complete"
        try:
            stale = now - (marker if marker.exists() else entry).stat().st_mtime > STALE_AFTER_S
        except OSError:
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)


# ---------------------------------------------------------------------------- the other interpreters
@dataclass(frozen=True)
class Child:
    """Another interpreter, ready to resume checkpoints: its venv's python and the flowvm to put on
    PYTHONPATH."""

    version: str           # "3.12"
    full_version: str      # "3.12.1"
    python: Path           # the venv's interpreter
    flowvm_dir: Path       # the wheel, installed with pip --target


@pytest.fixture(scope="session")
def flowvm_wheel(tmp_path_factory) -> tuple[Path, str]:
    """A wheel built with pip from a copy of the checkout as it is now, and its content digest."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(REPO, source, ignore=_ignore_for_build, symlinks=True)
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
          "-w", str(work / "dist"), str(source)], "building the flowvm wheel", timeout=600)
    wheels = sorted((work / "dist").glob("flowvm-*.whl"))
    assert len(wheels) == 1, f"expected one flowvm wheel, got {wheels}"
    return wheels[0], _wheel_digest(wheels[0])


@pytest.fixture(scope="session", params=VERSIONS, ids=[f"py{v}" for v in VERSIONS])
def child(request, flowvm_wheel) -> Child:
    """A cached venv of CPython 3.12 or 3.13 with this process's numpy, cloudpickle and tqdm versions,
    plus the wheel of this checkout."""
    version = request.param
    info = find_python(version)
    if isinstance(info, str):
        pytest.fail(info)
    wheel, digest = flowvm_wheel
    full = ".".join(map(str, info["version"]))
    pins = {name: importlib.metadata.version(name) for name in DEPENDENCIES}
    exe_tag = hashlib.sha256(info["executable"].encode()).hexdigest()[:8]
    key = f"cpython{full}-{exe_tag}-" + "-".join(f"{n}{v}" for n, v in pins.items())

    venv = CACHE / "venvs" / key
    with _locked(f"venv-{key}"):
        marker = venv / ".complete"
        if not marker.exists():
            shutil.rmtree(venv, ignore_errors=True)
            _run([info["executable"], "-m", "venv", str(venv)], f"creating a Python {full} venv", timeout=300)
            _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                  *(f"{n}=={v}" for n, v in pins.items())],
                 f"installing {', '.join(f'{n}=={v}' for n, v in pins.items())} for Python {full} from PyPI",
                 timeout=600)
            marker.write_text(json.dumps({"python": info, "pins": pins}))

    installed = CACHE / "flowvm" / f"{key}-{digest[:20]}"
    with _locked(f"flowvm-{key}"):
        _prune(installed.parent, f"{key}-", keep=installed)
        marker = installed / ".complete"
        if not marker.exists():
            shutil.rmtree(installed, ignore_errors=True)
            _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                  "--no-deps", "--no-index", "--target", str(installed), str(wheel)],
                 f"installing the flowvm wheel for Python {full}", timeout=300)
            marker.write_text(digest)
        marker.touch()
    return Child(version, full, venv / "bin" / "python", installed)


# ---------------------------------------------------------------------------- the saved runs
def _bundled(module, **options):
    """A build function for a bundled program that also seeds the global generators, so that the draws
    after two runs of it can be compared although it draws nothing from them itself."""

    def build():
        random.seed(1234)
        np.random.seed(1234)
        return module.build(**options)

    return build


PROGRAMS = {
    "walk": crosspy_program.build,
    "kmeans": _bundled(kmeans, samples=300, clusters=3, restarts=2, seed=5),
    "pca": _bundled(pca, samples=40, batches=3, dim=6, components=2, seed=9),
}


@dataclass
class Saved:
    expected: dict         # outcome of the uninterrupted run
    after: tuple           # crosspy_program.after_draws() right after it
    files: dict            # step count -> checkpoint path


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Every program run uninterrupted in this process, and saved at several steps (from before the first
    to after the last), each from a fresh build; plus one copy of the walk saved mid-run to be loaded
    without its random states (the control that shows those states matter)."""
    d = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name, build in PROGRAMS.items():
        ref = build().start()
        ref.run()
        expected, after = outcome(ref), crosspy_program.after_draws()
        again = build().start()
        again.run()
        problems = diff(expected, outcome(again))
        assert not problems, f"two uninterrupted runs of {name} differ in this process: {problems}"
        total = expected["steps"]
        files = {}
        for k in sorted({0, 1, total // 3, total // 2 + 1, total - 1, total}):
            drv = build().start()
            drv.run(max_steps=k)
            assert drv.steps == k
            files[k] = str(flowvm.save(drv, d / f"{name}-{k}.ckpt"))
        out[name] = Saved(expected, after, files)
    mid = out["walk"].expected["steps"] // 2 + 1
    drv = PROGRAMS["walk"]().start()
    drv.run(max_steps=mid)
    out["walk-norandom"] = str(flowvm.save(drv, d / f"walk-{mid}.norandom.ckpt"))
    return out


def _all_files(saved: dict) -> list[str]:
    return [p for s in saved.values() if isinstance(s, Saved) for p in s.files.values()] + [saved["walk-norandom"]]


@pytest.fixture(scope="module")
def resumed(child, saved, tmp_path_factory) -> dict:
    """What the other interpreter reports after loading and finishing every saved file (one process)."""
    work = tmp_path_factory.mktemp(f"resumed-py{child.version}")
    report = work / "report.pkl"
    _run([str(child.python), "-c", "import sys, crosspy_program; crosspy_program.resume_main(sys.argv[1:])",
          str(report), *_all_files(saved)], f"resuming the checkpoints under Python {child.full_version}",
         timeout=300, env=_child_env(child), cwd=str(work))
    with open(report, "rb") as f:
        return pickle.load(f)


def _check_resumed(name: str, saved_run: Saved, results: dict, where: str) -> None:
    """Every file of saved_run, as resumed (results[path]), is the uninterrupted run exactly."""
    total = saved_run.expected["steps"]
    for k, path in saved_run.files.items():
        got = results[path]
        assert got["loaded"] == {"steps": k, "done": k == total}, f"{name} at step {k}: loaded as {got['loaded']}"
        problems = diff(saved_run.expected, got["outcome"])
        assert not problems, (f"{name} saved by Python {platform.python_version()} after {k} of {total} steps "
                              f"and finished {where} differs from the uninterrupted run:\n  " + "\n  ".join(problems))
        assert same(got["after"], saved_run.after), (
            f"{name} saved after {k} steps and finished {where}: the global generators (random, numpy) are not "
            f"where the uninterrupted run left them: {got['after']} != {saved_run.after}")


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("version", VERSIONS)
def test_interpreter_is_available(version):
    """CI's image has CPython 3.12 and 3.13: a missing one is a failure, not a skip."""
    info = find_python(version)
    assert not isinstance(info, str), info


def test_child_is_the_other_python_with_the_same_libraries(child, resumed):
    """The resumes below really ran under 3.12 / 3.13, with this checkout's wheel (not the source tree),
    the numpy version of this process, and without torch."""
    assert tuple(resumed["version_info"][:2]) == tuple(map(int, child.version.split("."))), resumed["version_info"]
    assert sys.version_info[:2] != tuple(resumed["version_info"][:2]), "the child runs this process's Python"
    assert Path(resumed["flowvm_file"]).resolve().is_relative_to(child.flowvm_dir.resolve()), resumed["flowvm_file"]
    assert resumed["numpy"] == np.__version__
    assert not resumed["torch_imported"]


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_resumes_bit_for_bit_in_this_python(saved, name):
    """Control: the same files loaded and finished in this process (after moving the global generators
    elsewhere) give the uninterrupted run, so a difference under another interpreter is that
    interpreter's doing."""
    results = {}
    for path in saved[name].files.values():
        crosspy_program.scramble_globals()
        drv = flowvm.load(path)
        loaded = {"steps": drv.steps, "done": drv.done}
        drv.run()
        results[path] = {"loaded": loaded, "outcome": outcome(drv), "after": crosspy_program.after_draws()}
    _check_resumed(name, saved[name], results, f"in this process (Python {platform.python_version()})")


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_resumes_bit_for_bit_in_another_python(child, resumed, saved, name):
    """Saved here at each cut and finished by Python 3.12 / 3.13: the registers (arrays, floats, ints,
    dicts, the walker's generator state), the result and the step count are those of the run left
    uninterrupted here, and the global generators end where that run left them."""
    _check_resumed(name, saved[name], resumed["results"], f"by Python {child.full_version}")


def test_saved_random_states_are_what_makes_it_exact(child, resumed, saved):
    """The walk loaded without its saved global states (restore_random=False) in the other interpreter
    comes out different: the exact match above rests on the states carried in the file, not on luck."""
    got = resumed["results"][saved["walk-norandom"]]
    assert diff(saved["walk"].expected, got["outcome"]), "the walk ignores the global generators"


def test_code_saved_by_value_resumes_exactly_or_is_refused(child, tmp_path):
    """A run holding a lambda, saved here and finished by another Python version, either comes out exactly
    as the uninterrupted run or is refused with a CheckpointError that names the Python that wrote it;
    it must not crash the interpreter nor silently compute something else."""
    reference = crosspy_program.build_with_lambda().start()
    reference.run()
    drv = crosspy_program.build_with_lambda().start()
    drv.run(max_steps=2)
    path = flowvm.save(drv, tmp_path / "lambda.ckpt")
    report = tmp_path / "report.pkl"
    proc = subprocess.run(
        [str(child.python), "-c", "import sys, crosspy_program; crosspy_program.resume_or_refuse(sys.argv[1:])",
         str(report), str(path)], capture_output=True, text=True, timeout=120, env=_child_env(child),
        cwd=str(tmp_path))
    if proc.returncode < 0:
        pytest.fail(f"Python {child.full_version} crashed ({signal.Signals(-proc.returncode).name}) resuming a run "
                    f"with a lambda saved by Python {platform.python_version()}:\n{proc.stderr[-2000:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(report, "rb") as f:
        got = pickle.load(f)
    assert tuple(got["version_info"][:2]) == tuple(map(int, child.version.split(".")))
    if "refused" in got:
        writer = "{}.{}".format(*sys.version_info[:2])
        assert f"Python {writer} bytecode" in got["refused"], got["refused"]
    else:
        problems = diff(outcome(reference), got["outcome"])
        assert not problems, "\n  ".join(["the lambda run resumed differently:", *problems])
