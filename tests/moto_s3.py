"""An S3 server (moto's) on a free loopback port for a test module, and a fresh bucket per test, with the AWS
variables of this process and its children (``flowvm`` commands, ranks) pointed at it.  A module takes the
fixtures with ``from moto_s3 import moto_endpoint, s3_bucket``."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}
# Settings from the user's own AWS setup that would send requests elsewhere or sign them differently.
AWS_UNSET = ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN",
             "AWS_SECURITY_TOKEN", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
             "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
             "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "FSSPEC_S3")
_buckets = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory):
    """The server's address, for the module's tests; killed at the end."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("moto") / "server.log"
    env = {k: v for k, v in os.environ.items() if k not in AWS_UNSET}
    env.update(AWS, AWS_ENDPOINT_URL=endpoint)
    with open(log, "wb") as out:  # not a pipe: the server logs every request, and a full pipe would stall it
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the moto server did not start:\n{log.read_text()}") from None
                time.sleep(0.05)
        yield endpoint
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def s3_bucket(moto_endpoint, monkeypatch, tmp_path):
    """A new, empty bucket's name."""
    import s3fs

    for name in AWS_UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in AWS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))  # not the user's profiles
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    s3fs.S3FileSystem.clear_instance_cache()  # an instance keeps the credentials it was made with
    bucket = f"flowvm-{os.getpid()}-{next(_buckets)}"
    s3fs.S3FileSystem(endpoint_url=moto_endpoint).mkdir(bucket)
    yield bucket
    s3fs.S3FileSystem.clear_instance_cache()
