"""flowvm run --watch and flowvm watch (flowvm/command/watch.py), through their HTTP endpoints: the state a page
shows, every control (pause, step, run, checkpoint, stop, fork), and bad input (a taken port, an address that
is none, a second page, a register that does not exist, a value of the wrong type, a body that is no JSON), each
a clear message with the run unharmed: it resumes bit for bit as an uninterrupted run ends."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest

import flowvm
from flowvm.testing import diff, outcome

from toy import flowvm_cmd
from watching import Watched

MLP = ["run", "mlp", "--set", "epochs=2000", "--set", "samples=600", "--set", "hidden=16"]
LONG = ["run", "mlp", "--set", "epochs=100000", "--set", "samples=600", "--set", "hidden=16"]  # stopped by the test


def test_every_control_answers_as_json_and_the_stopped_run_resumes_exactly(tmp_path):
    ckpt, fork = tmp_path / "run.ckpt", tmp_path / "fork.ckpt"
    w = Watched(*MLP, "--checkpoint", ckpt)
    try:
        with urllib.request.urlopen(w.url, timeout=30) as page:
            assert b"flowvm watch" in page.read()
        s = w.wait(lambda s: s["steps"] > 0 and s["listing"], what="a first snapshot")
        assert s["header"]["program"] == "mlp" and s["header"]["checkpoint"] == str(ckpt)
        assert s["header"]["flowvm"] == flowvm.__version__ and not s["paused"]
        assert ">>" in s["listing"] and {"x_test", "history", "held_out"} <= {r["name"] for r in s["registers"]}
        x_test = next(r for r in s["registers"] if r["name"] == "x_test")
        assert x_test["type"] == "Tensor" and "shape (200, 2)" in x_test["value"]  # summarized, not printed
        w.wait(lambda s: s["history"].get("loss"), what="a loss curve")
        status, paused = w.api("pause", {})
        assert status == 200 and paused["paused"]
        time.sleep(0.5)
        assert w.state()["steps"] == paused["steps"]  # no step while paused
        status, stepped = w.api("step", {})
        assert status == 200 and stepped["steps"] == paused["steps"] + 1
        status, saved = w.api("checkpoint", {})
        assert status == 200 and flowvm.read_header(ckpt)["steps"] >= stepped["steps"]
        status, forked = w.api("fork", {"path": str(fork), "registers": {"held_out": 150}})
        assert status == 200 and forked["forked"] == str(fork), forked
        status, ran = w.api("run", {})
        assert status == 200 and not ran["paused"]
        w.wait(lambda s: s["steps"] > stepped["steps"] + 50, what="the run going on")
        status, stopped = w.api("stop", {})
        assert status == 200
        code, out, err = w.finish()
    finally:
        w.kill()
    assert code == 0 and f"paused at step {stopped['steps']}" in out, err
    copy = flowvm.load(fork)
    assert copy.registers["held_out"] == 150 and not copy.done
    flowvm_cmd("resume", ckpt, "--progress", "none")
    straight = flowvm_cmd(*MLP, "--checkpoint", tmp_path / "straight.ckpt", "--progress", "none")
    assert straight.returncode == 0
    assert not diff(outcome(flowvm.load(tmp_path / "straight.ckpt")), outcome(flowvm.load(ckpt)))


def test_bad_requests_are_clear_messages_and_the_run_goes_on(tmp_path):
    w = Watched(*LONG)
    try:
        w.wait(lambda s: s["steps"] > 0, what="a first step")
        status, answer = w.api("fork", {"path": str(tmp_path / "f.ckpt"), "registers": {"nope": 1}})
        assert status == 400 and answer["error"] == "fork: the run has no register 'nope'"
        status, answer = w.api("fork", {"path": str(tmp_path / "f.ckpt"), "registers": {"held_out": "many"}})
        assert status == 400 and "register 'held_out' holds int 200; 'many' is str" in answer["error"]
        status, answer = w.api("fork", {"path": str(tmp_path / "f.ckpt"), "registers": {"history": 1}})
        assert status == 400 and "only numbers and strings" in answer["error"]
        status, answer = w.api("fork", {"registers": {}})
        assert status == 400 and "give the new checkpoint's path" in answer["error"]
        status, answer = w.api("checkpoint", {})
        assert status == 400 and "no --checkpoint" in answer["error"]
        base, _, _ = w.url.partition("?")
        bad = urllib.request.Request(base + "api/pause", data=b"{not json", method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(bad, timeout=30)
        assert err.value.code == 400 and b"no JSON" in err.value.read()
        # two pages: both see the run, each told of the other
        s1 = w.api("state?page=one")[1]
        s2 = w.api("state?page=two")[1]
        assert s2["pages"] >= 2 and s1["steps"] <= s2["steps"]
        before = w.state()["steps"]
        w.wait(lambda s: s["steps"] > before, what="the run going on after the bad requests")
        w.api("stop", {})
        code, out, err = w.finish()
    finally:
        w.kill()
    assert code == 0, err


def test_a_taken_port_and_an_address_that_is_none_are_refused_before_the_run(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = flowvm_cmd("run", "pca", "--watch", f"127.0.0.1:{port}", check=False)
    assert out.returncode == 2
    assert f"--watch 127.0.0.1:{port}: cannot serve the page there: the port is taken by another program" in out.stderr
    out = flowvm_cmd("run", "pca", "--watch", "127.0.0.1:http", check=False)
    assert out.returncode == 2 and "give a port (8765) or HOST:PORT" in out.stderr
    out = flowvm_cmd("run", "pca", "--watch", "10.255.255.1:8765", check=False)  # no address of this machine
    assert out.returncode == 2 and "that address is not one of this machine's" in out.stderr
    out = flowvm_cmd("run", "pca", "--watch", "8765", "--nproc", "2", check=False)
    assert out.returncode == 2 and "--watch watches a run of one process" in out.stderr


def test_bound_beyond_loopback_every_request_needs_the_printed_token(tmp_path):
    w = Watched(*LONG, address="0.0.0.0:0")
    try:
        assert "?token=" in w.url
        status, s = w.api("state")
        assert status == 200 and "steps" in s
        base, _, _ = w.url.partition("?")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "api/state", timeout=30)
        assert err.value.code == 403 and b"needs the token" in err.value.read()
        w.api("stop", {})
        w.finish()
    finally:
        w.kill()


def test_flowvm_watch_opens_a_saved_run_paused(tmp_path):
    ckpt = tmp_path / "run.ckpt"
    flowvm_cmd(*MLP, "--checkpoint", ckpt, "--max-steps", 100, "--progress", "none")
    w = Watched("watch", ckpt)
    try:
        s = w.wait(lambda s: s["listing"], what="the saved run's snapshot")
        assert s["paused"] and s["steps"] == 100
        time.sleep(0.5)
        assert w.state()["steps"] == 100
        status, stepped = w.api("step", {})
        assert stepped["steps"] == 101
        w.api("stop", {})
        code, out, err = w.finish()
    finally:
        w.kill()
    assert code == 0 and flowvm.read_header(ckpt)["steps"] == 101, err
