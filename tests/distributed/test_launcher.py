"""The launcher as a user meets it: two launchers on this machine joining one run (as two hosts would), the
wait for the other hosts, signals, torchrun's flag names, the lock on a run's folder.  Each run is the
flowvm command in a new process, with a timeout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.timeout(300)

PROG = str(Path(__file__).with_name("progs.py"))
TIMEOUT = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args: str, progress: str = "none") -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-P", "-m", "flowvm", *args, "--progress", progress],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own process group, as a terminal's command


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"no end within {timeout} s: {err[-2000:]}")
    return proc.returncode, out, err


@pytest.mark.parametrize("flags", [[], ["--node-rank", "{node}"]], ids=["c10d", "static"])
def test_two_launchers_with_one_endpoint_join_one_run(flags):
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [start("run", PROG, "--set", "epochs=1", "--nnodes", "2", "--rdzv-endpoint", endpoint,
                   "--nproc-per-node", "1", *[f.format(node=node) for f in flags]) for node in range(2)]
    results = [finish(p) for p in procs]
    for code, _, err in results:
        assert code == 0, err[-3000:]
    assert sum(out.count("weights ") for _, out, _ in results) == 1  # one group of two ranks: rank 0 reports


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_launcher_waiting_for_the_other_hosts_says_so_and_ends_on_a_signal(sig):
    endpoint = f"127.0.0.1:{free_port()}"
    proc = start("run", PROG, "--nnodes", "2", "--rdzv", endpoint, "--nproc", "1")
    try:
        line = proc.stderr.readline()
        assert line.startswith(f"flowvm: waiting for 2 hosts at {endpoint}"), line
        time.sleep(2)  # in the rendezvous
        proc.send_signal(sig)
        code, _, err = finish(proc, timeout=20)
    finally:
        proc.kill()
    assert code == 128 + sig, err[-3000:]


def test_a_second_launch_on_a_checkpoint_in_use_is_refused_naming_the_holder(tmp_path):
    from flowvm.persist.lock import holding

    ckpt = tmp_path / "run"
    code, _, err = finish(start("run", PROG, "--nproc", "2", "--checkpoint", str(ckpt), "--max-steps", "6"))
    assert code == 0, err[-3000:]
    with holding(ckpt):  # as a run resuming it would
        code, out, err = finish(start("resume", str(ckpt)))
        assert code == 2, err[-3000:]
        assert f"process {os.getpid()}" in err and "in use" in err
    assert "weights" not in out
    assert not (tmp_path / ".run.lock").exists()


def test_a_rank_stopped_by_sigterm_ends_the_run_even_with_restarts_left(tmp_path):
    ckpt = tmp_path / "run"
    code, _, err = finish(start("run", PROG, "--nproc", "2", "--checkpoint", str(ckpt), "--sync-every", "4",
                                "--max-restarts", "2", "--set", "fault='term'", "--set", "at=7"))
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert err.count("stopped by SIGTERM") == 1, err[-3000:]
    saved = json.loads((ckpt / "manifest.json").read_text())
    assert not saved["done"] and saved["steps"] < 36  # not restarted and trained on


def test_a_killed_rank_0_is_blamed_not_the_rank_that_lost_it():
    code, _, err = finish(start("run", PROG, "--nproc", "2", "--set", "fault='kill'", "--set", "who=0"))
    assert code == 1
    assert "flowvm: rank 0 failed (exit code -9): killed by SIGKILL" in err, err[-3000:]
    assert "rank 1 failed" not in err


def test_ctrl_c_then_sigterm_is_reported_as_the_first_signal_once(tmp_path):
    ckpt = tmp_path / "run"
    proc = start("run", PROG, "--nproc", "2", "--checkpoint", str(ckpt), "--every", "12", "--set", "epochs=100000")
    try:
        deadline = time.monotonic() + 60
        while not (ckpt / "manifest.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the launcher and its ranks
        time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGTERM)  # and the SIGTERM that may follow it (the agent's, a supervisor's)
        code, _, err = finish(proc, timeout=60)
    finally:
        proc.kill()
    assert code == 128 + signal.SIGINT, err[-3000:]
    assert err.count("stopped by SIGINT") == 1 and "stopped by SIGTERM" not in err, err[-3000:]


def test_one_rank_is_said_in_the_singular():
    code, _, err = finish(start("run", PROG, "--nproc", "1", "--set", "epochs=1", progress="lines"))
    assert code == 0, err[-3000:]
    assert "flowvm: running from step 0 on 1 rank\n" in err, err[-3000:]


def test_launch_from_python_raises_one_rank_error_without_torchs_traceback(tmp_path):
    script = tmp_path / "main.py"
    script.write_text("import progs\nfrom flowvm.distributed import launch, RankError\n"
                      "if __name__ == '__main__':\n"
                      "    try:\n"
                      "        launch(progs.build, nproc=2, options={'fault': 'raise', 'epochs': 1})\n"
                      "    except RankError as err:\n"
                      "        print('raised', err)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(PROG).parent))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert "raised rank 1 failed (exit code 1): ValueError: boom at update 5" in done.stdout, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_show_and_plot_of_a_run_folder_read_its_complete_step(tmp_path):
    ckpt = tmp_path / "run"
    code, _, err = finish(start("run", PROG, "--nproc", "2", "--checkpoint", str(ckpt), "--max-steps", "6",
                                "--history", "loss"))
    assert code == 0, err[-3000:]
    shown = subprocess.run([sys.executable, "-P", "-m", "flowvm", "show", str(ckpt)], capture_output=True,
                           text=True, timeout=TIMEOUT)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "/step-00000006-" in shown.stdout and "# flowvm driver: step 6 " in shown.stdout, shown.stdout
    plotted = subprocess.run([sys.executable, "-P", "-m", "flowvm", "plot", str(ckpt), "-o",
                              str(tmp_path / "loss.png")], capture_output=True, text=True, timeout=TIMEOUT)
    assert plotted.returncode == 0, plotted.stderr[-3000:]
    assert (tmp_path / "loss.png").stat().st_size > 0
