"""Slot address allocator and resource naming (pure).

The private range ``Settings.net_cidr`` is cut into /30 blocks, one per network slot:
``.0`` network, ``.1`` gateway (host side of the veth), ``.2`` the sandbox, ``.3``
broadcast. A /30 per slot (rather than one shared subnet) keeps every sandbox on its own
link, so ARP or address tricks inside one sandbox cannot reach a neighbour's link at
all; /31 would double capacity but gVisor's netstack and some tools mishandle it.

Names carry a 4-hex instance tag derived from the runtime dir, so two node agents (or a
test run next to a dev node) on one machine never reconcile each other's resources.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Collection
from dataclasses import dataclass

from dsec.errors import CapacityExhausted, InvalidArgument

SLOT_PREFIX = 30
PREFIX = "dsec"


@dataclass(frozen=True)
class SlotAddr:
    index: int
    network: ipaddress.IPv4Network
    gateway: ipaddress.IPv4Address
    address: ipaddress.IPv4Address

    @property
    def address_cidr(self) -> str:
        return f"{self.address}/{SLOT_PREFIX}"

    @property
    def gateway_cidr(self) -> str:
        return f"{self.gateway}/{SLOT_PREFIX}"


def parse_cidr(cidr: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(cidr, strict=True)
    except ValueError as e:
        raise InvalidArgument(f"Settings.net_cidr {cidr!r} is not an IPv4 CIDR ({e})") from None
    if net.prefixlen > 29:
        raise InvalidArgument(f"Settings.net_cidr {cidr!r} is too small: need at least a /29")
    if not net.is_private:
        raise InvalidArgument(f"Settings.net_cidr {cidr!r} must be a private range (e.g. 10.213.0.0/16)")
    return net


def capacity(cidr: str) -> int:
    """Number of slots in the range (max 65536: slot ids must fit 4 hex digits)."""
    net = parse_cidr(cidr)
    return min(2 ** (SLOT_PREFIX - net.prefixlen), 0x10000)


def slot_addr(cidr: str, index: int) -> SlotAddr:
    net = parse_cidr(cidr)
    if not 0 <= index < capacity(cidr):
        raise InvalidArgument(f"slot index {index} outside {cidr} (capacity {capacity(cidr)})")
    base = int(net.network_address) + index * 4
    block = ipaddress.IPv4Network((base, SLOT_PREFIX))
    return SlotAddr(index, block, ipaddress.IPv4Address(base + 1), ipaddress.IPv4Address(base + 2))


def allocate(cidr: str, used: Collection[int], cursor: int = 0) -> int:
    """First free slot index at or after ``cursor`` (wrapping).

    Rotating from a cursor instead of always taking the lowest free index delays reuse
    of an address just released, so stale conntrack entries or remote caches of a dead
    sandbox's address do not meet its successor.
    """
    cap = capacity(cidr)
    if len(used) >= cap:
        raise CapacityExhausted(f"network range {cidr} has no free slot ({cap} in use); "
                                "widen Settings.net_cidr or destroy sandboxes", retry_after=1.0)
    for step in range(cap):
        idx = (cursor + step) % cap
        if idx not in used:
            return idx
    raise CapacityExhausted(f"network range {cidr} has no free slot", retry_after=1.0)  # pragma: no cover


def instance_tag(runtime_dir: str) -> str:
    """4 hex chars identifying one node agent's resources on this machine."""
    return hashlib.sha256(runtime_dir.encode()).hexdigest()[:4]


@dataclass(frozen=True)
class SlotNames:
    """Every host-visible name of one slot (all start with ``dsec`` + tag)."""

    tag: str
    index: int

    @property
    def host_if(self) -> str:  # 4 + 4 + 1 + 4 = 13 chars, under IFNAMSIZ (15)
        return f"{PREFIX}{self.tag}h{self.index:04x}"

    @property
    def ifb_if(self) -> str:  # shapes the sandbox's egress (see links.configure_host_side)
        return f"{PREFIX}{self.tag}i{self.index:04x}"

    @property
    def netns(self) -> str:
        return f"{PREFIX}{self.tag}n{self.index:04x}"

    @property
    def chain_fwd(self) -> str:
        return f"sbf{self.index:04x}"

    @property
    def chain_in(self) -> str:
        return f"sbi{self.index:04x}"

    @property
    def set_hosts(self) -> str:  # no-port destinations (forward path)
        return f"sbh{self.index:04x}"

    @property
    def set_ports(self) -> str:  # destination . port ranges (forward path)
        return f"sbp{self.index:04x}"

    @property
    def set_local_hosts(self) -> str:  # exact host addresses allowed on the input path
        return f"sblh{self.index:04x}"

    @property
    def set_local_ports(self) -> str:
        return f"sblp{self.index:04x}"

    @property
    def log_prefix(self) -> str:
        return f"{PREFIX}{self.tag}:{self.index:04x}"

    @property
    def mac(self) -> str:
        """Deterministic locally-administered MAC of the sandbox side."""
        t = int(self.tag, 16)
        return f"02:d5:{t >> 8:02x}:{t & 0xFF:02x}:{self.index >> 8:02x}:{self.index & 0xFF:02x}"

    @property
    def host_mac(self) -> str:
        t = int(self.tag, 16)
        return f"02:d4:{t >> 8:02x}:{t & 0xFF:02x}:{self.index >> 8:02x}:{self.index & 0xFF:02x}"

    @property
    def chains(self) -> tuple[str, ...]:
        return (self.chain_fwd, self.chain_in)

    @property
    def sets(self) -> tuple[str, ...]:
        return (self.set_hosts, self.set_ports, self.set_local_hosts, self.set_local_ports)


def slot_index_of(name: str, tag: str) -> int | None:
    """Slot index encoded in one of our interface/netns/chain/set names, else None."""
    for head in (f"{PREFIX}{tag}h", f"{PREFIX}{tag}i", f"{PREFIX}{tag}n", "sbf", "sbi", "sbh", "sbp", "sblh", "sblp"):
        if name.startswith(head):
            rest = name[len(head):]
            if len(rest) == 4:
                try:
                    return int(rest, 16)
                except ValueError:
                    return None
    return None


_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
               "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}


def parse_rate(text: str) -> int:
    """tc-style rate ('100mbit', '10mbps' = bytes, '0' or 'none' = unlimited) -> bytes/s."""
    t = str(text).strip().lower()
    if t in ("0", "none", "unlimited", ""):
        return 0
    for unit in sorted(_RATE_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            try:
                value = float(t[: -len(unit)])
            except ValueError:
                break
            if value <= 0:
                break
            return max(1, int(value * _RATE_UNITS[unit]))
    raise InvalidArgument(f"bandwidth {text!r} is invalid: use e.g. '100mbit', '1gbit' or '0' for unlimited")
