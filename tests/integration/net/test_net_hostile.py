"""A sandbox that is root in its own netns (CAP_NET_ADMIN + CAP_NET_RAW) still cannot
widen its access: every check acts inside the slot's netns as root via nsenter, which
is more power than a real sandbox has. The enforcement lives in the host namespace."""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
import uuid

import pytest
from netlab import Lab, netns_exec, tcp_probe

pytestmark = pytest.mark.integration


@pytest.fixture
def pair(lab: Lab):
    """An attacker allowed only A:8000, and a victim allowed A:8001 + A's UDP log port."""
    sids = [f"h-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    attacker = lab.call(lab.mgr.attach(sids[0], [f"{lab.a.addr}:8000"]))
    victim = lab.call(lab.mgr.attach(sids[1], [f"{lab.a.addr}:8001", f"{lab.a.addr}:9999"]))
    yield attacker, victim
    for sid in sids:
        lab.call(lab.mgr.detach(sid))


def _spoof_drops(lab: Lab, family: str, chain: str) -> int:
    """Packets dropped so far by the anti-spoofing rule of ``chain`` (nft counter)."""
    out = subprocess.run(["nft", "-j", "list", "chain", family, lab.mgr.ops.params.table, chain],
                         capture_output=True, text=True, check=True).stdout
    total = 0
    for obj in json.loads(out)["nftables"]:
        for expr in obj.get("rule", {}).get("expr", []):
            if "counter" in expr:
                total += expr["counter"]["packets"]
    return total


def _root(att, *cmd: str) -> subprocess.CompletedProcess:
    return netns_exec(att, list(cmd), 10.0)


def test_added_address_and_source_spoofing(lab: Lab, pair) -> None:
    """Taking the victim's address (extra address, source bind) does not give the
    attacker the victim's allow-list."""
    attacker, victim = pair
    assert tcp_probe(netns_exec, victim, lab.a.addr, 8001)
    assert _root(attacker, "ip", "addr", "add", f"{victim.address}/32", "dev", "eth0").returncode == 0
    connect = ("import socket, sys\n"
               "s = socket.socket(); s.settimeout(2); s.bind((sys.argv[1], 0))\n"
               "s.connect((sys.argv[2], int(sys.argv[3]))); print(s.recv(10).decode())")
    own = _root(attacker, "python3", "-c", connect, attacker.address, lab.a.addr, "8000")
    assert "ok" in own.stdout, own.stderr  # control: the probe itself works
    spoofed = _root(attacker, "python3", "-c", connect, victim.address, lab.a.addr, "8001")
    assert spoofed.returncode != 0 and "ok" not in spoofed.stdout


def test_changed_routes_do_not_help(lab: Lab, pair) -> None:
    """Direct on-link routes or a different default route reach nothing new."""
    attacker, _ = pair
    _root(attacker, "ip", "route", "add", lab.b.cidr, "dev", "eth0")
    _root(attacker, "ip", "route", "replace", "default", "dev", "eth0")
    assert not tcp_probe(netns_exec, attacker, lab.b.addr, 8000)
    assert not tcp_probe(netns_exec, attacker, lab.a.addr, 8001)
    _root(attacker, "ip", "route", "replace", "default", "via", attacker.gateway)
    assert tcp_probe(netns_exec, attacker, lab.a.addr, 8000)  # the allowed path still works
    assert not tcp_probe(netns_exec, attacker, lab.b.addr, 8000)


def test_raw_socket_spoofed_packets_dropped(lab: Lab, pair) -> None:
    """Raw IP packets with the victim's source address (to a port the victim may use)
    and raw packets to a denied destination never arrive."""
    attacker, victim = pair
    code = textwrap.dedent(f"""
        import socket, struct
        def csum(b):
            s = sum(struct.unpack('!%dH' % (len(b) // 2), b))
            s = (s >> 16) + (s & 0xffff); s += s >> 16
            return ~s & 0xffff
        def pkt(src, dst, dport, data):
            udp = struct.pack('!HHHH', 40000, dport, 8 + len(data), 0) + data
            hdr = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                              socket.inet_aton(src), socket.inet_aton(dst))
            hdr = hdr[:10] + struct.pack('!H', csum(hdr)) + hdr[12:]
            return hdr + udp
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        for _ in range(5):
            s.sendto(pkt('{victim.address}', '{lab.a.addr}', 9999, b'spoofed'), ('{lab.a.addr}', 0))
            s.sendto(pkt('{attacker.address}', '{lab.a.addr}', 9999, b'denied'), ('{lab.a.addr}', 0))
    """)
    before = _spoof_drops(lab, "inet", "pre")
    assert _root(attacker, "python3", "-c", code).returncode == 0
    assert _spoof_drops(lab, "inet", "pre") >= before + 5  # dropped at the host-side rule
    # control: the victim's genuine datagram does arrive
    _root(victim, "python3", "-c", "import socket; socket.socket(2, 2).sendto(b'genuine', "
                                   f"('{lab.a.addr}', 9999))")
    time.sleep(0.5)
    log = lab.udp_log.read_text() if lab.udp_log.exists() else ""
    assert "genuine" in log
    assert "spoofed" not in log and "denied" not in log


def test_arp_and_mac_spoofing(lab: Lab, pair) -> None:
    """Gratuitous ARP claiming the victim's (or gateway's) address does not poison the
    host; a changed MAC cuts the attacker off instead of widening anything."""
    attacker, victim = pair
    code = textwrap.dedent(f"""
        import socket, struct
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        s.bind(('eth0', 0))
        mac = bytes.fromhex(open('/sys/class/net/eth0/address').read().strip().replace(':', ''))
        for claim in ('{victim.address}', '{attacker.gateway}'):
            ip = socket.inet_aton(claim)
            arp = struct.pack('!HHBBH6s4s6s4s', 1, 0x0800, 6, 4, 2, mac, ip, b'\\xff' * 6, ip)
            s.send(b'\\xff' * 6 + mac + b'\\x08\\x06' + arp)
    """)
    before = _spoof_drops(lab, "arp", "in")
    assert _root(attacker, "python3", "-c", code).returncode == 0
    time.sleep(0.2)
    assert _spoof_drops(lab, "arp", "in") >= before + 2  # both lies dropped by the host-side rule
    neigh = subprocess.run(["ip", "neigh", "show", victim.address], check=False, capture_output=True, text=True).stdout
    assert attacker.mac not in neigh and attacker.host_if not in neigh
    assert tcp_probe(netns_exec, victim, lab.a.addr, 8001)
    _root(attacker, "ip", "link", "set", "eth0", "address", victim.mac)
    assert not tcp_probe(netns_exec, attacker, lab.a.addr, 8000)
    assert not tcp_probe(netns_exec, attacker, lab.a.addr, 8001)


@pytest.mark.parametrize("tier", ["container", pytest.param("gvisor", marks=pytest.mark.gvisor)], indirect=True)
def test_real_sandbox_cannot_rewire_its_network(lab: Lab, sandboxes, sandbox_exec) -> None:
    """Root in a real sandbox (default capabilities: no NET_ADMIN, no NET_RAW; on gVisor
    its netstack enforces the same) cannot add a neighbour's address, change routes or
    its MAC, nor send as the neighbour toward the neighbour's allowed destination."""
    _, victim = sandboxes([f"{lab.a.addr}:8001"])
    _, att = sandboxes([f"{lab.a.addr}:8000"])
    for cmd in (f"ip addr add {victim.address}/32 dev eth0",
                f"ip route add {lab.a.addr}/32 via {victim.gateway}",
                "ip link set eth0 address 02:00:00:00:00:01",
                "ip link set eth0 down"):
        r = sandbox_exec(att, ["sh", "-c", cmd], 10.0)
        assert r.returncode != 0, f"{cmd!r} succeeded inside the sandbox"
    spoof = sandbox_exec(att, ["busybox", "nc", "-s", victim.address, "-w", "2", lab.a.addr, "8001"], 8.0)
    assert "ok" not in spoof.stdout
    assert tcp_probe(sandbox_exec, att, lab.a.addr, 8000)  # its own access still works
    assert not tcp_probe(sandbox_exec, att, lab.a.addr, 8001)
