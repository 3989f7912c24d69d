"""Each optional extra of the package, as a user installs it: the wheel with that one extra (or none) in a venv
of its own (no system site-packages), where the features the extra is for work and the others say, in one
line, which extra to install.

The wheel is built once per test session and the venvs are made side by side; a venv lives under the session's
temporary directory.  uv installs the extras where it is installed next to the tests' Python (scripts/test.sh
puts it there): it reads the same metadata pip does, and fetches in parallel what pip fetches one by one.
pip installs the torch extra, pinned, so that it takes the local CPU build (uv does not look there).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
INSTALL_TIMEOUT = 600  # seconds for one venv's install
# What each extra's venv installs besides the wheel: torch pinned as everywhere in this project's tests
# (scripts/test.sh), so that pip takes the local CPU build.
PINS = {"torch": ["torch==2.13.0"]}
TESTED = ("", "torch", "dask", "s3", "plot", "tensorboard", "watch")  # "" is the core install, no extra
UNTESTED = {"test": "the test suite's own tools: every test runs with them",
            "bench": "the benchmarks' comparison library: CI installs it to run bench/"}

pytestmark = pytest.mark.timeout(INSTALL_TIMEOUT + 300)


def test_every_extra_of_the_package_is_tested_here():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(declared) == {e for e in TESTED if e} | set(UNTESTED)


def _make_venv(root: Path, wheel: Path, extra: str) -> Path:
    where = root / (extra or "core")
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    if (where / "pyvenv.cfg").read_text().find("include-system-site-packages = true") >= 0:
        raise AssertionError(f"{where} sees the system site-packages")
    wanted = f"{wheel}[{extra}]" if extra else str(wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_CACHE_DIR")}
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is not None and extra not in PINS:
        command = [uv, "pip", "install", "-q", "--python", str(where / "bin" / "python"), wanted]
    else:
        command = [str(where / "bin" / "pip"), "install", "-q", *PINS.get(extra, []), wanted]
    done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT, env=env)
    if done.returncode != 0:
        raise AssertionError(f"{'uv pip' if command[0] == uv else 'pip'} install {wanted} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return where


@pytest.fixture(scope="session")
def venvs(tmp_path_factory):
    """extra -> a future of its venv's path, the venvs made three at a time from one wheel built here."""
    root = tmp_path_factory.mktemp("extras")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(root / "dist"),
                            str(REPO)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (root / "dist").glob("flowvm-*.whl")
    pool = cf.ThreadPoolExecutor(3)
    futures = {extra: pool.submit(_make_venv, root, wheel, extra) for extra in TESTED}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def run_in(venv: Path, *args, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """A command of the venv (flowvm, python, ...) run in cwd with no PYTHONPATH, as a user would."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MPLBACKEND"] = "Agg"
    done = subprocess.run([str(venv / "bin" / args[0]), *map(str, args[1:])], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")
    return done


def one_line_hint(done: subprocess.CompletedProcess, extra: str) -> None:
    """A refusal that names the extra to install, in one line, no traceback."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"pip install 'flowvm[{extra}]'" in lines[0], lines[0]


PCA = ["run", "pca", "--set", "batches=4", "--set", "samples=20", "--set", "dim=4", "--set", "components=2",
       "--progress", "none"]


def test_the_core_install_runs_numpy_programs_and_names_the_extra_a_feature_needs(venvs, tmp_path):
    venv = venvs[""].result()
    assert "finished after" in run_in(venv, "flowvm", *PCA, "--checkpoint", "run.ckpt", cwd=tmp_path).stdout
    imported = run_in(venv, "python", "-c", "import sys, flowvm; print('torch' in sys.modules)", cwd=tmp_path)
    assert imported.stdout.strip() == "False"
    one_line_hint(run_in(venv, "flowvm", "plot", "run.ckpt", cwd=tmp_path, check=False), "plot")
    one_line_hint(run_in(venv, "flowvm", *PCA, "--tensorboard", "tb", cwd=tmp_path, check=False), "tensorboard")
    one_line_hint(run_in(venv, "flowvm", "run", "mlp", cwd=tmp_path, check=False), "torch")
    one_line_hint(run_in(venv, "flowvm", *PCA, "--checkpoint", "s3://bucket/run.ckpt", cwd=tmp_path,
                         check=False), "s3")
    one_line_hint(run_in(venv, "flowvm", *PCA, "--watch", "0", cwd=tmp_path, check=False), "watch")


def test_the_watch_extra_serves_the_page_of_a_run(venvs, tmp_path):
    venv = venvs["watch"].result()
    script = ("import json, subprocess, sys, urllib.request\n"
              "p = subprocess.Popen([sys.argv[1], 'run', 'pca', '--set', 'batches=2000', '--watch', '0', "
              "'--progress', 'none'], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)\n"
              "url = p.stderr.readline().split('watching at ')[1].strip()\n"
              "print(json.load(urllib.request.urlopen(url + 'api/state', timeout=30))['header']['program'])\n"
              "req = urllib.request.Request(url + 'api/stop', data=b'{}', method='POST')\n"
              "print(json.load(urllib.request.urlopen(req, timeout=60))['paused'])\n"
              "print(p.wait(timeout=60))\n")
    done = run_in(venv, "python", "-c", script, str(venv / "bin" / "flowvm"), cwd=tmp_path)
    assert done.stdout.split() == ["pca", "False", "0"], done.stderr


def test_the_tensorboard_extra_writes_scalars_without_torch(venvs, tmp_path):
    venv = venvs["tensorboard"].result()
    run_in(venv, "flowvm", *PCA, "--tensorboard", "tb", "--checkpoint", "run.ckpt", cwd=tmp_path)
    read = ("from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
            "import importlib.util, flowvm\n"
            "assert importlib.util.find_spec('torch') is None, 'torch is installed'\n"
            "events = EventAccumulator('tb'); events.Reload()\n"
            "points = flowvm.read_header('run.ckpt')['meta']['history']['points']['batch']\n"
            "assert [(e.step, e.value) for e in events.Scalars('batch')] == [tuple(p) for p in points]\n"
            "print(len(points), sorted(events.Tags()['scalars']))\n")
    out = run_in(venv, "python", "-c", read, cwd=tmp_path).stdout
    assert int(out.split()[0]) > 10 and "'explained/0'" in out, out


def test_the_plot_extra_draws_a_runs_history(venvs, tmp_path):
    venv = venvs["plot"].result()
    run_in(venv, "flowvm", *PCA, "--checkpoint", "run.ckpt", cwd=tmp_path)
    out = run_in(venv, "flowvm", "plot", "run.ckpt", "batch", "--log", "-o", "c.png", cwd=tmp_path).stdout
    assert "wrote c.png" in out and (tmp_path / "c.png").stat().st_size > 1000


def test_the_torch_extra_trains_the_mlp_and_its_model_loads_with_plain_torch_load(venvs, tmp_path):
    venv = venvs["torch"].result()
    run_in(venv, "flowvm", "run", "mlp", "--set", "epochs=1", "--output", "model.pt", "--progress", "none",
           cwd=tmp_path)
    load = ("import torch\n"
            "from flowvm.programs.mlp import Classifier\n"
            "saved = torch.load('model.pt', weights_only=True)\n"
            "net = Classifier(saved['layer_sizes_']); net.load_state_dict(saved['state_dict'])\n"
            "print(net.predict(torch.zeros(2, saved['layer_sizes_'][0])).shape)\n")
    assert run_in(venv, "python", "-c", load, cwd=tmp_path).stdout.strip() == "(2,)"
    # convnet's default data, scikit-learn's digits, comes with the extra
    out = run_in(venv, "flowvm", "run", "convnet", "--set", "epochs=1", "--progress", "none", cwd=tmp_path).stdout
    assert "accuracy" in out


def test_the_dask_extra_runs_spawned_fragments_on_a_cluster(venvs, tmp_path):
    venv = venvs["dask"].result()
    code = ("import flowvm\n"
            "from dask.distributed import Client\n"
            "from flowvm import CALL, SPAWN, Registers\n"
            "client = Client(processes=False, dashboard_address=None)\n"
            "flowvm.register_executor('cluster', client)\n"
            "reg = Registers(x=20)\n"
            "SPAWN(CALL(abs, reg('x'), store_to=reg('y')), executor='cluster').run()\n"
            "print(reg['y'])\n"
            "client.close()\n")
    assert run_in(venv, "python", "-c", code, cwd=tmp_path).stdout.strip().splitlines()[-1] == "20"


def test_the_s3_extra_saves_runs_through_fsspec(venvs, tmp_path):
    venv = venvs["s3"].result()
    code = ("import flowvm, s3fs\n"
            "from flowvm import CALL, Registers\n"
            "reg = Registers(x=-3)\n"
            "drv = CALL(abs, reg('x'), store_to=reg('y')).start()\n"
            "flowvm.save(drv, 'memory://bucket/run.ckpt')\n"
            "back = flowvm.load('memory://bucket/run.ckpt'); back.run()\n"
            "print(back.registers['y'])\n")
    assert run_in(venv, "python", "-c", code, cwd=tmp_path).stdout.strip() == "3"
