"""Checkpoints on shared storage: fsspec URLs, S3 against a real S3 API server (moto's, on 127.0.0.1).

The S3 tests start ``python -m moto.server`` on a free loopback port for the module and point the AWS
environment variables (``AWS_ENDPOINT_URL`` included) at it, so that this process and the ``flowvm``
commands it starts talk to it as they would to S3.  The crash test SIGKILLs ``flowvm run``/``resume``
while they upload a ~30 MB checkpoint in 5 MB parts, and checks that the object under the final name is
never partial and that the resumed run ends as an uninterrupted one.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import flowvm
from flowvm.persist import remote
from flowvm.persist import storage
from flowvm.programs import pca
from flowvm.testing import diff, outcome

from moto_s3 import moto_endpoint, s3_bucket  # noqa: F401  (fixtures)
from toy import COMMAND, ROOT, flowvm_cmd, saved

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import fsspec  # noqa: E402  (s3fs needs it: installed when s3fs is)
from fsspec.implementations.local import LocalFileSystem  # noqa: E402

SMALL_PCA = {"batches": 3, "samples": 40, "dim": 4, "components": 2}


# ------------------------------------------------------------------ the S3 server
@pytest.fixture
def s3(s3_bucket, moto_endpoint):
    """A new, empty bucket on the moto server (tests/moto_s3.py) and a filesystem on it."""
    return s3_bucket, s3fs.S3FileSystem(endpoint_url=moto_endpoint)


def half_run_pca(steps: int = 7):
    drv = pca.build(**SMALL_PCA).start()
    drv.run(max_steps=steps)
    return drv


def straight_pca() -> dict:
    drv = pca.build(**SMALL_PCA).start()
    drv.run()
    return outcome(drv)


def finish(drv) -> dict:
    drv.run()
    return outcome(drv)


def pending_uploads(fs, bucket: str, key: str) -> set[str]:
    out = fs.call_s3("list_multipart_uploads", Bucket=bucket)
    return {u["UploadId"] for u in out.get("Uploads", []) if u["Key"] == key}


# ------------------------------------------------------------------ round trips and errors
def test_save_and_load_round_trip_through_s3(s3):
    bucket, fs = s3
    url = f"s3://{bucket}/runs/pca.ckpt"
    assert flowvm.save(half_run_pca(), url, meta={"node": "a"}) == url
    header = flowvm.read_header(url)
    assert header["steps"] == 7 and header["meta"] == {"node": "a"}
    assert fs.cat_file(f"{bucket}/runs/pca.ckpt")[:8] == flowvm.persist.checkpoint.MAGIC
    assert not diff(straight_pca(), finish(flowvm.load(url)))
    # saving again replaces the object; a signed one needs its key
    flowvm.save(half_run_pca(11), url, key="k")
    assert flowvm.read_header(url, key="k")["steps"] == 11
    with pytest.raises(flowvm.CheckpointError, match="signed"):
        flowvm.load(url)


def test_save_and_load_round_trip_through_memory():
    url = f"memory://flowvm-tests/{os.getpid()}/pca.ckpt"
    assert flowvm.save(half_run_pca(), url) == url
    assert storage.read_start(url, 8) == flowvm.persist.checkpoint.MAGIC
    assert not diff(straight_pca(), finish(flowvm.load(url)))


def test_file_urls_are_local_paths(tmp_path):
    path = tmp_path / "pca.ckpt"
    assert flowvm.save(half_run_pca(), f"file://{path}") == path
    assert not diff(straight_pca(), finish(flowvm.load(path)))
    assert storage.local_path(f"file://localhost{path}") == path


def test_missing_objects_buckets_and_credentials_are_named(s3, monkeypatch):
    bucket, _ = s3
    url = f"s3://{bucket}/nothing/here.ckpt"
    with pytest.raises(flowvm.CheckpointError, match=f"checkpoint '{url}': no such object"):
        flowvm.load(url)
    with pytest.raises(flowvm.CheckpointError, match="checkpoint 's3://no-such-bucket-xyz/a.ckpt': no such bucket"):
        flowvm.read_header("s3://no-such-bucket-xyz/a.ckpt")
    with pytest.raises(flowvm.CheckpointError, match="'s3://no-such-bucket-xyz/a.ckpt': cannot save: no such bucket"):
        flowvm.save(half_run_pca(), "s3://no-such-bucket-xyz/a.ckpt")
    with pytest.raises(flowvm.CheckpointError, match=f"'s3://{bucket}/': names a bucket or a directory"):
        flowvm.save(half_run_pca(), f"s3://{bucket}/")
    with pytest.raises(flowvm.CheckpointError, match="memory://nowhere/x.ckpt': no such object"):
        flowvm.load("memory://nowhere/x.ckpt")
    with pytest.raises(flowvm.CheckpointError, match="unsupported URL: Protocol not known: nosuchproto"):
        flowvm.load("nosuchproto://a/b")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(flowvm.CheckpointError, match=f"'{url}': no credentials .*AWS_ACCESS_KEY_ID"):
        flowvm.load(url)


def test_a_url_without_fsspec_says_what_to_install(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "fsspec" or m.startswith("fsspec.")]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it now fails, as when it is not installed
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(flowvm.CheckpointError, match=r"s3:// URLs need fsspec.*pip install 'flowvm\[s3\]'"):
        flowvm.load("s3://bucket/run.ckpt")
    with pytest.raises(flowvm.CheckpointError, match=r"pip install 'flowvm\[s3\]'"):
        flowvm.save(half_run_pca(), "s3://bucket/run.ckpt")
    flowvm.save(half_run_pca(), tmp_path / "local.ckpt")  # local paths never need it
    assert flowvm.read_header(tmp_path / "local.ckpt")["steps"] == 7


def test_a_url_without_its_filesystem_package_says_what_to_install():
    code = textwrap.dedent("""\
        import sys
        sys.modules["s3fs"] = None  # as if it were not installed
        import flowvm
        try:
            flowvm.load("s3://bucket/run.ckpt")
        except flowvm.CheckpointError as err:
            print(err)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "checkpoint 's3://bucket/run.ckpt': s3:// URLs need a package that is not installed" in out.stdout
    assert "pip install 'flowvm[s3]'" in out.stdout


@pytest.mark.parametrize("code, words", [
    ("AccessDenied", "access denied (AccessDenied"),
    ("InvalidAccessKeyId", "access denied (InvalidAccessKeyId"),
    ("NoSuchBucket", "no such bucket 'bkt'"),
    ("NoSuchKey", "no such object"),
])
def test_s3_service_errors_are_put_in_words(code, words):
    """What S3 answers, as s3fs raises it (moto's server accepts any credentials: access is never denied)."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    err = translate_boto_error(ClientError({"Error": {"Code": code, "Message": "from the server"}}, "GetObject"))
    assert remote._reason(err, "s3://bkt/run.ckpt").startswith(words)


def test_local_checkpoints_do_not_import_fsspec(tmp_path):
    code = textwrap.dedent(f"""\
        import sys, flowvm
        from flowvm.programs import pca
        drv = pca.build(batches=2, samples=20, dim=3, components=2).start()
        drv.run(max_steps=3)
        flowvm.save(drv, {str(tmp_path / 'a.ckpt')!r})
        flowvm.load({str(tmp_path / 'a.ckpt')!r})
        assert "fsspec" not in sys.modules, "fsspec imported for a local checkpoint"
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------------ atomicity, in process
def test_a_failed_s3_save_is_aborted_not_committed(s3, monkeypatch):
    """fsspec's files complete their upload when closed, also by ``with`` on an exception or by the
    garbage collector: a failed save must abort it, leaving the previous object and no pending upload."""
    bucket, fs = s3
    monkeypatch.setitem(fsspec.config.conf, "s3", {"default_block_size": 5 * 2**20})  # multipart
    url, key = f"s3://{bucket}/run.ckpt", "run.ckpt"
    flowvm.save(half_run_pca(), url)
    before = fs.cat_file(f"{bucket}/{key}")

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with storage.open_write(url) as f:
            f.write(b"x" * (12 * 2**20))  # two 5 MB parts uploaded already
            assert pending_uploads(fs, bucket, key)
            raise Boom
    gc.collect()
    assert fs.cat_file(f"{bucket}/{key}") == before
    assert not pending_uploads(fs, bucket, key)
    # a driver that cannot be pickled: nothing is written either
    drv = half_run_pca()
    drv.registers["bad"] = threading.Lock()
    with pytest.raises(flowvm.CheckpointError, match="registers/bad holds a _thread.lock"):
        flowvm.save(drv, url)
    gc.collect()
    assert fs.cat_file(f"{bucket}/{key}") == before


def test_a_save_aborts_uploads_that_killed_saves_left(s3):
    bucket, fs = s3
    orphan = fs.call_s3("create_multipart_upload", Bucket=bucket, Key="run.ckpt")["UploadId"]
    other = fs.call_s3("create_multipart_upload", Bucket=bucket, Key="run.ckpt.other")["UploadId"]
    flowvm.save(half_run_pca(), f"s3://{bucket}/run.ckpt")
    assert orphan not in pending_uploads(fs, bucket, "run.ckpt")
    assert other in pending_uploads(fs, bucket, "run.ckpt.other")  # another object's upload is left alone


class MoveTestFileSystem(LocalFileSystem):
    """A local filesystem under its own protocol: one that is not an object store, so saves write a
    temporary beside the target and move it over."""

    protocol = ("movetest",)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return super()._strip_protocol(path[len("movetest://"):] if path.startswith("movetest://") else path)


def test_other_filesystems_write_a_temporary_and_move_it_over(tmp_path, monkeypatch):
    fsspec.register_implementation("movetest", MoveTestFileSystem, clobber=True)
    url = f"movetest://{tmp_path}/run.ckpt"
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f".run.ckpt.{host}-{dead.pid}-0a0a0a.tmp"  # a killed save's temporary
    alive = tmp_path / f".run.ckpt.{host}-{os.getppid()}-0b0b0b.tmp"  # perhaps saving right now
    left.write_bytes(b"partial")
    alive.write_bytes(b"partial")
    moves = []
    monkeypatch.setattr(MoveTestFileSystem, "mv", lambda self, a, b, **kw: moves.append((a, b)) or os.replace(a, b))
    assert flowvm.save(half_run_pca(), url) == url
    assert len(moves) == 1 and moves[0][1] == f"{tmp_path}/run.ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run.ckpt", alive.name])
    before = (tmp_path / "run.ckpt").read_bytes()
    with pytest.raises(RuntimeError):
        with storage.open_write(url) as f:
            f.write(b"new and partial")
            raise RuntimeError
    assert (tmp_path / "run.ckpt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run.ckpt", alive.name])
    assert not diff(straight_pca(), finish(flowvm.load(url)))


# ------------------------------------------------------------------ the command, SIGKILLed mid-upload
BIG_PROGRAM = '''\
"""A run whose checkpoint is large: a register of `mb` megabytes that every step changes."""
import random

import numpy as np

from flowvm import CALL, REPEAT, Registers


def step(big, total):
    i = (total * 7919) % big.size
    big[i] ^= 0x5A  # in place: the checkpoint holds the array as it was when saved
    return (total * 31 + int(big[i]) + int(random.random() * 1000)) % 1_000_003


def build(steps=3000, mb=30):
    random.seed(7)
    reg = Registers(big=np.random.default_rng(0).integers(0, 256, mb << 20, dtype=np.uint8), total=1)
    return REPEAT(steps, CALL(step, reg("big"), reg("total"), store_to=reg("total")))
'''


def test_sigkill_during_s3_uploads_never_leaves_a_partial_checkpoint(s3, tmp_path, monkeypatch):
    bucket, fs = s3
    key = "run.ckpt"
    url = f"s3://{bucket}/{key}"
    (tmp_path / "bigreg.py").write_text(BIG_PROGRAM)
    monkeypatch.syspath_prepend(str(tmp_path))  # to load its checkpoints here
    options = {"steps": 3000, "mb": 30}
    sets = [a for k, v in options.items() for a in ("--set", f"{k}={v}")]
    # 5 MB parts: a 30 MB checkpoint is uploaded as a multipart upload of six
    monkeypatch.setenv("FSSPEC_S3", '{"default_block_size": 5242880}')
    every = ["--every", "300", "--progress", "none"]

    seen_reads = {"whole": 0, "missing": 0}
    stop_reading = threading.Event()
    problems = []

    def reader():
        """Read the object over and over while runs write it: it is absent or whole, never partial."""
        while not stop_reading.is_set():
            try:
                flowvm.read_header(url)
                seen_reads["whole"] += 1
            except flowvm.CheckpointError as err:
                if err.reason != "no such object":
                    problems.append(str(err))
                seen_reads["missing"] += 1
            stop_reading.wait(0.05)

    watcher = threading.Thread(target=reader, daemon=True)
    watcher.start()
    rng = random.Random(1)
    orphans: set[str] = set()
    mid_upload = 0
    nths = (2, 1, 3, 2)  # which upload of each process is killed
    try:
        for attempt in range(len(nths)):
            resuming = fs.exists(f"{bucket}/{key}")
            args = ["resume", url] if resuming else ["run", str(tmp_path / "bigreg.py"), *sets, "--checkpoint", url]
            proc = subprocess.Popen(COMMAND + args + every, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, cwd=ROOT)
            deadline = time.monotonic() + 30
            nth, started = nths[attempt], set()
            while True:  # wait for this process's nth upload to be under way (the first saves complete)
                uploading = pending_uploads(fs, bucket, key) - orphans
                started |= uploading
                if uploading and len(started) >= nth:
                    break
                if proc.poll() is not None:
                    raise AssertionError(f"flowvm {' '.join(args)} exited {proc.returncode} before it "
                                         f"uploaded:\n{proc.stderr.read()}")
                assert time.monotonic() < deadline, "no upload started within 30 s"
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.05))
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
            pending = pending_uploads(fs, bucket, key)
            mid_upload += bool(uploading & pending)  # killed before the upload it was doing completed
            orphans |= pending
            if fs.exists(f"{bucket}/{key}"):  # whole and loadable, never partial
                header = flowvm.read_header(url)
                assert header["steps"] % 300 == 0 and not header["done"]
                assert flowvm.load(url, restore_random=False).steps == header["steps"]
        assert mid_upload >= 1, "no SIGKILL landed during an upload"

        if fs.exists(f"{bucket}/{key}"):
            out = flowvm_cmd("run", tmp_path / "bigreg.py", *sets, "--checkpoint", url, check=False)
            assert out.returncode == 2 and "holds an unfinished run" in out.stderr  # never replaced silently
            out = flowvm_cmd("resume", url, *every)  # in a fresh process
        else:
            out = flowvm_cmd("run", tmp_path / "bigreg.py", *sets, "--checkpoint", url, *every)
        assert "finished after 3000 steps" in out.stdout
    finally:
        stop_reading.set()
        watcher.join()
    assert not problems, problems
    assert seen_reads["whole"] > 0

    module = __import__("bigreg")
    drv = module.build(**options).start()
    drv.run()
    assert not diff(outcome(drv), saved(url))
    assert not pending_uploads(fs, bucket, key)  # the last saves aborted the uploads the kills left
    shown = flowvm_cmd("show", url)
    assert f"# {url}: {tmp_path / 'bigreg.py'} --set steps=3000 --set mb=30," in shown.stdout


def test_the_command_checks_a_url_before_running(s3, tmp_path):
    bucket, _ = s3
    out = flowvm_cmd("run", "pca", "--checkpoint", "s3://no-such-bucket-xyz/run.ckpt", check=False)
    assert out.returncode == 2 and "--checkpoint s3://no-such-bucket-xyz/run.ckpt: no such bucket" in out.stderr
    out = flowvm_cmd("run", "pca", "--checkpoint", f"s3://{bucket}/", check=False)
    assert out.returncode == 2 and "names a bucket or a directory" in out.stderr
    out = flowvm_cmd("resume", f"s3://{bucket}/missing.ckpt", check=False)
    assert out.returncode == 2 and f"checkpoint 's3://{bucket}/missing.ckpt': no such object" in out.stderr
    url = f"s3://{bucket}/pca.ckpt"
    sets = [a for k, v in SMALL_PCA.items() for a in ("--set", f"{k}={v}")]
    out = flowvm_cmd("run", "pca", *sets, "--checkpoint", url, "--max-steps", 5, "--progress", "none")
    assert f"paused at step 5; continue with `flowvm resume {url}`" in out.stdout
    flowvm_cmd("resume", url, "--progress", "none")
    assert not diff(straight_pca(), saved(url))


def test_a_path_through_a_file_is_no_such_file(tmp_path):
    run = tmp_path / "run.ckpt"
    run.write_bytes(b"x")
    assert storage.read_start(run / "manifest.json", 1, missing_ok=True) is None
    with pytest.raises(flowvm.CheckpointError, match="no such file"):
        flowvm.load(run / "inside.ckpt")
