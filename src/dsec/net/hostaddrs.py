"""The node's own addresses: never reachable from a sandbox unless the operator opens one.

"Node addresses" are every address the host itself answers on (any interface, the slots'
gateway addresses, loopback, broadcast) plus addresses the operator declares as the
node's or its cluster's (``Settings.net_node_addresses``). A tenant's allow-list can
never open them on its own: only destinations the operator lists in
``Settings.net_host_allow`` (``IP:PORT`` or ``IP:LO-HI``) may be named, and only those
ports open (the nftables rules check both the tenant's entry and the operator's list).

Pure decisions here; the one I/O edge (:func:`kernel_delivers_locally`) asks the kernel's
routing table, which is exactly what decides whether a packet goes to the host's input
path, so an address added to any interface later is covered without a listing.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dsec.errors import InvalidArgument
from dsec.net.allowlist import AllowRule, parse_allow_list

IsLocal = Callable[[ipaddress.IPv4Address], bool]


def parse_host_allow(entries: Iterable[str]) -> list[AllowRule]:
    """The operator's ``net_host_allow``: single addresses with a port or port range."""
    out = []
    for entry in entries:
        try:
            rules = parse_allow_list([entry])
        except InvalidArgument as e:
            raise InvalidArgument(f"Settings.net_host_allow (DSEC_NET_HOST_ALLOW): {e.message}",
                                  entry=entry) from None
        for r in rules:
            if not r.exact_host or r.ports is None:
                raise InvalidArgument(f"Settings.net_host_allow (DSEC_NET_HOST_ALLOW) entry {entry!r} must be "
                                      "one address with a port, e.g. '10.0.0.1:3128' or '10.0.0.1:8000-8010'",
                                      entry=entry)
        out += rules
    return out


def parse_node_addresses(entries: Iterable[str]) -> list[ipaddress.IPv4Network]:
    """``net_node_addresses``: IPs or CIDRs of this node / its cluster peers."""
    out = []
    for entry in entries:
        try:
            out.append(ipaddress.IPv4Network(str(entry).strip(), strict=False))
        except ValueError:
            raise InvalidArgument(f"Settings.net_node_addresses (DSEC_NET_NODE_ADDRESSES) entry {entry!r} "
                                  "is not an IPv4 address or CIDR", entry=entry) from None
    return out


def _covered(ports: tuple[int, int], allowed: list[tuple[int, int]]) -> bool:
    """True iff the union of ``allowed`` ranges covers ``ports`` entirely."""
    want = ports[0]
    for lo, hi in sorted(allowed):
        if lo > want:
            return False
        want = max(want, hi + 1)
        if want > ports[1]:
            return True
    return False


@dataclass(frozen=True)
class HostGuard:
    """Which destinations are the node, and which of them the operator opened."""

    sandbox_cidr: ipaddress.IPv4Network  # slots' /30s: every .1 is a gateway on the host
    node_nets: tuple[ipaddress.IPv4Network, ...] = ()
    host_allow: tuple[AllowRule, ...] = ()

    def is_node(self, addr: ipaddress.IPv4Address, is_local: IsLocal) -> bool:
        if addr.is_loopback or any(addr in n for n in self.node_nets):
            return True
        if addr in self.sandbox_cidr and (int(addr) - int(self.sandbox_cidr.network_address)) % 4 == 1:
            return True  # a slot gateway, whether or not that slot is built right now
        return is_local(addr)

    def check(self, rules: list[AllowRule], is_local: IsLocal) -> None:
        """Refuse (422) a tenant entry naming a node address the operator did not open,
        wholly. Broader CIDRs are fine: they never open node addresses (nftables)."""
        for r in rules:
            if not r.exact_host:
                continue
            addr = r.network.network_address
            if not self.is_node(addr, is_local):
                continue
            allowed = [a.ports for a in self.host_allow if a.network == r.network and a.ports]
            if r.ports is not None and _covered(r.ports, allowed):
                continue
            opened = ", ".join(a.canonical() for a in self.host_allow if a.network == r.network)
            raise InvalidArgument(
                f"network allow-list entry {r.entry!r}: {addr} is an address of the sandbox host "
                f"(node); the host's own services are not reachable from sandboxes"
                + (f" except {opened} (opened by the operator)" if opened else
                   " unless the operator opens a specific IP:PORT in DSEC_NET_HOST_ALLOW"),
                entry=r.entry, address=str(addr))


def kernel_delivers_locally(addr: ipaddress.IPv4Address) -> bool:
    """True if the host's routing table delivers ``addr`` to the host itself (local or
    broadcast route): such packets take the input path, i.e. reach host listeners."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    rtn_local, rtn_broadcast = 2, 3
    with IPRoute() as ipr:
        try:
            routes = ipr.route("get", dst=str(addr))
        except NetlinkError:
            return False  # unreachable: certainly not ours
    return any(r.get("type") in (rtn_local, rtn_broadcast) for r in routes)
