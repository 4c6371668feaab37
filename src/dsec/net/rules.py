"""Render the nftables scripts of the network policy (pure: text in, text out).

Layout (one table per node agent, ``inet dsec_<tag>``, plus ``arp dsec_<tag>``):

- ``pre`` (prerouting, raw priority): anti-spoofing before conntrack sees anything:
  a packet from a sandbox veth must carry that veth's (ifname, IP, MAC) triple
  (set ``ids``); IPv6 from sandboxes is dropped.
- ``forward``: nothing may open a connection *into* a sandbox (only replies pass), so
  sandbox-to-sandbox and remote-to-sandbox are refused whatever the allow-lists say;
  traffic *from* a sandbox veth jumps via ``fwdmap`` to the slot's chain, which accepts
  allow-listed destinations and rejects (and logs) the rest. Egress is judged per
  packet, not only at connection start, so removing a destination with ``update`` also
  cuts established flows.
- ``input``: traffic from a sandbox to any of the host's own addresses goes via ``inmap``
  to the slot's input chain. It opens a host destination only if the tenant named that
  exact address (a broad CIDR such as ``0.0.0.0/0`` never opens host services) AND the
  operator listed it in ``hostallow`` (``Settings.net_host_allow``); everything else is
  refused and logged. The slot's forward chain sends the operator's declared node
  addresses (``nodes``: ``Settings.net_node_addresses``, e.g. cluster peers) to the
  same input chain, so they get the host's treatment whatever the tenant's CIDRs say.
- ``allowed``: per-source concurrent connection limit (``ct count``), then accept.
- ``post`` (nat): masquerade sandbox traffic leaving through a non-sandbox interface.
- ``arp dsec_<tag> in``: ARP from a sandbox veth must carry the veth's IP and MAC.

Base chains keep ``policy accept`` and match only our interfaces (``dsec<tag>h*``), so
the host's other traffic and other tables are never affected.
"""

from __future__ import annotations

import ipaddress
import itertools
from dataclasses import dataclass

from dsec.net.alloc import PREFIX, SlotAddr, SlotNames
from dsec.net.allowlist import AllowRule


@dataclass(frozen=True)
class PolicyParams:
    tag: str
    cidr: str
    max_connections: int
    log_group: int
    log_rate: int  # denied packets logged per second per sandbox
    host_allow: tuple[AllowRule, ...] = ()  # operator: host/node IP:PORTs sandboxes may name
    node_nets: tuple[ipaddress.IPv4Network, ...] = ()  # operator: other node/cluster addresses

    @property
    def table(self) -> str:
        return f"{PREFIX}_{self.tag}"

    @property
    def if_glob(self) -> str:
        return f'"{PREFIX}{self.tag}h*"'


def base_script(p: PolicyParams) -> str:
    """Idempotent: (re)creates the table's base chains; slot chains and sets survive."""
    t, g = p.table, p.if_glob
    return f"""
add table inet {t}
add set inet {t} ids {{ type ifname . ipv4_addr . ether_addr; }}
add set inet {t} connlim {{ type ipv4_addr; size 65535; flags dynamic; }}
add map inet {t} fwdmap {{ type ifname : verdict; }}
add map inet {t} inmap {{ type ifname : verdict; }}
add set inet {t} hostallow {{ type ipv4_addr . inet_service; flags interval; }}
flush set inet {t} hostallow
add set inet {t} nodes {{ type ipv4_addr; flags interval; auto-merge; }}
flush set inet {t} nodes
{_base_elements(p)}add chain inet {t} allowed
flush chain inet {t} allowed
add rule inet {t} allowed ct state new add @connlim {{ ip saddr ct count over {p.max_connections} }} \
counter reject with icmpx type admin-prohibited
add rule inet {t} allowed accept
add chain inet {t} pre {{ type filter hook prerouting priority raw; policy accept; }}
flush chain inet {t} pre
add rule inet {t} pre iifname {g} meta nfproto ipv6 drop
add rule inet {t} pre iifname {g} iifname . ip saddr . ether saddr != @ids counter drop
add chain inet {t} forward {{ type filter hook forward priority filter; policy accept; }}
flush chain inet {t} forward
add rule inet {t} forward oifname {g} ct state established,related accept
add rule inet {t} forward oifname {g} drop
add rule inet {t} forward iifname {g} iifname vmap @fwdmap
add rule inet {t} forward iifname {g} drop
add chain inet {t} input {{ type filter hook input priority filter; policy accept; }}
flush chain inet {t} input
add rule inet {t} input iifname {g} iifname vmap @inmap
add rule inet {t} input iifname {g} drop
add chain inet {t} post {{ type nat hook postrouting priority srcnat; policy accept; }}
flush chain inet {t} post
add rule inet {t} post ip saddr {p.cidr} oifname != {g} masquerade
add table arp {t}
add set arp {t} ids {{ type ifname . ipv4_addr . ether_addr; }}
add chain arp {t} in {{ type filter hook input priority filter; policy accept; }}
flush chain arp {t} in
add rule arp {t} in iifname {g} iifname . arp saddr ip . arp saddr ether != @ids counter drop
"""


def _base_elements(p: PolicyParams) -> str:
    """The operator's node-address lists, refilled at every start (settings may change)."""
    t, lines = p.table, []
    allow = port_elements(list(p.host_allow))
    if allow:
        elems = ", ".join(f"{_range(a, b)} . {_range(c, d, str)}" for a, b, c, d in allow)
        lines.append(f"add element inet {t} hostallow {{ {elems} }}")
    if p.node_nets:
        lines.append(f"add element inet {t} nodes {{ {', '.join(str(n) for n in p.node_nets)} }}")
    return "".join(line + "\n" for line in lines)


def _deny_rules(p: PolicyParams, chain: str, prefix: str) -> str:
    t = p.table
    return f"""add rule inet {t} {chain} counter limit rate {p.log_rate}/second burst {p.log_rate} packets \
log prefix "{prefix}" group {p.log_group}
add rule inet {t} {chain} meta l4proto tcp reject with tcp reset
add rule inet {t} {chain} reject with icmpx type admin-prohibited
"""


def slot_script(p: PolicyParams, n: SlotNames, addr: SlotAddr) -> str:
    """Create one slot's sets, chains and map entries (empty allow-list = deny all)."""
    t = p.table
    idt = ident(n, addr)
    return f"""
add set inet {t} {n.set_hosts} {{ type ipv4_addr; flags interval; auto-merge; }}
add set inet {t} {n.set_ports} {{ type ipv4_addr . inet_service; flags interval; }}
add set inet {t} {n.set_local_hosts} {{ type ipv4_addr; flags interval; auto-merge; }}
add set inet {t} {n.set_local_ports} {{ type ipv4_addr . inet_service; flags interval; }}
{slot_chains_script(p, n)}
add element inet {t} fwdmap {{ "{n.host_if}" : jump {n.chain_fwd} }}
add element inet {t} inmap {{ "{n.host_if}" : jump {n.chain_in} }}
add element inet {t} ids {{ {idt} }}
add element arp {t} ids {{ {idt} }}
"""


def slot_chains_script(p: PolicyParams, n: SlotNames) -> str:
    """(Re)write one slot's two chains; run at build and for slots adopted at start, so a
    restart after an upgrade never keeps an older, wider rule set. The sets survive."""
    t = p.table
    return f"""add chain inet {t} {n.chain_fwd}
add chain inet {t} {n.chain_in}
flush chain inet {t} {n.chain_fwd}
add rule inet {t} {n.chain_fwd} ip daddr @nodes goto {n.chain_in}
add rule inet {t} {n.chain_fwd} ip daddr @{n.set_hosts} goto allowed
add rule inet {t} {n.chain_fwd} meta l4proto {{ tcp, udp }} ip daddr . th dport @{n.set_ports} goto allowed
{_deny_rules(p, n.chain_fwd, n.log_prefix + ':f')}
flush chain inet {t} {n.chain_in}
add rule inet {t} {n.chain_in} ip daddr @{n.set_local_hosts} meta l4proto {{ tcp, udp }} \
ip daddr . th dport @hostallow goto allowed
add rule inet {t} {n.chain_in} meta l4proto {{ tcp, udp }} ip daddr . th dport @{n.set_local_ports} \
ip daddr . th dport @hostallow goto allowed
{_deny_rules(p, n.chain_in, n.log_prefix + ':i')}"""


def _ip(v: int) -> str:
    return str(ipaddress.IPv4Address(v))


def _range(lo: int, hi: int, fmt=_ip) -> str:
    return fmt(lo) if lo == hi else f"{fmt(lo)}-{fmt(hi)}"


def host_elements(rules: list[AllowRule]) -> list[tuple[int, int]]:
    """Merged address intervals of the rules without a port (every protocol)."""
    spans = sorted((int(r.network.network_address), int(r.network.broadcast_address))
                   for r in rules if r.ports is None)
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _merge_ranges(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def port_elements(rules: list[AllowRule]) -> list[tuple[int, int, int, int]]:
    """Pairwise-disjoint (addr_lo, addr_hi, port_lo, port_hi) boxes covering exactly the
    rules with ports. The kernel's concatenated-range set refuses overlapping elements,
    so overlapping user entries (10.0.0.0/8:443 and 10.1.2.3:443) are cut into disjoint
    address intervals first, each with the merged port ranges that cover it."""
    boxes = [(int(r.network.network_address), int(r.network.broadcast_address), r.ports)
             for r in rules if r.ports is not None]
    if not boxes:
        return []
    cuts = sorted({lo for lo, _, _ in boxes} | {hi + 1 for _, hi, _ in boxes})
    out: list[tuple[int, int, int, int]] = []
    prev: tuple[int, int, tuple[tuple[int, int], ...]] | None = None
    segments: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
    for a, b in itertools.pairwise(cuts):
        ports = _merge_ranges([pr for lo, hi, pr in boxes if lo <= a and b - 1 <= hi and pr])
        if not ports:
            continue
        if prev and prev[1] + 1 == a and prev[2] == ports:  # coalesce equal neighbours
            prev = (prev[0], b - 1, ports)
            segments[-1] = prev
        else:
            prev = (a, b - 1, ports)
            segments.append(prev)
    for lo, hi, ports in segments:
        out.extend((lo, hi, plo, phi) for plo, phi in ports)
    return out


def allow_script(p: PolicyParams, n: SlotNames, rules: list[AllowRule]) -> str:
    """Replace one slot's allow-list atomically (run as one nft transaction)."""
    t = p.table
    local = [r for r in rules if r.exact_host]
    lines = [f"flush set inet {t} {s}" for s in n.sets]

    def add(set_name: str, elems: list[str]) -> None:
        if elems:
            lines.append(f"add element inet {t} {set_name} {{ {', '.join(elems)} }}")

    add(n.set_hosts, [_range(lo, hi) for lo, hi in host_elements(rules)])
    add(n.set_ports, [f"{_range(a, b)} . {_range(c, d, str)}" for a, b, c, d in port_elements(rules)])
    add(n.set_local_hosts, [_range(lo, hi) for lo, hi in host_elements(local)])
    add(n.set_local_ports, [f"{_range(a, b)} . {_range(c, d, str)}" for a, b, c, d in port_elements(local)])
    return "\n".join(lines) + "\n"


def slot_delete_script(p: PolicyParams, n: SlotNames, present: set[str] | None,
                       idents: list[str]) -> str:
    """Delete one slot's nft objects. ``present`` = object names that exist (from a
    listing; None = all of them, the fast path for a slot we built ourselves);
    ``idents`` = the slot's ``ids`` elements as text (``"if" . ip . mac``)."""
    t = p.table
    has = (lambda name: True) if present is None else (lambda name: name in present)
    lines: list[str] = []
    for m in ("fwdmap", "inmap"):
        if has(f"{m}:{n.host_if}"):
            lines.append(f'delete element inet {t} {m} {{ "{n.host_if}" }}')
    for idt in idents:
        if has(f"ids:{idt}"):
            lines.append(f"delete element inet {t} ids {{ {idt} }}")
        if has(f"arpids:{idt}"):
            lines.append(f"delete element arp {t} ids {{ {idt} }}")
    for c in n.chains:
        if has(c):
            lines.append(f"delete chain inet {t} {c}")
    for s in n.sets:
        if has(s):
            lines.append(f"delete set inet {t} {s}")
    return "\n".join(lines) + ("\n" if lines else "")


def ident(n: SlotNames, addr: SlotAddr) -> str:
    return f'"{n.host_if}" . {addr.address} . {n.mac}'
