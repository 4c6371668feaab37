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
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec.config import Settings, load_settings
from dsec.images import ImageStore
from dsec.images.stock import ensure_stock
from dsec.models import ExecRequest, SandboxSpec
from dsec.net import NetAttachment, NetworkManager
from dsec.node.agent import LocalNodeAgent

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
            shutil.rmtree(tmp, ignore_errors=True)


def netns_exec(att: NetAttachment, argv: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
    """Run ``argv`` as root inside the sandbox's network namespace."""
    return subprocess.run(["nsenter", f"--net={att.netns_path}", *argv], check=False, capture_output=True,
                          text=True, timeout=timeout)


# --- real sandboxes on the lab's network manager -------------------------------------
# "netns": the slot's netns entered as root (fast, more power than a real sandbox has);
# "container"/"gvisor": real runc/runsc sandboxes created by a SandboxManager whose
# network manager is the lab's, so every policy test can run against both tiers.
TIERS = ["netns", "container", pytest.param("gvisor", marks=pytest.mark.gvisor)]
all_tiers = pytest.mark.parametrize("tier", TIERS, indirect=True)
SANDBOX_SHAPE = {"cpu": 0.5, "memory": "256M", "disk": "64M"}


@pytest.fixture(scope="package")
def real_node(lab: Lab) -> Iterator[LocalNodeAgent]:
    """A node agent (own home and run dir) whose sandboxes get their slots from lab.mgr."""
    home = Path(tempfile.mkdtemp(prefix="dsec-net-node-"))
    run_dir = Path(tempfile.mkdtemp(prefix="dsn-", dir="/tmp"))  # short: socket paths
    settings = load_settings(home=home, run_dir=run_dir, layer_compression="tar", net_enabled=False)
    store = ImageStore(home / "images", settings)
    ensure_stock(store, only=["busybox"], log=lambda _: None)
    node = LocalNodeAgent(settings, images=store)
    node.manager.network = lab.mgr  # not node.start(): its reconcile would drop lab slots
    lab.call(node.manager.start())
    try:
        yield node
    finally:
        for sid in list(node.manager.live):
            lab.call(node.manager.destroy(sid))
        node.manager.close()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def tier(request) -> str:
    t = getattr(request, "param", "netns")
    if t == "gvisor" and shutil.which("runsc") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI lacks runsc")
        pytest.skip("needs runsc")
    return t


class Sandboxes:
    """Makes "sandboxes" of one tier for a test and removes them afterwards."""

    def __init__(self, lab: Lab, tier: str, node: LocalNodeAgent | None) -> None:
        self.lab, self.tier, self.node = lab, tier, node
        self.by_slot: dict[int, str] = {}
        self.procs: list[subprocess.Popen] = []

    def __call__(self, allow: list[str]) -> tuple[str, NetAttachment]:
        if self.node is None:
            sid = f"t-{uuid.uuid4().hex[:8]}"
            att = self.lab.call(self.lab.mgr.attach(sid, allow))
        else:
            shape = {**SANDBOX_SHAPE, "pids": 1024 if self.tier == "gvisor" else 128}
            info = self.lab.call(self.node.create(SandboxSpec(image="busybox", isolation=self.tier,
                                                              network=allow, **shape)))
            sid, att = info.id, self.lab.mgr.attachment(info.id)
            assert att is not None
        self.by_slot[att.slot] = sid
        return sid, att

    def exec(self, att: NetAttachment, argv: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
        if self.node is None:
            return netns_exec(att, argv, timeout)
        res = self.lab.call(self.node.exec(self.by_slot[att.slot], ExecRequest(cmd=argv, timeout=timeout)))
        return subprocess.CompletedProcess(argv, res.exit_code, res.stdout, res.stderr)

    def serve_ok_once(self, att: NetAttachment, port: int) -> None:
        """Start a one-shot 'ok' TCP server inside the sandbox on ``port``."""
        cmd = f"busybox nc -l -p {port} -e echo ok"
        if self.node is None:
            self.procs.append(subprocess.Popen(["nsenter", f"--net={att.netns_path}", *cmd.split()]))
        else:
            r = self.exec(att, ["sh", "-c", f"{cmd} </dev/null >/dev/null 2>&1 &"], 10.0)
            assert r.returncode == 0, r.stderr
        time.sleep(0.3)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for sid in self.by_slot.values():
            if self.node is None:
                self.lab.call(self.lab.mgr.detach(sid))
            else:
                self.lab.call(self.node.destroy(sid))


@pytest.fixture
def sandboxes(lab: Lab, tier: str, request) -> Iterator[Sandboxes]:
    node = request.getfixturevalue("real_node") if tier != "netns" else None
    made = Sandboxes(lab, tier, node)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def sandbox_exec(sandboxes: Sandboxes) -> Exec:
    """How commands run "in the sandbox" of the test's tier."""
    return sandboxes.exec


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
