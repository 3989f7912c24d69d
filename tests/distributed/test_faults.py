"""Faults a user can cause to a data-parallel run, from the outside: bad options, a taken rendezvous port, and
damaged coordinated checkpoints.  Each is one line starting ``flowvm:``, exit status 2, no traceback, no rank
left running, and the checkpoint as it was (a good copy of it resumes exactly)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flowvm import CheckpointError

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.timeout(600)

PROG = Path(__file__).with_name("progs_replicas.py")
BASE = ["--set", "wrap=True", "--sync-every", "2"]


def flowvm(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "flowvm", *map(str, args), "--progress", "none"],
                          capture_output=True, text=True, timeout=180, env=dict(os.environ, **(env or {})))


def refused_in_one_line(done: subprocess.CompletedProcess, words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("flowvm: ") and words in lines[0], done.stderr[-3000:]


def no_rank_left() -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        mine = [p for p in psutil.process_iter(["cmdline"])
                if p.info["cmdline"] and str(PROG) in " ".join(p.info["cmdline"]) and p.pid != os.getpid()]
        if not mine:
            return
        time.sleep(0.1)
    raise AssertionError(f"ranks left running: {[p.pid for p in mine]}")


@pytest.mark.parametrize("args, env, words", [
    (["--nproc", "0"], {}, "--nproc must be >= 1, got 0"),
    (["--nproc", "100000"], {}, "--nproc 100000 is more ranks than this host can run usefully: at most"),
    (["--nproc", "2", "--sync-every", "0"], {}, "--sync-every must be >= 1"),
    (["--nproc", "2", "--dist-timeout", "-1"], {}, "timeout must be > 0 seconds"),
    (["--nproc", "2"], {"FLOWVM_DIST_TIMEOUT": "abc"}, "$FLOWVM_DIST_TIMEOUT must be a number of seconds, got 'abc'"),
    (["--nproc", "2"], {"FLOWVM_DIST_TIMEOUT": "-1"}, "timeout must be > 0 seconds"),
    (["--nproc", "2", "--set", "epochs=1e999"], {}, "option 'epochs' takes an int"),
])
def test_bad_options_are_one_line_and_status_2(args, env, words):
    refused_in_one_line(flowvm("run", PROG, *args, env=env), words)
    no_rank_left()


def test_a_taken_rendezvous_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused_in_one_line(flowvm("run", PROG, "--nproc", "2", "--rdzv", f"127.0.0.1:{port}"),
                            f"--rdzv 127.0.0.1:{port}: this host cannot serve the rendezvous there")
    no_rank_left()


def test_a_port_held_by_the_launcher_of_another_host_of_the_run_is_no_refusal():
    """Hosts meeting without node ranks: the first launcher started on this machine serves the rendezvous on
    the port, and the next one, of the same run, must join it, not refuse the port as taken."""
    with socket.socket() as first:  # as the first launcher serving the rendezvous holds it
        first.bind(("127.0.0.1", 0))
        first.listen()
        port = first.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-P", "-m", "flowvm", "run", str(PROG), "--nnodes", "2",
                                 "--rdzv", f"127.0.0.1:{port}", "--nproc", "1", "--progress", "none"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stderr.readline()
        finally:
            proc.kill()
            proc.communicate()
    assert line.startswith(f"flowvm: waiting for 2 hosts at 127.0.0.1:{port}"), line


def _damage_folder(run: Path) -> Path:
    return run / json.loads((run / "manifest.json").read_text())["folder"]


DAMAGES = {
    "a rank's part deleted": (lambda run: (_damage_folder(run) / "rank-00001.json").unlink(), "rank-00001.json"),
    "a rank's part flipped": (lambda run: _flip(_damage_folder(run) / "rank-00000.json"), "checksum differs"),
    "the shared run cut": (lambda run: _cut(_damage_folder(run) / "shared.ckpt"), "shared.ckpt"),
    "a junk manifest": (lambda run: (run / "manifest.json").write_text(
        json.dumps({"format": json.loads((run / "manifest.json").read_text())["format"], "junk": 1})),
        "corrupted manifest: 'folder'"),
    "a manifest that is no JSON": (lambda run: (run / "manifest.json").write_text("{not json"), "corrupted manifest"),
}


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-rank run paused at step 6 with its checkpoint, and the uninterrupted run's weights."""
    base = tmp_path_factory.mktemp("faults")
    straight = flowvm("run", PROG, "--nproc", "2", *BASE)
    assert straight.returncode == 0, straight.stderr[-3000:]
    run = base / "run"
    paused = flowvm("run", PROG, "--nproc", "2", *BASE, "--checkpoint", run, "--max-steps", "6")
    assert paused.returncode == 0, paused.stderr[-3000:]
    weights = [line for line in straight.stdout.splitlines() if line.startswith("weights ")]
    return run, weights


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_checkpoint_is_one_line_and_a_good_copy_resumes_exactly(saved, tmp_path, damage):
    run, weights = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    spoil, words = DAMAGES[damage]
    spoil(copy)
    refused_in_one_line(flowvm("resume", copy), words)
    no_rank_left()
    good = tmp_path / "good"
    shutil.copytree(run, good)
    resumed = flowvm("resume", good)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [line for line in resumed.stdout.splitlines() if line.startswith("weights ")] == weights


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 16 kB (root makes it; the test is root's, as CI's is)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True)
    assert done.returncode == 0, f"cannot mount a small tmpfs: {done.stderr!r}"
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_coordinated_save_is_one_line(small_disk):
    done = flowvm("run", PROG, "--nproc", "2", *BASE, "--checkpoint", small_disk / "run", "--every", "4")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.strip().splitlines() if line.startswith("flowvm: ")]
    assert len(lines) == 1 and "could not save" in lines[0] and "No space left on device" in lines[0], \
        done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    no_rank_left()


def test_ranks_die_with_their_launcher_and_a_resume_then_continues_exactly(tmp_path, saved):
    import signal

    _, weights = saved
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-P", "-m", "flowvm", "run", str(PROG), "--nproc", "2", *BASE,
                             "--set", "epochs=400", "--checkpoint", str(run), "--every", "8", "--progress", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run / "manifest.json").exists():  # the ranks run and have saved once
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    ranks = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert ranks
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in ranks):
        assert time.monotonic() < deadline, "ranks outlived their launcher"
        time.sleep(0.05)
    resumed = flowvm("resume", run, "--max-steps", "4")  # the lock is free: the ranks are gone
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # exactly: the uninterrupted run stopped at the same step holds the same model, bit for bit
    straight = tmp_path / "straight"
    stopped = flowvm("run", PROG, "--nproc", "2", *BASE, "--set", "epochs=400", "--checkpoint", straight,
                     "--max-steps", str(_steps(run)))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert _steps(straight) == _steps(run)
    assert _model(straight) == _model(run)


def _steps(location: Path) -> int:
    return json.loads((location / "manifest.json").read_text())["steps"]


def _model(location: Path) -> list:
    """The run's model and optimizer as rank 0 saved them: their tensors' bytes, in order."""
    import torch

    import flowvm as fv

    folder = json.loads((location / "manifest.json").read_text())["folder"]
    regs = fv.load(location / folder / "shared.ckpt").registers
    net = next(v for v in regs.values() if isinstance(v, torch.nn.Module))
    opt = next(v for v in regs.values() if isinstance(v, torch.optim.Optimizer))
    tensors = list(net.state_dict().values()) + [t for s in opt.state_dict()["state"].values()
                                                 for t in s.values() if isinstance(t, torch.Tensor)]
    return [t.detach().numpy().tobytes() for t in tensors]


def test_a_lock_is_not_free_while_ranks_of_a_dead_launcher_live(tmp_path):
    from flowvm.persist.lock import holding

    run = tmp_path / "run"
    rank = subprocess.Popen([sys.executable, "-c", "import sys, time; from flowvm.persist.lock import hold_as_rank; "
                             "hold_as_rank(sys.argv[1]); print('held', flush=True); time.sleep(60)", str(run)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match="ranks of an earlier run still save here"):
            with holding(run):
                pass
    finally:
        rank.kill()
        rank.wait()
    with holding(run):  # the rank is gone: free
        pass
    assert not (tmp_path / ".run.ranks.lock").exists()


def test_a_rank_failure_is_reported_without_the_agents_log_lines():
    import re

    done = flowvm("run", Path(__file__).with_name("progs.py"), "--nproc", "2", "--set", "fault='raise'",
                  "--set", "at=5")
    assert done.returncode == 1 and "flowvm: rank 1 failed" in done.stderr, done.stderr[-3000:]
    assert not [line for line in done.stderr.splitlines() if re.match(r"[WE]\d{4} ", line)], done.stderr[-3000:]


def test_a_signal_after_every_rank_finished_is_no_stop():
    import signal

    proc = subprocess.Popen([sys.executable, "-P", "-m", "flowvm", "run", str(PROG), "--nproc", "2", *BASE,
                             "--progress", "none"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # rank 0's report: the run has finished
        if line.startswith("weights "):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    no_rank_left()


def test_a_rank_stopped_with_sigstop_is_named_hung_not_killed():
    import signal
    from types import SimpleNamespace

    from flowvm.distributed.agent import KIND, culprit, rank_failure

    def failure(code, message="", kind=None, at=0.0):
        data = {"message": {"extraInfo": {KIND: kind}}} if kind else {}
        return SimpleNamespace(exitcode=code, message=message, error_file_data=data, timestamp=at)

    # rank 0's collective timed out waiting; the agent's SIGTERM did nothing to the stopped rank 1: SIGKILL
    stopped = {0: failure(1, "RuntimeError: Timed out waiting 3000ms for recv", "group", 1.0),
               1: failure(-signal.SIGKILL, at=2.0)}
    assert culprit(stopped) == (1, "hung")
    assert "hung: it never joined a collective" in str(rank_failure(SimpleNamespace(failures=stopped)))
    # killed from outside: the others' connections break, they do not time out
    killed = {0: failure(1, "RuntimeError: Connection closed by peer", "group", 2.0),
              1: failure(-signal.SIGKILL, at=1.0)}
    assert culprit(killed) == (1, "killed")


def test_a_rank_stopped_with_sigstop_from_outside_is_one_line_status_2_and_the_run_resumes(tmp_path):
    import signal

    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-P", "-m", "flowvm", "run", str(PROG), "--nproc", "2", *BASE,
                             "--set", "epochs=400", "--checkpoint", str(run), "--every", "8", "--dist-timeout", "3",
                             "--progress", "none"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run / "manifest.json").exists():  # the ranks run and have saved once
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    ranks = [c for c in psutil.Process(proc.pid).children(recursive=True) if c.environ().get("RANK") == "1"]
    assert len(ranks) == 1
    ranks[0].send_signal(signal.SIGSTOP)  # rank 1 never joins another collective, nor ends on SIGTERM
    _, err = proc.communicate(timeout=180)
    lines = err.strip().splitlines()
    assert proc.returncode == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("flowvm: rank 1 failed (exit code -9): hung: it never joined "
                                                   "a collective, and rank 0's failed waiting for it"), err[-3000:]
    no_rank_left()
    resumed = flowvm("resume", run, "--max-steps", "4")  # the last complete checkpoint is kept and resumes
    assert resumed.returncode == 0, resumed.stderr[-3000:]
