"""Network namespaces, veth pairs, addresses, routes and the egress policer (I/O edge).

A netns is created by a short-lived dedicated thread that ``unshare(CLONE_NEWNET)``s
itself and bind-mounts its ``/proc/thread-self/ns/net`` onto a file, so no process is
forked (``ip netns add`` and pyroute2's NetNS both fork) and the caller's namespace is
never touched. Netlink sockets opened by that thread live in the new namespace, which
is how the sandbox side is configured without entering it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pyroute2 import IPRoute, protocols
from pyroute2.netlink.exceptions import NetlinkError

from dsec.node import syscalls

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)
T = TypeVar("T")


@dataclass(frozen=True)
class LinkSpec:
    netns_path: str
    host_if: str
    host_mac: str
    sandbox_mac: str
    address_cidr: str  # sandbox side, e.g. 10.213.0.2/30
    gateway_cidr: str  # host side, e.g. 10.213.0.1/30
    gateway: str
    egress_rate_bps: int  # bytes per second, 0 = unlimited
    egress_burst_bytes: int
    egress_latency_us: int
    ifb_if: str


def _in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a fresh OS thread (its namespace changes die with it)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["ok"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["err"] = e

    t = threading.Thread(target=target, name="dsec-netns", daemon=True)
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]  # type: ignore[misc]
    return box["ok"]  # type: ignore[return-value]


def _write_sysctl(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def build(spec: LinkSpec, on_netns_created: Callable[[], None] | None = None) -> None:
    """Create the netns at ``spec.netns_path``, the veth pair (sandbox side ``eth0``
    inside it), addresses, default route, and the host-side egress policer."""

    def work() -> None:
        Path(spec.netns_path).touch(mode=0o600, exist_ok=True)
        host_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            if _libc.unshare(CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
            syscalls.mount("/proc/thread-self/ns/net", spec.netns_path, "none", syscalls.MS_BIND)
            if on_netns_created:
                on_netns_created()
            # This thread is now inside the new namespace: /proc/sys/net and new netlink
            # sockets refer to it. The sandbox gets no IPv6 at all.
            for key in ("all", "default"):
                _write_sysctl(f"/proc/sys/net/ipv6/conf/{key}/disable_ipv6", "1")
            with IPRoute() as inner:
                inner.link("set", index=inner.link_lookup(ifname="lo")[0], state="up")
                # Create the pair here (sandbox end = eth0) with the peer placed straight
                # into the caller's namespace: no name clash with the host's own eth0.
                inner.link("add", ifname="eth0", kind="veth", address=spec.sandbox_mac,
                           peer={"ifname": spec.host_if, "address": spec.host_mac, "net_ns_fd": host_ns})
                eth = inner.link_lookup(ifname="eth0")[0]
                addr, plen = spec.address_cidr.split("/")
                inner.addr("add", index=eth, address=addr, prefixlen=int(plen))
                inner.link("set", index=eth, state="up")
                inner.route("add", dst="0.0.0.0/0", gateway=spec.gateway)
        finally:
            os.close(host_ns)

    _in_thread(work)


def configure_host_side(spec: LinkSpec) -> None:
    """Address, sysctls and egress shaper on the host end (runs in the host namespace).

    What the sandbox sends arrives on the host end's *ingress*, where Linux can only
    police (drop), which TCP handles badly. So ingress is redirected to a per-slot IFB
    device whose egress TBF qdisc shapes (queues) it; IFB then re-injects the packets as
    if received on the veth, so the nft rules still see ``iifname`` = the veth. All of it
    is in the host namespace, out of reach of anything inside the sandbox.
    """
    v6 = f"/proc/sys/net/ipv6/conf/{spec.host_if}/disable_ipv6"
    if os.path.exists(v6):
        _write_sysctl(v6, "1")
    _write_sysctl(f"/proc/sys/net/ipv4/conf/{spec.host_if}/rp_filter", "1")
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=spec.host_if)[0]
        addr, plen = spec.gateway_cidr.split("/")
        ipr.addr("add", index=idx, address=addr, prefixlen=int(plen))
        ipr.link("set", index=idx, state="up")
        if spec.egress_rate_bps > 0:
            ipr.link("add", ifname=spec.ifb_if, kind="ifb")
            ifb = ipr.link_lookup(ifname=spec.ifb_if)[0]
            ipr.link("set", index=ifb, state="up")
            ipr.tc("add", "tbf", ifb, 0x10000, rate=spec.egress_rate_bps,
                   burst=spec.egress_burst_bytes, latency=spec.egress_latency_us)
            ipr.tc("add", "ingress", idx, 0xFFFF0000)
            ipr.tc("add-filter", "u32", idx, parent=0xFFFF0000, protocol=protocols.ETH_P_ALL, prio=1,
                   keys=["0x0/0x0+0"], target=0x1,
                   action={"kind": "mirred", "direction": "egress", "action": "redirect", "ifindex": ifb})


def delete_link(ifname: str) -> bool:
    """Delete a host-side veth (its peer goes with it). False if it did not exist."""
    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=ifname)
        if not found:
            return False
        try:
            ipr.link("del", index=found[0])
        except NetlinkError as e:
            if e.code != errno.ENODEV:
                raise
            return False
    return True


def delete_netns(path: str) -> bool:
    """Unmount and remove a bind-mounted netns file. False if nothing was there."""
    existed = os.path.exists(path)
    try:
        syscalls.umount(path)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOENT):
            raise
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return existed


def list_links(prefix: str) -> list[str]:
    with IPRoute() as ipr:
        return [link.get_attr("IFLA_IFNAME") for link in ipr.get_links()
                if (link.get_attr("IFLA_IFNAME") or "").startswith(prefix)]


def routes_overlapping(cidr: str, own_prefix: str) -> list[str]:
    """Routes in the host namespace that overlap ``cidr`` on interfaces not ours."""
    import ipaddress

    net = ipaddress.IPv4Network(cidr)
    out = []
    with IPRoute() as ipr:
        names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
        for r in ipr.get_routes(family=2, table=254):
            dst = r.get_attr("RTA_DST")
            if dst is None:
                continue
            rnet = ipaddress.IPv4Network(f"{dst}/{r['dst_len']}")
            dev = names.get(r.get_attr("RTA_OIF"), "?")
            if rnet.overlaps(net) and not dev.startswith(own_prefix):
                out.append(f"{rnet} dev {dev}")
    return out
