"""Data-parallel runs of two ranks on this machine (gloo on 127.0.0.1, ports chosen free by the rendezvous):
exact resume at several cut points, a rank killed and the group restarted, a hung rank, a raising rank, a
SIGTERM to one rank, a resume with another number of ranks, the bundled mlp.  Each run is the flowvm command
in a new process (the installed package), with a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moto_s3 import moto_endpoint, s3_bucket  # noqa: F401  (fixtures)

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.timeout(300)

PROG = str(Path(__file__).with_name("progs.py"))
TIMEOUT = 120


def flowvm(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-P", "-m", "flowvm", *args, "--progress", "none"],
                          capture_output=True, text=True, timeout=timeout, env=env)


def weights(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("weights ")]
    assert len(lines) == 1, done.stdout  # rank 0 reports, once
    return lines[0]


def manifest(location: Path) -> dict:
    return json.loads((location / "manifest.json").read_text())


@pytest.fixture(scope="module")
def reference() -> str:
    """The final weights of the uninterrupted two-rank run (hex floats), launched by a plain torchrun."""
    done = subprocess.run([sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2", "-m", "flowvm", "run", PROG, "--progress", "none"],
                          capture_output=True, text=True, timeout=TIMEOUT)
    return weights(done)


def test_resume_at_several_cut_points_is_exact(reference, tmp_path):
    ckpt = tmp_path / "run"
    # step 7: a rank has taken its third batch but not trained on it; step 18: the end of the first epoch
    first = flowvm("run", PROG, "--nproc", "2", "--checkpoint", str(ckpt), "--sync-every", "4", "--max-steps", "7")
    assert first.returncode == 0, first.stderr[-3000:]
    assert manifest(ckpt)["steps"] == 7 and manifest(ckpt)["world_size"] == 2
    second = flowvm("resume", str(ckpt), "--max-steps", "11")
    assert second.returncode == 0, second.stderr[-3000:]
    assert manifest(ckpt)["steps"] == 18
    assert weights(flowvm("resume", str(ckpt))) == reference
    assert manifest(ckpt)["done"]
    assert len([p for p in ckpt.iterdir() if p.name.startswith("step-")]) == 1  # older saves removed


def test_a_killed_rank_is_restarted_from_the_last_checkpoint(reference, tmp_path):
    ckpt, log = tmp_path / "run", tmp_path / "log"
    log.mkdir()
    done = flowvm("run", PROG, "--nproc", "2", "--checkpoint", str(ckpt), "--every", "6", "--sync-every", "3",
                  "--max-restarts", "1", "--set", "fault='kill'", "--set", "at=4", "--set", f"log={str(log)!r}")
    assert weights(done) == reference
    lines = (log / "rank-1.txt").read_text().splitlines()
    assert len(lines) > 18  # the updates after the last checkpoint ran twice: the group was restarted
    assert manifest(ckpt)["done"]


def test_a_hung_rank_is_an_error_within_the_timeout(tmp_path):
    start = time.monotonic()
    done = flowvm("run", PROG, "--nproc", "2", "--dist-timeout", "3", "--set", "fault='hang'", timeout=90)
    assert done.returncode == 2, done.stderr[-3000:]
    assert time.monotonic() - start < 60
    # the hung rank is blamed, not the one whose collective timed out waiting for it
    assert "rank 1 failed" in done.stderr and "hung" in done.stderr, done.stderr[-3000:]
    assert "timed out" in done.stderr.lower() and "rank 0 failed" not in done.stderr


def test_a_raising_rank_stops_every_rank_and_is_reported_once(tmp_path):
    ckpt = tmp_path / "run"
    done = flowvm("run", PROG, "--nproc", "2", "--checkpoint", str(ckpt), "--every", "6", "--sync-every", "3",
                  "--set", "fault='raise'", "--set", "at=5")
    assert done.returncode == 1
    assert done.stderr.count("ValueError: boom at update 5") == 1, done.stderr[-3000:]
    assert done.stderr.count("flowvm: rank 1 failed") == 1
    assert "rank 0 failed" not in done.stderr
    assert manifest(ckpt)["steps"] == 12 and not manifest(ckpt)["done"]  # the last complete save is kept


def test_sigterm_to_one_rank_is_one_checkpoint_of_every_rank_on_s3(reference, s3_bucket):
    import s3fs

    location = f"s3://{s3_bucket}/runs/linear"
    stopped = flowvm("run", PROG, "--nproc", "2", "--checkpoint", location, "--sync-every", "4",
                     "--set", "fault='term'", "--set", "at=7")
    assert stopped.returncode == 128 + 15, stopped.stderr[-3000:]
    assert stopped.stderr.count("stopped by SIGTERM") == 1
    fs = s3fs.S3FileSystem()
    saved = json.loads(fs.cat_file(f"{s3_bucket}/runs/linear/manifest.json"))
    assert not saved["done"] and saved["steps"] % 4 == 0 and saved["steps"] >= 21  # the next agreement
    assert len(saved["parts"]) == 2
    assert weights(flowvm("resume", location)) == reference


def test_resume_with_another_number_of_ranks_skips_and_repeats_no_sample(tmp_path):
    ckpt, log = tmp_path / "run", tmp_path / "log"
    log.mkdir()
    first = flowvm("run", PROG, "--nproc", "2", "--checkpoint", str(ckpt), "--sync-every", "3", "--max-steps", "9",
                   "--set", f"log={str(log)!r}")
    assert first.returncode == 0, first.stderr[-3000:]
    rest = flowvm("resume", str(ckpt), "--nproc", "1")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert manifest(ckpt)["world_size"] == 1
    seen: dict[int, list[int]] = {}
    for path in log.iterdir():
        for line in path.read_text().splitlines():
            epoch, *ids = map(int, line.split())
            seen.setdefault(epoch, []).extend(ids)
    # every sample of every epoch once, the cut one too: the resumed rank took the rest of the two ranks'
    # global batches, as many as the program's loops (counted by len(batches) when two ranks built it) take
    assert sorted(seen) == [0, 1, 2]
    for epoch in range(3):
        assert sorted(seen[epoch]) == list(range(96)), epoch


def test_the_bundled_mlp_trains_on_two_ranks(tmp_path):
    ckpt = tmp_path / "mlp"
    done = flowvm("run", "mlp", "--nproc", "2", "--set", "epochs=10", "--checkpoint", str(ckpt))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("MLP on spirals") == 1  # rank 0 reports
    accuracy = float(done.stdout.split("accuracy ")[1].split()[0])
    assert accuracy > 0.8
    assert manifest(ckpt)["world_size"] == 2 and manifest(ckpt)["done"]


def test_the_users_data_reaches_every_rank_and_is_recorded_as_given(tmp_path):
    from sklearn.datasets import load_iris

    iris = load_iris()
    data = tmp_path / "iris.npz"
    import numpy as np
    np.savez(data, x=iris.data.astype(np.float32), y=iris.target)
    ckpt = tmp_path / "mlp"
    done = flowvm("run", "mlp", "--nproc", "2", "--data", str(data), "--set", "epochs=2", "--checkpoint", str(ckpt))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "iris.npz" in done.stdout and done.stdout.count("MLP on") == 1
    meta = manifest(ckpt)["meta"]
    assert meta["data"] == str(data.resolve()) and not any(s.startswith("data=") for s in meta["sets"])


def test_batches_whose_last_batch_leaves_a_rank_without_a_sample_are_refused_before_the_run():
    # 97 samples in global batches of 16 (8 a rank): the last holds one sample, none for rank 1
    done = flowvm("run", PROG, "--nproc", "2", "--set", "samples=97")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "the last batch of all 2 ranks together holds 1 sample (97 samples in global batches of 16), so rank 1 " \
           "and above would take an empty batch" in done.stderr, done.stderr[-3000:]
    assert "drop_last=True" in done.stderr


def test_ranks_whose_programs_take_different_steps_are_refused_before_they_run():
    done = flowvm("run", PROG, "--nproc", "2", "--set", "uneven=1")  # rank 1 loops over 7 batches an epoch, not 6
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "the ranks' programs take different numbers of steps (55 to 64" in done.stderr, done.stderr[-3000:]
    assert "look for a loop count that depends on the rank" in done.stderr


def test_batches_of_unequal_last_shards_train_on_every_sample_of_every_epoch(tmp_path):
    # 98 samples: the last global batch holds 2, one a rank; both ranks take 7 batches an epoch
    log = tmp_path / "log"
    log.mkdir()
    done = flowvm("run", PROG, "--nproc", "2", "--set", "samples=98", "--set", f"log={str(log)!r}")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {r: (log / f"rank-{r}.txt").read_text().splitlines() for r in (0, 1)}
    assert len(lines[0]) == len(lines[1]) == 3 * 7
    for epoch in range(3):
        ids = [int(i) for r in (0, 1) for line in lines[r] if int(line.split()[0]) == epoch for i in line.split()[1:]]
        assert sorted(ids) == list(range(98)), epoch




def test_a_plain_python_loop_trains_on_two_ranks_and_resumes_bit_for_bit(tmp_path):
    # @flowvm.program under --nproc: the same weights straight and stopped, saved on both ranks and resumed
    prog = str(Path(__file__).with_name("progs_pyfunc.py"))
    straight = weights(flowvm("run", prog, "--nproc", "2"))
    ckpt = tmp_path / "run"
    first = flowvm("run", prog, "--nproc", "2", "--checkpoint", str(ckpt), "--sync-every", "5", "--max-steps", "60")
    assert first.returncode == 0, first.stderr[-3000:]
    assert manifest(ckpt)["steps"] == 60 and manifest(ckpt)["world_size"] == 2 and not manifest(ckpt)["done"]
    assert weights(flowvm("resume", str(ckpt))) == straight
    assert manifest(ckpt)["done"]
