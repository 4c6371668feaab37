"""Allow-list parsing and validation (pure, no root)."""

from __future__ import annotations

import ipaddress

import pytest

from dsec.errors import InvalidArgument
from dsec.net.allowlist import parse_allow_list, parse_entry


def resolver(table: dict[str, list[str]]):
    def resolve(host: str) -> list[str]:
        if host not in table:
            raise OSError(-2, "Name or service not known")
        return table[host]
    return resolve


@pytest.mark.parametrize("entry, canonical, ports", [
    ("10.0.0.5", "10.0.0.5", None),
    ("10.0.0.5:443", "10.0.0.5:443", (443, 443)),
    ("10.0.0.0/8:443", "10.0.0.0/8:443", (443, 443)),
    ("192.168.1.0/24:8000-8100", "192.168.1.0/24:8000-8100", (8000, 8100)),
    ("0.0.0.0/0", "0.0.0.0/0", None),
    (" 10.0.0.5:22 ", "10.0.0.5:22", (22, 22)),
])
def test_valid_entries(entry: str, canonical: str, ports) -> None:
    """Every documented form parses into the rule it says."""
    [rule] = parse_entry(entry)
    assert rule.canonical() == canonical and rule.ports == ports and rule.entry == entry


@pytest.mark.parametrize("entry, why", [
    ("10.0.0.1/8", "host bits set"),
    ("0.0.0.0", "not a destination"),
    ("0/0", "not an IPv4"),
    ("16.0.0.0/4", "suspiciously broad"),
    ("127.0.0.1:80", "loopback"),
    ("224.0.0.1", "multicast"),
    ("10.0.0.5:0", "1-65535"),
    ("10.0.0.5:70000", "1-65535"),
    ("10.0.0.5:90-80", "reversed"),
    ("10.0.0.5:http", "not a number"),
    ("::1", "IPv6"),
    ("[fe80::1]:80", "IPv6"),
    ("exa mple.com", "whitespace"),
    ("-bad-.com", "not a valid host name"),
    ("", "empty"),
    ("10.0.0.256", "not an IPv4"),
])
def test_invalid_entries_name_the_entry(entry: str, why: str) -> None:
    """Bad entries raise InvalidArgument naming the entry and the reason."""
    with pytest.raises(InvalidArgument) as ei:
        parse_entry(entry, resolver({}))
    assert repr(entry) in ei.value.message and why in ei.value.message


def test_hostnames_resolved_and_pinned() -> None:
    """A host name becomes one /32 rule per A record, keeping the port."""
    rules = parse_allow_list(["pypi.org:443"], resolver({"pypi.org": ["151.101.0.223", "151.101.64.223"]}))
    assert [r.canonical() for r in rules] == ["151.101.0.223:443", "151.101.64.223:443"]
    assert all(r.exact_host and r.entry == "pypi.org:443" for r in rules)


def test_unresolvable_and_loopback_names_refused() -> None:
    """A name that does not resolve, or resolves to loopback, is refused by name."""
    with pytest.raises(InvalidArgument, match="cannot resolve 'nowhere.invalid'"):
        parse_allow_list(["nowhere.invalid"], resolver({}))
    with pytest.raises(InvalidArgument, match="loopback"):
        parse_allow_list(["localhost:80"], resolver({"localhost": ["127.0.0.1"]}))


def test_list_level_checks() -> None:
    """Non-list input, non-string items and oversize lists are refused; duplicates merge."""
    with pytest.raises(InvalidArgument, match="list of strings"):
        parse_allow_list("10.0.0.1")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="must be a string"):
        parse_allow_list([42])
    with pytest.raises(InvalidArgument, match="at most 256"):
        parse_allow_list([f"10.0.{i // 250}.{i % 250 + 1}" for i in range(257)])
    rules = parse_allow_list(["10.0.0.5:443", "10.0.0.5:443", "10.0.0.5"])
    assert [(r.network, r.ports) for r in rules] == [
        (ipaddress.IPv4Network("10.0.0.5/32"), None), (ipaddress.IPv4Network("10.0.0.5/32"), (443, 443))]
