"""Two hosts: two network namespaces joined by a veth pair (netns.py), one rank group on each, rendezvous
over TCP between their addresses."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from netns import two_hosts  # noqa: F401  (the fixture)

PORT = 29617

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
