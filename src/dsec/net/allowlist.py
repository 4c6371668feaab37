"""Parse and validate egress allow-list entries (pure; name resolution is injected).

Accepted forms (IPv4 only; sandboxes get no IPv6 route):

    IP            10.0.0.5            every protocol (TCP, UDP, ICMP) to that address
    IP:PORT       10.0.0.5:443        TCP and UDP to that port
    IP:LO-HI      10.0.0.5:8000-8100  TCP and UDP to that port range
    CIDR[:PORT]   10.0.0.0/8:443
    HOST[:PORT]   pypi.org:443        resolved by the node at create/update time and pinned

Decisions (see docs/network.md):
- "Allow everything" must be spelled out as ``0.0.0.0/0`` (optionally with a port).
  A bare ``0.0.0.0``, ``0/0`` or a prefix shorter than /8 other than /0 is refused as a
  likely mistake.
- Loopback (127/8) entries are refused: the sandbox's own loopback always works and the
  host's loopback is never reachable.
- Multicast / broadcast / unspecified destinations are refused.
- Host names are resolved once (all A records) and pinned: later DNS changes do not
  widen or move access; re-send the list with ``update`` to re-resolve.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dsec.errors import InvalidArgument

Resolver = Callable[[str], list[str]]

_HOST_RE = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")
MAX_ENTRIES = 256


@dataclass(frozen=True, order=True)
class AllowRule:
    """One resolved destination: a network and an optional inclusive port range."""

    network: ipaddress.IPv4Network
    ports: tuple[int, int] | None  # None = every protocol, every port
    entry: str  # the user's text this came from (for messages and audit)

    @property
    def exact_host(self) -> bool:
        """True for a single address: only these may open the host's own services."""
        return self.network.prefixlen == 32

    def canonical(self) -> str:
        net = str(self.network.network_address) if self.exact_host else str(self.network)
        if self.ports is None:
            return net
        lo, hi = self.ports
        return f"{net}:{lo}" if lo == hi else f"{net}:{lo}-{hi}"


def _bad(entry: str, why: str) -> InvalidArgument:
    return InvalidArgument(
        f"network allow-list entry {entry!r} is invalid: {why}. "
        "Use IP[:PORT], CIDR[:PORT] or HOSTNAME[:PORT], e.g. '10.0.0.5:443' or '10.0.0.0/8'.",
        entry=entry,
    )


def _parse_ports(entry: str, text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", text)
    if not m:
        raise _bad(entry, f"port {text!r} is not a number or LO-HI range")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if not (1 <= lo <= 65535 and 1 <= hi <= 65535):
        raise _bad(entry, "ports must be within 1-65535")
    if lo > hi:
        raise _bad(entry, f"port range {lo}-{hi} is reversed")
    return lo, hi


def _split(entry: str) -> tuple[str, str | None]:
    if entry.count(":") > 1 or entry.startswith("["):
        raise _bad(entry, "IPv6 destinations are not supported (sandboxes are IPv4-only)")
    if ":" in entry:
        host, port = entry.rsplit(":", 1)
        return host, port
    return entry, None


def _check_network(entry: str, host: str, net: ipaddress.IPv4Network) -> None:
    if net.prefixlen == 0:
        if host != "0.0.0.0/0":
            raise _bad(entry, "to allow every destination write exactly '0.0.0.0/0'")
        return
    if net.prefixlen < 8:
        raise _bad(entry, f"prefix /{net.prefixlen} is suspiciously broad; use /8 or longer, "
                          "or '0.0.0.0/0' if you really mean everything")
    addr = net.network_address
    if addr.is_loopback or net.subnet_of(ipaddress.IPv4Network("127.0.0.0/8")):
        raise _bad(entry, "loopback is always reachable inside the sandbox and never reaches the host")
    if addr.is_multicast or addr == ipaddress.IPv4Address("255.255.255.255"):
        raise _bad(entry, "multicast/broadcast destinations are not supported")
    if addr.is_unspecified:
        raise _bad(entry, "0.0.0.0 is not a destination")


def parse_entry(entry: object, resolve: Resolver | None = None) -> list[AllowRule]:
    """Parse one entry into rules (a host name may give several). Raises InvalidArgument."""
    if not isinstance(entry, str):
        raise InvalidArgument(f"network allow-list entry {entry!r} must be a string", entry=repr(entry))
    text = entry.strip().lower()
    if not text or len(text) > 300 or any(c.isspace() or c == "\0" for c in text):
        raise _bad(entry, "empty, too long or contains whitespace")
    host, port_text = _split(text)
    ports = _parse_ports(entry, port_text) if port_text is not None else None
    if re.fullmatch(r"[\d./]+", host):
        try:
            net = ipaddress.IPv4Network(host, strict=True)
        except ipaddress.NetmaskValueError as e:
            raise _bad(entry, f"bad prefix length ({e})") from None
        except ValueError as e:
            if "has host bits set" in str(e):
                raise _bad(entry, f"{host} has host bits set (did you mean "
                                  f"{ipaddress.IPv4Network(host, strict=False)})") from None
            raise _bad(entry, f"{host!r} is not an IPv4 address or CIDR") from None
        _check_network(entry, host, net)
        return [AllowRule(net, ports, entry)]
    if not _HOST_RE.match(host):
        raise _bad(entry, f"{host!r} is not a valid host name")
    if resolve is None:
        raise _bad(entry, "host names need a resolver (none given)")
    try:
        addrs = resolve(host)
    except OSError as e:
        raise InvalidArgument(f"network allow-list entry {entry!r}: cannot resolve {host!r} ({e}); "
                              "check the name or list its IP address instead", entry=entry) from None
    if not addrs:
        raise InvalidArgument(f"network allow-list entry {entry!r}: {host!r} has no IPv4 address; "
                              "list its IP address instead", entry=entry)
    rules = []
    for a in sorted(set(addrs)):
        net = ipaddress.IPv4Network(f"{a}/32")
        _check_network(entry, a, net)
        rules.append(AllowRule(net, ports, entry))
    return rules


def parse_allow_list(entries: Iterable[object], resolve: Resolver | None = None) -> list[AllowRule]:
    """Parse a whole allow-list: sorted, de-duplicated rules. Raises InvalidArgument."""
    if isinstance(entries, str | bytes):
        raise InvalidArgument("network allow-list must be a list of strings, not a single string")
    items = list(entries)
    if len(items) > MAX_ENTRIES:
        raise InvalidArgument(f"network allow-list has {len(items)} entries; at most {MAX_ENTRIES} allowed")
    seen: dict[tuple[ipaddress.IPv4Network, tuple[int, int] | None], AllowRule] = {}
    for item in items:
        for rule in parse_entry(item, resolve):
            seen.setdefault((rule.network, rule.ports), rule)
    return sorted(seen.values(), key=lambda r: (r.network, r.ports or (0, 0)))


def system_resolver(host: str) -> list[str]:
    """Resolve ``host`` to its IPv4 addresses with the node's resolver (I/O edge)."""
    import socket

    infos = socket.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})
