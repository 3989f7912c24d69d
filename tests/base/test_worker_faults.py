"""Data workers that hang or are stopped from outside: a watchdog ends the wait with a WorkerError naming the
worker and the batch; SIGTERM and SIGINT end such a run within seconds, saved at the last finished step,
which resumes exactly; no worker is left behind; a number of workers the machine cannot run is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

import flowvm
from flowvm import Batches
from flowvm.base.workers import WorkerError
from flowvm.testing import digest
import toy

PROGRAM = textwrap.dedent('''
    import os, time
    import numpy as np
    from flowvm import CALL, REPEAT, SEQ, Batches, Registers

    FLAG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hang")

    def slow(sample, rng):
        if int(sample[0]) == 30 and os.path.exists(FLAG):  # the batch holding sample 30 hangs
            open(FLAG + ".started", "w").close()
            time.sleep(600)
        if os.path.exists(FLAG + ".slow"):
            time.sleep(0.2)
        return sample + rng.standard_normal(sample.shape)

    def total(acc, batch):
        return acc + float(batch.sum())

    def build():
        data = Batches(np.arange(40.0 * 2).reshape(40, 2) / 2, batch_size=4, seed=1, transform=slow, workers=2,
                       timeout=float(os.environ.get("BATCH_TIMEOUT", "300")))
        reg = Registers(data=data, acc=0.0, batch=None)
        return REPEAT(10, SEQ([CALL(Batches.next_batch, reg('data'), store_to=reg('batch')),
                               CALL(total, reg('acc'), reg('batch'), store_to=reg('acc'))]))
''')


def _children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _gone(pids, seconds=5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
            return True
        time.sleep(0.05)
    return False


def _start(tmp_path, *args, env=None):
    (tmp_path / "prog.py").write_text(PROGRAM)
    return subprocess.Popen(toy.COMMAND + ["run", str(tmp_path / "prog.py"), "--progress", "none", *map(str, args)],
                            cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})))


def _wait_for(path, seconds=60.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _load(path):
    sys.path.insert(0, str(path.parent))
    try:
        return flowvm.load(path)
    finally:
        sys.path.remove(str(path.parent))


def _reference(tmp_path) -> str:
    done = toy.flowvm_cmd("run", tmp_path / "prog.py", "--checkpoint", tmp_path / "ref.ckpt", cwd=tmp_path)
    assert done.returncode == 0
    return digest(_load(tmp_path / "ref.ckpt").registers["acc"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["hang", "sigstop"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_run_whose_worker_is_stuck_saved_at_the_last_step(tmp_path, how, signum):
    ckpt = tmp_path / "c.ckpt"
    (tmp_path / ("hang" if how == "hang" else "hang.slow")).touch()
    proc = _start(tmp_path, "--checkpoint", ckpt)
    if how == "hang":
        _wait_for(tmp_path / "hang.started")
    else:  # stop every worker from outside once the run is going
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        for pid in _children(proc.pid):
            os.kill(pid, signal.SIGSTOP)
    workers = _children(proc.pid)
    t0 = time.monotonic()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 10, err
    assert proc.returncode == 128 + signum, err
    assert f"stopped by {signal.Signals(signum).name}: worker " in err and "made nothing for" in err
    assert "Traceback" not in err
    assert _gone(workers), "workers left behind"
    saved = _load(ckpt).steps
    assert 0 <= saved < 20
    (tmp_path / "hang").unlink(missing_ok=True)
    (tmp_path / "hang.slow").unlink(missing_ok=True)
    toy.flowvm_cmd("resume", ckpt, cwd=tmp_path)
    assert digest(_load(ckpt).registers["acc"]) == _reference(tmp_path)


@pytest.mark.timeout(120)
def test_a_worker_that_makes_nothing_past_the_timeout_is_an_error_naming_it(tmp_path):
    (tmp_path / "hang").touch()
    proc = _start(tmp_path, "--checkpoint", tmp_path / "c.ckpt", env={"BATCH_TIMEOUT": "2"})
    _wait_for(tmp_path / "hang.started")
    workers = _children(proc.pid)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "past its timeout of 2 s" in err and "worker " in err and "sample" in err, err
    assert _gone(workers)
    (tmp_path / "hang").unlink()
    toy.flowvm_cmd("resume", tmp_path / "c.ckpt", cwd=tmp_path)  # the failed step is taken again
    assert digest(_load(tmp_path / "c.ckpt").registers["acc"]) == _reference(tmp_path)


def test_the_watchdog_in_python_names_the_worker_and_the_batch():
    def hang(sample, rng):
        if sample[0] == 4:
            time.sleep(60)
        return sample

    data = Batches(np.arange(8.0).reshape(8, 1), batch_size=2, shuffle=False, transform=hang, workers=1,
                   start_method="fork", timeout=1.0)
    assert data.next_batch().tolist() == [[0.0], [1.0]]
    data.next_batch()
    pids = data.worker_pids
    with pytest.raises(WorkerError, match=r"worker 0 \(pid \d+, \w+\) made nothing for 1 s while making the batch"):
        data.next_batch()
    assert _gone(pids)
    data.close()


def test_workers_beyond_what_the_machine_runs_and_a_bad_timeout_are_refused():
    with pytest.raises(ValueError, match=r"workers=100000 is more than this machine can run usefully: at most \d+"):
        Batches(np.zeros((4, 1)), workers=100000)
    for bad in (0, -1, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            Batches(np.zeros((4, 1)), timeout=bad)
