"""Two hosts: two network namespaces joined by a veth pair (netns.py), one rank group on each, rendezvous
over TCP between their addresses; checkpoints on a folder both hosts see and on an S3 server (moto's,
on host a's address); a run killed on both hosts resumes there and ends as the run never stopped."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from netns import two_hosts  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(900)

PORT = 29617
_ports = itertools.count(29620)  # each launch its own rendezvous port (no wait for a closed one's TIME_WAIT)
CONVNET = ["convnet", "--set", "epochs=8", "--set", "channels=4", "--progress", "none", "--dist-timeout", "60"]
LAUNCH_TIMEOUT = 240

ECHO_SERVER = textwrap.dedent("""
    import socket, sys
    with socket.create_server((sys.argv[1], int(sys.argv[2]))) as server:
        print("listening", flush=True)
        conn, peer = server.accept()
        with conn:
            conn.sendall(conn.recv(64).upper() + b" from " + sys.argv[1].encode())
""")
ECHO_CLIENT = textwrap.dedent("""
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as conn:
        conn.sendall(b"hello")
        print(conn.recv(64).decode())
""")


def test_a_process_on_each_host_reaches_the_other_over_tcp(two_hosts):  # noqa: F811
    a, b = two_hosts
    server = a.popen([sys.executable, "-c", ECHO_SERVER, a.address, PORT], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        done = b.run([sys.executable, "-c", ECHO_CLIENT, a.address, PORT], capture_output=True, text=True,
                     timeout=30)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"HELLO from {a.address}"
        assert server.wait(timeout=10) == 0
    finally:
        server.kill()
        server.wait()
    # the hosts are apart: b's own loopback has no server of a's
    refused = b.run([sys.executable, "-c", ECHO_CLIENT, "127.0.0.1", PORT], capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "ConnectionRefusedError" in refused.stderr


def test_where_namespaces_cannot_be_made_the_reason_is_named(monkeypatch):
    import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.why_not() == "making network namespaces needs root"
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert netns.why_not() == "no `ip` command (iproute2) to make network namespaces"


# ------------------------------------------------------------------ a rank group on each host
class Launch:
    """The same command started on both hosts (one rank each), logs in files."""

    def __init__(self, hosts, command, folder, tag: str, env: dict | None = None):
        self.logs = [folder / f"{tag}-{host.name[-1]}.log" for host in hosts]
        self.procs = []
        for node, (host, log) in enumerate(zip(hosts, self.logs)):
            environment = dict(os.environ, GLOO_SOCKET_IFNAME=host.interface, **(env or {}))
            with open(log, "w") as out:
                self.procs.append(host.popen(command(node), env=environment, stdout=out, stderr=subprocess.STDOUT,
                                             cwd=folder, start_new_session=True))

    def text(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-8000:]}" for log in self.logs)

    def wait(self, timeout: float = LAUNCH_TIMEOUT) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the two hosts' run did not end within {timeout} s:\n{self.text()}")

    def kill(self) -> None:
        """SIGKILL each host's whole command: its agent and its rank."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()


def torchrun(hosts, *args):
    """A command line for each host's node rank: torchrun's static rendezvous at host a, one rank per host,
    running ``python -m flowvm args``."""
    port = next(_ports)

    def command(node: int) -> list:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", node,
                "--nproc-per-node", "1", "--rdzv-backend", "static", "--master-addr", hosts[0].address,
                "--master-port", port, "-m", "flowvm", *args]
    return command


def same_model(a, b) -> bool:
    with np.load(a) as x, np.load(b) as y:
        return sorted(x.files) == sorted(y.files) and all(np.array_equal(x[k], y[k]) for k in x.files)


@pytest.fixture(scope="module")
def straight(two_hosts, tmp_path_factory):  # noqa: F811
    """The fitted model of an uninterrupted run on the two hosts."""
    folder = tmp_path_factory.mktemp("straight")
    run = Launch(two_hosts, torchrun(two_hosts, "run", *CONVNET, "--output", folder / "model.npz"), folder, "run")
    assert run.wait() == [0, 0], run.text()
    assert "convnet on digits: held-out accuracy" in run.logs[0].read_text()
    return folder / "model.npz"


def test_two_hosts_train_as_one_group_of_two_ranks(straight, tmp_path):
    """Two hosts of one rank each end bit for bit as two ranks on one host (gloo's all-reduce at a fixed world
    size is the same over the veth pair as over loopback)."""
    done = subprocess.run([sys.executable, "-m", "flowvm", "run", *CONVNET, "--nproc", "2", "--output",
                           tmp_path / "one-host.npz"], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert same_model(straight, tmp_path / "one-host.npz")


def kill_after_first_checkpoint(run: Launch, saved, what: str) -> None:
    """Wait until saved() finds the first complete checkpoint, then SIGKILL both hosts' commands."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while not saved():
        if any(p.poll() is not None for p in run.procs) or time.monotonic() > deadline:
            run.kill()
            pytest.fail(f"no checkpoint in {what} before the run ended:\n{run.text()}")
        time.sleep(0.05)
    run.kill()
    assert [p.returncode for p in run.procs] == [-signal.SIGKILL] * 2


def test_a_run_killed_on_both_hosts_resumes_from_their_shared_folder(two_hosts, straight, tmp_path):  # noqa: F811
    shared = tmp_path / "shared"
    run = Launch(two_hosts, torchrun(two_hosts, "run", *CONVNET, "--checkpoint", shared, "--every", "40"),
                 tmp_path, "killed")
    kill_after_first_checkpoint(run, lambda: (shared / "manifest.json").exists(), shared)
    manifest = json.loads((shared / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and not manifest.get("done") and manifest["steps"] >= 40
    resumed = Launch(two_hosts, torchrun(two_hosts, "resume", shared, "--output", tmp_path / "model.npz",
                                         "--progress", "none"), tmp_path, "resumed")
    assert resumed.wait() == [0, 0], resumed.text()
    assert same_model(straight, tmp_path / "model.npz")
    assert json.loads((shared / "manifest.json").read_text())["done"]


# ------------------------------------------------------------------ S3 on host a
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}
WAIT_FOR_S3 = textwrap.dedent("""
    import sys, time, urllib.request
    import s3fs
    endpoint, bucket = sys.argv[1], sys.argv[2]
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit("the moto server did not start")
            time.sleep(0.1)
    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir(bucket)
    print("ready", flush=True)
""")
WAIT_FOR_OBJECT = textwrap.dedent("""
    import sys, time
    import s3fs
    fs = s3fs.S3FileSystem(endpoint_url=sys.argv[1])
    while not fs.exists(sys.argv[2]):
        time.sleep(0.05)
        fs.invalidate_cache()
    print(fs.cat(sys.argv[2]).decode(), flush=True)
""")


@pytest.fixture
def s3_on_a(two_hosts, tmp_path):  # noqa: F811
    """(the environment pointing at it, the bucket): a moto S3 server on host a's address, with a bucket."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    a = two_hosts[0]
    endpoint = f"http://{a.address}:{next(_ports)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "FSSPEC_S3"}
    env.update(AWS, AWS_ENDPOINT_URL=endpoint, AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"))
    with open(tmp_path / "moto.log", "w") as log:
        server = a.popen([sys.executable, "-m", "moto.server", "-H", a.address, "-p", endpoint.rsplit(":", 1)[1]],
                         stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        ready = a.run([sys.executable, "-c", WAIT_FOR_S3, endpoint, "flowvm-two-hosts"], env=env,
                      capture_output=True, text=True, timeout=90)
        assert ready.returncode == 0 and "ready" in ready.stdout, ready.stderr + (tmp_path / "moto.log").read_text()
        yield {k: v for k, v in env.items() if k.startswith("AWS_")}, "flowvm-two-hosts"
    finally:
        server.kill()
        server.wait()


def test_a_run_killed_on_both_hosts_resumes_from_s3(two_hosts, straight, s3_on_a, tmp_path):  # noqa: F811
    env, bucket = s3_on_a
    url = f"s3://{bucket}/run"
    run = Launch(two_hosts, torchrun(two_hosts, "run", *CONVNET, "--checkpoint", url, "--every", "40"),
                 tmp_path, "killed", env)
    watch = two_hosts[1].popen([sys.executable, "-c", WAIT_FOR_OBJECT, env["AWS_ENDPOINT_URL"],
                                f"{url}/manifest.json"], env=dict(os.environ, **env), stdout=subprocess.PIPE, text=True)
    try:
        kill_after_first_checkpoint(run, lambda: watch.poll() is not None, url)
        manifest = json.loads(watch.stdout.read())
    finally:
        watch.kill()
        watch.wait()
    assert manifest["world_size"] == 2 and not manifest.get("done") and manifest["steps"] >= 40
    resumed = Launch(two_hosts, torchrun(two_hosts, "resume", url, "--output", tmp_path / "model.npz",
                                         "--progress", "none"), tmp_path, "resumed", env)
    assert resumed.wait() == [0, 0], resumed.text()
    assert same_model(straight, tmp_path / "model.npz")


# ------------------------------------------------------------------ flowvm's own launcher on each host
def test_flowvm_run_launches_a_rank_group_on_each_host(two_hosts, straight, tmp_path):  # noqa: F811
    """``flowvm run --nproc 1 --nnodes 2 --node-rank R --rdzv HOST:PORT`` on each host: one run of two ranks,
    as torchrun's.  (The hosts' launchers must join one rendezvous: the same run id on every host.)"""
    port = next(_ports)

    def command(node: int) -> list:
        return [sys.executable, "-m", "flowvm", "run", *CONVNET, "--nproc", "1", "--nnodes", "2", "--node-rank",
                node, "--rdzv", f"{two_hosts[0].address}:{port}", "--output", tmp_path / "model.npz"]
    run = Launch(two_hosts, command, tmp_path, "flowvm")
    assert run.wait(timeout=90) == [0, 0], run.text()
    assert same_model(straight, tmp_path / "model.npz")
