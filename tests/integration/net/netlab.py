"""Lab for the networking integration tests (fixtures re-exported by conftest.py).

"Remote hosts" are network namespaces this fixture creates, each linked to the host by
a veth on a test range (10.250.N.0/24); servers run inside them. Tests only ever send
traffic to those namespaces, the sandboxes' namespaces and loopback.

``sandbox_exec`` runs a command "in the sandbox". By default that is the slot's netns
entered as root (``nsenter --net``); the sandbox-manager tests can override the fixture
(same signature) to run the same checks inside real runc/runsc sandboxes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec.config import Settings
from dsec.net import NetAttachment, NetworkManager

SERVER = Path(__file__).with_name("servers.py")
Exec = Callable[[NetAttachment, list[str], float], subprocess.CompletedProcess]


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


@dataclass
class Remote:
    name: str  # netns name (under /run/netns, made with `ip netns add`)
    host_if: str
    host_addr: str  # the host's address on this link
    addr: str  # the remote host's address
    cidr: str
    procs: list[subprocess.Popen]

    def run(self, *argv: str, **kw) -> subprocess.Popen:
        p = subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kw)
        self.procs.append(p)
        return p


def _free_octet(avoid: set[int]) -> int:
    taken = _sh("ip", "-4", "route", "show").stdout
    for _ in range(200):
        n = random.randint(10, 240)
        if n not in avoid and f"10.250.{n}." not in taken:
            return n
    raise RuntimeError("no free 10.250.N.0/24 test range")


def _make_remote(tag: str, octet: int) -> Remote:
    name, host_if = f"dtr{tag}{octet}", f"dtr{tag}{octet}h"
    net = ipaddress.IPv4Network(f"10.250.{octet}.0/24")
    host_addr, addr = str(net.network_address + 1), str(net.network_address + 2)
    _sh("ip", "netns", "add", name)
    _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", name)
    _sh("ip", "addr", "add", f"{host_addr}/24", "dev", host_if)
    _sh("ip", "link", "set", host_if, "up")
    for cmd in (["ip", "addr", "add", f"{addr}/24", "dev", "eth0"], ["ip", "link", "set", "eth0", "up"],
                ["ip", "link", "set", "lo", "up"]):
        _sh("ip", "netns", "exec", name, *cmd)
    return Remote(name, host_if, host_addr, addr, str(net), [])


def _remove_remote(r: Remote) -> None:
    for p in r.procs:
        if p.poll() is None:
            p.kill()  # by PID: only processes this fixture started
            p.wait()
    _sh("ip", "link", "del", r.host_if, check=False)
    _sh("ip", "netns", "del", r.name, check=False)


def _wait_port(r: Remote, port: int, udp: bool = False) -> None:
    flag = "-lun" if udp else "-ltn"
    for _ in range(100):
        if f":{port} " in _sh("ip", "netns", "exec", r.name, "ss", flag).stdout:
            return
        time.sleep(0.05)
    raise RuntimeError(f"server on {r.addr}:{port} did not start")


@dataclass
class Lab:
    mgr: NetworkManager
    loop: asyncio.AbstractEventLoop
    a: Remote  # "remote host A": TCP 8000/8001 answer "ok", 8002 holds, iperf3 5201, UDP log 9999
    b: Remote  # "remote host B" in another CIDR: TCP 8000 answers "ok"
    settings: Settings
    udp_log: Path

    def call(self, coro):
        return self.loop.run_until_complete(coro)


@pytest.fixture(scope="package")
def lab() -> Iterator[Lab]:
    tag = f"{os.getpid() % 10000:04d}"[-3:]
    oa = _free_octet(set())
    ob = _free_octet({oa})
    a, b = _make_remote(tag, oa), _make_remote(tag + "b", ob)
    tmp = Path(tempfile.mkdtemp(prefix="dsec-net-test-"))
    udp_log = tmp / "udp.log"
    loop = asyncio.new_event_loop()
    settings = Settings(home=tmp, net_cidr=f"10.251.{oa}.0/24", net_slot_pool=3,
                        net_egress_rate="40mbit", net_max_connections=6, net_denied_log_max=50)
    mgr = NetworkManager(settings)
    try:
        a.run(sys.executable, str(SERVER), "tcp", "0.0.0.0", "8000", "8001")
        a.run(sys.executable, str(SERVER), "hold", "0.0.0.0", "8002")
        a.run(sys.executable, str(SERVER), "udplog", "0.0.0.0", "9999", str(udp_log))
        a.run("iperf3", "-s", "-p", "5201", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        b.run(sys.executable, str(SERVER), "tcp", "0.0.0.0", "8000")
        for port in (8000, 8001, 8002, 5201):
            _wait_port(a, port)
        _wait_port(a, 9999, udp=True)
        _wait_port(b, 8000)
        loop.run_until_complete(mgr.start())
        yield Lab(mgr, loop, a, b, settings, udp_log)
    finally:
        try:
            loop.run_until_complete(mgr.reconcile(set()))
            loop.run_until_complete(mgr.close())
        finally:
            loop.close()
            _remove_remote(a)
            _remove_remote(b)


def netns_exec(att: NetAttachment, argv: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
    """Run ``argv`` as root inside the sandbox's network namespace."""
    return subprocess.run(["nsenter", f"--net={att.netns_path}", *argv], check=False, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(params=["netns"])
def sandbox_exec(request) -> Exec:
    """How commands run "in the sandbox" (override to use real runc/runsc sandboxes)."""
    return netns_exec


def tcp_probe(run: Exec, att: NetAttachment, host: str, port: int) -> bool:
    """True iff the sandbox completed a TCP exchange with a server that answers 'ok'."""
    r = run(att, ["busybox", "nc", "-w", "2", host, str(port)], 8.0)
    return r.returncode == 0 and "ok" in r.stdout


@pytest.fixture
def host_server() -> Iterator[Callable[[str], int]]:
    """Start 'ok' TCP servers in the host namespace (the host's own services)."""
    procs: list[subprocess.Popen] = []

    def start(addr: str) -> int:
        port = random.randint(20000, 40000)
        p = subprocess.Popen([sys.executable, str(SERVER), "tcp", addr, str(port)])
        procs.append(p)
        for _ in range(100):
            if f"{addr}:{port} " in _sh("ss", "-ltn").stdout:
                return port
            time.sleep(0.05)
        raise RuntimeError(f"host server {addr}:{port} did not start")

    yield start
    for p in procs:
        p.kill()
        p.wait()
