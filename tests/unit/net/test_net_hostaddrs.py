"""Node addresses in allow-lists (finding 8 of issue 18): tenants cannot open the host's
own addresses; only the operator's net_host_allow destinations may be named (pure)."""

from __future__ import annotations

import ipaddress

import pytest

from dsec.config import load_settings
from dsec.errors import InvalidArgument
from dsec.net.alloc import SlotNames, slot_addr
from dsec.net.allowlist import parse_allow_list
from dsec.net.hostaddrs import HostGuard, parse_host_allow, parse_node_addresses
from dsec.net.rules import PolicyParams, base_script, slot_script

HOST = "192.168.7.10"  # pretend this is an address on one of the host's interfaces


def is_local(addr: ipaddress.IPv4Address) -> bool:
    return str(addr) == HOST


def guard(*allow: str, nodes: tuple[str, ...] = ("10.99.0.0/24",)) -> HostGuard:
    return HostGuard(ipaddress.IPv4Network("10.213.0.0/16"), tuple(parse_node_addresses(nodes)),
                     tuple(parse_host_allow(allow)))


@pytest.mark.parametrize("entry, address", [
    (f"{HOST}:22", HOST),            # an address of a host interface
    (HOST, HOST),                    # every port of it
    ("10.213.0.1:80", "10.213.0.1"),  # slot 0's gateway (the host end of its veth)
    ("10.213.4.5:80", "10.213.4.5"),  # any slot's gateway, built or not
    ("10.99.0.7:6379", "10.99.0.7"),  # a declared node / cluster peer address
])
def test_tenant_entries_naming_node_addresses_are_refused(entry: str, address: str) -> None:
    """An exact entry naming a node address is a 422 naming that address, with no operator opening."""
    with pytest.raises(InvalidArgument, match=address.replace(".", r"\.")) as e:
        guard().check(parse_allow_list([entry]), is_local)
    assert e.value.details["address"] == address and "DSEC_NET_HOST_ALLOW" in e.value.message


def test_operator_opening_admits_exactly_its_ports() -> None:
    """HOST:3128 opened by the operator: a tenant may name HOST:3128, not HOST:22, not a
    wider range, not the whole address; neighbouring sandbox addresses and CIDRs are
    left to nftables (never opened for node addresses)."""
    g = guard(f"{HOST}:3128", f"{HOST}:8000-8010")
    g.check(parse_allow_list([f"{HOST}:3128", f"{HOST}:8002-8010", "0.0.0.0/0", "10.213.0.2:80",
                              "192.168.0.0/16:22"]), is_local)
    for bad in (f"{HOST}:22", f"{HOST}:3127-3128", HOST, f"{HOST}:8000-8011"):
        with pytest.raises(InvalidArgument, match="except 192.168.7.10:3128, 192.168.7.10:8000-8010"):
            g.check(parse_allow_list([bad]), is_local)


@pytest.mark.parametrize("entry", ["10.0.0.1", "10.0.0.0/24:80", "pypi.org:443", "127.0.0.1:80", "10.0.0.1:0"])
def test_operator_setting_must_name_address_and_port(entry: str) -> None:
    """The operator's list takes single IP:PORT (or IP:LO-HI) destinations only; a mistake
    names the setting."""
    with pytest.raises(InvalidArgument, match="net_host_allow"):
        parse_host_allow([entry])
    with pytest.raises(InvalidArgument, match="net_node_addresses"):
        parse_node_addresses(["10.0.0.300"])


def test_settings_accept_comma_separated_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """DSEC_NET_HOST_ALLOW='a:1,b:2' and a JSON list both work; the default opens nothing."""
    assert load_settings().net_host_allow == []
    monkeypatch.setenv("DSEC_NET_HOST_ALLOW", "10.0.0.1:3128, 10.0.0.2:53")
    assert load_settings().net_host_allow == ["10.0.0.1:3128", "10.0.0.2:53"]
    monkeypatch.setenv("DSEC_NET_NODE_ADDRESSES", '["10.9.0.0/16"]')
    assert load_settings().net_node_addresses == ["10.9.0.0/16"]


def test_rules_gate_host_services_on_the_operator_list() -> None:
    """The input chain opens a host destination only if both the tenant's exact entry and
    the operator's hostallow set match; declared node addresses on the forward path go to
    the same chain; the operator's lists are refilled at every start."""
    p = PolicyParams("abcd", "10.213.0.0/16", 256, 4242, 20, tuple(parse_host_allow([f"{HOST}:3128"])),
                     tuple(parse_node_addresses(["10.99.0.0/24"])))
    base = base_script(p)
    assert "flush set inet dsec_abcd hostallow" in base
    assert f"add element inet dsec_abcd hostallow {{ {HOST} . 3128 }}" in base
    assert "add element inet dsec_abcd nodes { 10.99.0.0/24 }" in base
    slot = slot_script(p, SlotNames("abcd", 7), slot_addr("10.213.0.0/16", 7))
    lines = [x for x in slot.splitlines() if x.startswith("add rule inet dsec_abcd sbi0007")]
    accepts = [x for x in lines if "goto allowed" in x or "accept" in x]
    assert accepts and all("@hostallow" in x for x in accepts)
    fwd = [x for x in slot.splitlines() if x.startswith("add rule inet dsec_abcd sbf0007")]
    assert fwd[0] == "add rule inet dsec_abcd sbf0007 ip daddr @nodes goto sbi0007"
