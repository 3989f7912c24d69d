"""Two hosts on one machine: two Linux network namespaces joined by a veth pair, 10.77.0.1/24 and 10.77.0.2/24.

Each namespace has its own network stack (loopback, addresses, ports) and shares everything else with this
process: its files (a shared directory is any folder), its Python and its packages.  A process runs "on" a
host by ``ip netns exec NAME ...`` (``Host.popen``, ``Host.run``).  The pair is made and removed by the
``two_hosts`` fixture; where namespaces cannot be made (not root, no ``ip``, no permission in a container)
the tests that use it are skipped, with the reason.  Namespaces left by a test process that was killed are
removed by the next one (their names hold the process id).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

SUBNET = "10.77.0"
PREFIX = "fvmhost"  # namespaces are fvmhost<pid>-<letter>


@dataclass(frozen=True)
class Host:
    """One namespace: its name and the address of its end of the veth pair."""

    name: str
    address: str
    interface: str = "veth0"  # its end of the pair (the same name in each namespace: GLOO_SOCKET_IFNAME)

    def command(self, args) -> list[str]:
        return ["ip", "netns", "exec", self.name, *[str(a) for a in args]]

    def popen(self, args, **options) -> subprocess.Popen:
        """Start args in this namespace (options as subprocess.Popen's)."""
        return subprocess.Popen(self.command(args), **options)

    def run(self, args, **options) -> subprocess.CompletedProcess:
        """Run args in this namespace to the end (options as subprocess.run's)."""
        return subprocess.run(self.command(args), **options)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def why_not() -> str | None:
    """Why namespaces cannot be made here (None where they can)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's; this is {sys.platform}"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Remove the namespaces of test processes that no longer run."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        if name.startswith(PREFIX) and "-" in name:
            pid = name[len(PREFIX):].split("-")[0]
            if pid.isdigit() and not _alive(int(pid)):
                _ip("netns", "del", name, check=False)


def make_hosts() -> tuple[Host, Host]:
    """Two namespaces joined by a veth pair, each end addressed and up, loopback up in both."""
    pid = os.getpid()
    hosts = (Host(f"{PREFIX}{pid}-a", f"{SUBNET}.1"), Host(f"{PREFIX}{pid}-b", f"{SUBNET}.2"))
    links = (f"fv{pid}a", f"fv{pid}b")  # made here (at most 15 characters), renamed in their namespaces
    made = []
    try:
        for host in hosts:
            _ip("netns", "add", host.name)
            made.append(host)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for host, link in zip(hosts, links):
            _ip("link", "set", link, "netns", host.name)
            _ip("-n", host.name, "link", "set", link, "name", host.interface)
            _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.name, "link", "set", host.interface, "up")
            _ip("-n", host.name, "link", "set", "lo", "up")
    except Exception:
        remove_hosts(made)
        raise
    return hosts


def remove_hosts(hosts) -> None:
    """Delete the namespaces (their veth ends go with them) and the processes still running in them."""
    for host in hosts:
        pids = _ip("netns", "pids", host.name, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "del", host.name, check=False)


@pytest.fixture(scope="module")
def two_hosts():
    """(host a, host b): two network namespaces joined by a veth pair, removed after the module's tests."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    remove_stale()
    try:
        hosts = make_hosts()
    except RuntimeError as err:  # e.g. a container without CAP_SYS_ADMIN
        pytest.skip(f"network namespaces cannot be made here: {err}")
    try:
        yield hosts
    finally:
        remove_hosts(hosts)
