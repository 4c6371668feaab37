"""Allocator, naming, rate parsing, nft script rendering and NFLOG parsing (pure)."""

from __future__ import annotations

import ipaddress
import socket
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.errors import CapacityExhausted, InvalidArgument
from dsec.net.alloc import SlotNames, allocate, capacity, instance_tag, parse_rate, slot_addr, slot_index_of
from dsec.net.allowlist import AllowRule, parse_allow_list
from dsec.net.nflog import NFULA_PAYLOAD, NFULA_PREFIX, parse_ipv4, parse_messages
from dsec.net.rules import PolicyParams, allow_script, base_script, port_elements, slot_script


def test_slot_addresses_are_disjoint_30s() -> None:
    """Each slot is its own /30 inside net_cidr: gateway .1, sandbox .2."""
    a0, a1 = slot_addr("10.213.0.0/16", 0), slot_addr("10.213.0.0/16", 1)
    assert (str(a0.gateway), str(a0.address), str(a1.gateway)) == ("10.213.0.1", "10.213.0.2", "10.213.0.5")
    assert capacity("10.213.0.0/16") == 16384 and capacity("10.213.0.0/24") == 64
    last = slot_addr("10.213.0.0/24", 63)
    assert last.network.broadcast_address == ipaddress.IPv4Address("10.213.0.255")
    with pytest.raises(InvalidArgument):
        slot_addr("10.213.0.0/24", 64)
    for bad in ("10.213.0.1/16", "8.8.8.0/24", "10.0.0.0/30", "nonsense"):
        with pytest.raises(InvalidArgument):
            capacity(bad)


def test_allocate_rotates_and_exhausts() -> None:
    """Allocation rotates from the cursor (delays address reuse) and reports exhaustion."""
    assert allocate("10.1.0.0/28", set(), 0) == 0
    assert allocate("10.1.0.0/28", {0}, 0) == 1
    assert allocate("10.1.0.0/28", {3}, 3) == 0  # wraps
    assert allocate("10.1.0.0/28", {1}, 1) == 2
    with pytest.raises(CapacityExhausted, match="no free slot"):
        allocate("10.1.0.0/28", {0, 1, 2, 3}, 0)


def test_names_fit_ifnamsiz_and_round_trip() -> None:
    """Every interface name fits IFNAMSIZ and maps back to its slot; MACs are unicast LAA."""
    tag = instance_tag("/var/lib/dsec/run")
    n = SlotNames(tag, 0xFFFF)
    for name in (n.host_if, n.ifb_if, n.netns, *n.chains, *n.sets):
        assert slot_index_of(name, tag) == 0xFFFF
    assert len(n.host_if) <= 15 and len(n.ifb_if) <= 15
    assert slot_index_of("eth0", tag) is None and slot_index_of(f"dsec{tag}hzzzz", tag) is None
    first_octet = int(n.mac.split(":")[0], 16)
    assert first_octet & 0b10 and not first_octet & 0b1
    assert instance_tag("/a") != instance_tag("/b")


@pytest.mark.parametrize("text, bps", [("100mbit", 12_500_000), ("1gbit", 125_000_000), ("8kbit", 1000),
                                       ("10mbps", 10_000_000), ("0", 0), ("none", 0)])
def test_parse_rate(text: str, bps: int) -> None:
    """tc-style rates become bytes per second; 0/none mean unlimited."""
    assert parse_rate(text) == bps


def test_parse_rate_rejects_garbage() -> None:
    with pytest.raises(InvalidArgument, match="'fast'"):
        parse_rate("fast")


def _covered(rules: list[AllowRule], ip: int, port: int) -> bool:
    return any(r.ports is not None and int(r.network.network_address) <= ip <= int(r.network.broadcast_address)
               and r.ports[0] <= port <= r.ports[1] for r in rules)


entry = st.builds(lambda o, plen, lo, span:
                  f"{ipaddress.IPv4Network(f'10.{o}.0.0/{plen}', strict=False)}:{lo}-{lo + span}",
                  st.integers(0, 3), st.sampled_from([8, 12, 16, 24]), st.integers(1, 60), st.integers(0, 20))
host_entry = st.builds(lambda o, last, p: f"10.{o}.0.{last}:{p}", st.integers(0, 3), st.integers(1, 5),
                       st.integers(1, 80))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(entry, host_entry), min_size=1, max_size=8))
def test_port_elements_disjoint_and_exact(entries: list[str]) -> None:
    """The nft elements are pairwise disjoint (the kernel refuses overlaps) and cover
    exactly the (address, port) pairs the user's entries cover."""
    rules = parse_allow_list(entries)
    boxes = port_elements(rules)
    for i, (a, b, c, d) in enumerate(boxes):
        for e, f, g, h in boxes[i + 1:]:
            assert b < e or f < a or d < g or h < c, "overlapping elements"
    probes_ip = {int(ipaddress.IPv4Address(f"10.{o}.0.{x}")) for o in range(5) for x in (0, 1, 3, 5, 6)}
    probes_ip |= {int(ipaddress.IPv4Address(f"10.{o}.255.255")) for o in range(5)}
    for ip in probes_ip:
        for port in range(0, 82, 3):
            got = any(a <= ip <= b and c <= port <= d for a, b, c, d in boxes)
            assert got == _covered(rules, ip, port), (ipaddress.IPv4Address(ip), port)


def test_scripts_render_the_policy() -> None:
    """Base/slot/allow scripts carry the decisions documented in rules.py."""
    p = PolicyParams("abcd", "10.213.0.0/16", 256, 4242, 20)
    base = base_script(p)
    assert "add table inet dsec_abcd" in base and "ct count over 256" in base
    assert 'oifname "dsecabcdh*" drop' in base and "masquerade" in base and "add table arp dsec_abcd" in base
    assert "flush ruleset" not in base and "policy drop" not in base  # never disturb the host
    n = SlotNames("abcd", 7)
    slot = slot_script(p, n, slot_addr("10.213.0.0/16", 7))
    assert '"dsecabcdh0007" . 10.213.0.30 . 02:d5:ab:cd:00:07' in slot
    assert 'log prefix "dsecabcd:0007:f" group 4242' in slot and "reject with tcp reset" in slot
    rules = parse_allow_list(["10.0.0.0/8:443", "10.1.2.3", "10.9.9.9:22"])
    allow = allow_script(p, n, rules)
    assert allow.count("flush set") == 4
    assert "add element inet dsec_abcd sbh0007 { 10.1.2.3 }" in allow
    assert "add element inet dsec_abcd sblh0007 { 10.1.2.3 }" in allow
    assert "sblp0007 { 10.9.9.9 . 22 }" in allow  # only exact addresses (and net_host_allow) open host services
    [line] = [x for x in allow.splitlines() if x.startswith("add element inet dsec_abcd sbp0007")]
    for elem in ("10.0.0.0-10.9.9.8 . 443", "10.9.9.9 . 22", "10.9.9.9 . 443", "10.9.9.10-10.255.255.255 . 443"):
        assert elem in line  # overlapping entries cut into disjoint pieces


def _nl(mtype: int, body: bytes) -> bytes:
    msg = struct.pack("=IHHII", 16 + len(body), mtype, 0, 0, 0) + body
    return msg + b"\0" * ((-len(msg)) % 4)


def _attr(t: int, data: bytes) -> bytes:
    a = struct.pack("=HH", 4 + len(data), t) + data
    return a + b"\0" * ((-len(a)) % 4)


def test_nflog_parsing() -> None:
    """NFLOG datagrams yield prefix + packet head; IPv4 heads yield dst/proto/port."""
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40, 0, 0, 64, 6, 0, socket.inet_aton("10.213.0.2"),
                     socket.inet_aton("10.250.1.2")) + struct.pack("!HH", 40000, 8001)
    body = struct.pack("!BBH", 2, 0, 77) + _attr(NFULA_PREFIX, b"dsecabcd:0001:f\0") + _attr(NFULA_PAYLOAD, ip)
    buf = _nl(4 << 8, body) + _nl(2, struct.pack("=i", -16) + b"\0" * 16)
    packets, errors = parse_messages(buf)
    assert [p.prefix for p in packets] == ["dsecabcd:0001:f"] and errors == [16]
    assert parse_ipv4(packets[0].payload) == ("10.250.1.2", "tcp", 8001)
    icmp = bytearray(ip[:20])
    icmp[9] = 1
    assert parse_ipv4(bytes(icmp)) == ("10.250.1.2", "icmp", None)
    assert parse_ipv4(b"\x60" + b"\0" * 39) is None and parse_messages(b"\x01\x02") == ([], [])
