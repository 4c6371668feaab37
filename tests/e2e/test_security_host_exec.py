"""Issue 18 findings 8 and 9 through the real API (`dsec serve`, real runc/runsc sandboxes,
real network slots): a host address is reachable only at the IP:PORT the operator opened
(DSEC_NET_HOST_ALLOW), other host destinations are a 422 naming the address; closing a
streamed exec over HTTP kills the command on both tiers and leaves no zombie runsc under
the server."""

from __future__ import annotations

import ipaddress
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2e_server import Server, running_server

from dsec.errors import InvalidArgument
from dsec.sdk import Client, Sandbox

pytestmark = pytest.mark.integration

SERVERS = Path(__file__).parents[1] / "integration" / "net" / "servers.py"
TIERS = ["container", pytest.param("gvisor", marks=pytest.mark.gvisor)]


def _free_net(prefix: str, taken: str) -> str:
    for _ in range(200):
        net = f"{prefix}.{random.randint(10, 240)}.0/24"
        if net.rsplit(".", 2)[0] + "." not in taken:
            return net
    raise RuntimeError(f"no free {prefix}.N.0/24 range")


@dataclass
class HostListener:
    addr: str  # an address of a host interface (a dummy link this fixture made)
    open_port: int  # opened by the operator
    closed_port: int  # a listener too, not opened


@pytest.fixture(scope="module")
def host() -> Iterator[HostListener]:
    """A host interface (one end of a veth pair this fixture made, both ends in the host's
    namespace) with one address and two 'ok' TCP listeners on it."""
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True,
                            check=True).stdout
    addr = str(ipaddress.IPv4Network(_free_net("10.254", routes)).network_address + 1)
    link = f"dsecx{random.randint(0, 99999)}"
    subprocess.run(["ip", "link", "add", link, "type", "veth", "peer", "name", link + "p"], check=True)
    procs: list[subprocess.Popen] = []
    try:
        subprocess.run(["ip", "addr", "add", f"{addr}/32", "dev", link], check=True)
        for name in (link, link + "p"):
            subprocess.run(["ip", "link", "set", name, "up"], check=True)
        open_port, closed_port = random.sample(range(41000, 49000), 2)
        for port in (open_port, closed_port):
            procs.append(subprocess.Popen([sys.executable, str(SERVERS), "tcp", addr, str(port)]))
        for port in (open_port, closed_port):
            for _ in range(100):
                if f"{addr}:{port} " in subprocess.run(["ss", "-ltn"], capture_output=True, text=True,
                                                       check=False).stdout:
                    break
                time.sleep(0.05)
        yield HostListener(addr, open_port, closed_port)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        subprocess.run(["ip", "link", "del", link], check=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, host: HostListener) -> Iterator[Server]:
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True, check=True).stdout
    env = {"DSEC_NET_CIDR": _free_net("10.253", routes), "DSEC_NET_HOST_ALLOW": f"{host.addr}:{host.open_port}"}
    with running_server(tmp_path_factory, "dsec-home", env) as srv:
        yield srv


def _reaches(sb: Sandbox, addr: str, port: int) -> bool:
    r = sb.exec(f"nc -w 2 {addr} {port} </dev/null", timeout=20)
    return r.exit_code == 0 and "ok" in r.stdout


@pytest.mark.parametrize("isolation", TIERS)
def test_host_address_only_where_the_operator_opened_it(server: Server, host: HostListener, isolation: str) -> None:
    """Finding 8: a real host listener is reached only at the operator's IP:PORT and only
    by a sandbox that names it; 0.0.0.0/0 opens nothing of the host; naming another port
    of the host address is a 422 naming the address, on create and on update."""
    with Client(server.url, server.token) as c:
        with Sandbox.create(image="busybox", cpu=1, memory="256M", isolation=isolation, client=c,
                            network=[f"{host.addr}:{host.open_port}"]) as sb:
            assert _reaches(sb, host.addr, host.open_port)
            assert not _reaches(sb, host.addr, host.closed_port)
            with pytest.raises(InvalidArgument, match=host.addr.replace(".", r"\.")):
                sb.network.update([f"{host.addr}:{host.closed_port}"])
            assert _reaches(sb, host.addr, host.open_port)  # the refused update changed nothing
        with Sandbox.create(image="busybox", cpu=1, memory="256M", isolation=isolation, client=c,
                            network=["0.0.0.0/0"]) as wide:
            assert not _reaches(wide, host.addr, host.open_port)
            assert not _reaches(wide, host.addr, host.closed_port)
    r = httpx.post(f"{server.url}/v1/sandboxes", headers={"authorization": f"Bearer {server.token}"}, timeout=60,
                   json={"image": "busybox", "isolation": isolation, "network": [f"{host.addr}:{host.closed_port}"]})
    assert r.status_code == 422, r.text
    assert host.addr in r.json()["message"] and "DSEC_NET_HOST_ALLOW" not in r.json()["message"]


def _runsc_zombies(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if state == "Z" and int(ppid) == pid and comm.startswith("runsc"):
            out.append(int(d.name))
    return out


@pytest.mark.parametrize("isolation", TIERS)
def test_closing_an_http_exec_stream_kills_the_command(server: Server, isolation: str) -> None:
    """Finding 9: a client that reads the first chunk of POST .../exec/stream and hangs up
    takes the command (its background job and a setsid'd daemon too) with it, and the
    server keeps no zombie runsc child."""
    with Client(server.url, server.token) as c, \
            Sandbox.create(image="busybox", cpu=1, memory="256M", isolation=isolation, client=c) as sb:
        with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {server.token}"},
                          timeout=60) as h:
            body = {"cmd": "echo started; sleep 311 & setsid sleep 312 & sleep 313", "timeout": 300}
            with h.stream("POST", f"/v1/sandboxes/{sb.id}/exec/stream", json=body) as resp:
                assert resp.status_code == 200
                first = next(resp.iter_lines())
                assert "started" in first, first
        left = "?"
        for _ in range(100):
            left = sb.exec("ps -o args | grep -v grep | grep -cE '^sleep 31[123]'").stdout.strip()
            if left == "0":
                break
            time.sleep(0.1)
        assert left == "0", "the command outlived its closed stream"
        # The relay's runsc exec exits after the tree is gone and the server's loop reaps
        # it a moment later: a zombie that stays is the fault, one mid-reap is not.
        end = time.monotonic() + 5
        while _runsc_zombies(server.proc.pid) and time.monotonic() < end:
            time.sleep(0.05)
        assert _runsc_zombies(server.proc.pid) == []
