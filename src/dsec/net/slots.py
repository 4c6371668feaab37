"""Synchronous slot operations: build, allow-list install, destroy, inventory.

A *slot* is a ready-to-use sandbox network: netns file + veth pair (host end
``dsec<tag>h<idx>``, sandbox end ``eth0``) + addresses + default route + IFB egress
shaper (``dsec<tag>i<idx>``) + nft sets/chains/map entries. Building one costs tens of
milliseconds, so the manager keeps a pool; attaching is one record write plus one nft
transaction that fills the slot's (initially empty = deny-all) allow sets.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from dsec.config import Settings, parse_bytes
from dsec.net import links
from dsec.net.alloc import SlotAddr, SlotNames, instance_tag, parse_rate, slot_addr, slot_index_of
from dsec.net.allowlist import AllowRule
from dsec.net.faults import fault
from dsec.net.hostaddrs import parse_host_allow, parse_node_addresses
from dsec.net.nft import Nft, NftError
from dsec.net.records import RecordStore, SlotRecord
from dsec.net.rules import (
    PolicyParams,
    allow_script,
    base_script,
    ident,
    slot_chains_script,
    slot_delete_script,
    slot_script,
)

log = logging.getLogger(__name__)


@dataclass
class Inventory:
    """What of ours exists in the kernel/filesystem, by slot index."""

    indices: set[int]
    nft_present: set[str]
    idents: dict[int, list[str]]
    links: set[str]
    netns: set[str]


class SlotOps:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        root = Path(settings.runtime_dir).resolve()
        self.tag = instance_tag(str(root))
        self.dir = root / "net"
        self.ns_dir = self.dir / "ns"
        self.ns_dir.mkdir(parents=True, exist_ok=True)
        self.records = RecordStore(self.dir / "slots")
        group = settings.net_nflog_group
        if group is None:
            group = 0x1000 + int(self.tag, 16) % 0xE000
        self.params = PolicyParams(self.tag, settings.net_cidr, settings.net_max_connections,
                                   group, settings.net_denied_log_rate,
                                   tuple(parse_host_allow(settings.net_host_allow)),
                                   tuple(parse_node_addresses(settings.net_node_addresses)))
        self.rate = parse_rate(settings.net_egress_rate)
        self.burst = parse_bytes(settings.net_egress_burst)
        self.nft = Nft()

    # --- naming ----------------------------------------------------------------------
    def names(self, index: int) -> SlotNames:
        return SlotNames(self.tag, index)

    def addr(self, index: int) -> SlotAddr:
        return slot_addr(self.settings.net_cidr, index)

    def netns_path(self, index: int) -> str:
        return str(self.ns_dir / self.names(index).netns)

    @property
    def if_prefix(self) -> str:
        return f"dsec{self.tag}"

    # --- lifecycle -----------------------------------------------------------------
    def install_base(self) -> None:
        self.nft.run(base_script(self.params))

    def remove_base(self) -> None:
        t = self.params.table
        present = {o["table"]["family"] for o in self.nft.list_json("list tables") if "table" in o
                   and o["table"]["name"] == t}
        self.nft.run("".join(f"delete table {fam} {t}\n" for fam in sorted(present)))

    def build(self, index: int) -> None:
        """Create slot ``index`` (record first). On failure, undo and re-raise."""
        n, a = self.names(index), self.addr(index)
        self.records.write(SlotRecord(index=index, state="building", cidr=self.settings.net_cidr))
        fault("slot.recorded")
        spec = links.LinkSpec(
            netns_path=self.netns_path(index), host_if=n.host_if, host_mac=n.host_mac,
            sandbox_mac=n.mac, address_cidr=a.address_cidr, gateway_cidr=a.gateway_cidr,
            gateway=str(a.gateway), egress_rate_bps=self.rate, egress_burst_bytes=self.burst,
            egress_latency_us=int(self.settings.net_egress_latency_ms * 1000), ifb_if=n.ifb_if)
        try:
            links.build(spec, on_netns_created=lambda: fault("slot.netns"))
            fault("slot.links")
            links.configure_host_side(spec)
            fault("slot.host")
            self.nft.run(slot_script(self.params, n, a))
            fault("slot.nft")
            self.records.write(SlotRecord(index=index, state="ready", cidr=self.settings.net_cidr))
        except BaseException:
            try:
                self.destroy(index, inventory=self.inventory())
            except Exception:
                log.exception("cleanup of half-built network slot %d failed", index)
            raise

    def refresh_chains(self, index: int) -> None:
        """Rewrite an adopted slot's chains with this version's rules (sets untouched)."""
        self.nft.run(slot_chains_script(self.params, self.names(index)))

    def install_allow(self, index: int, sandbox_id: str, entries: list[str], rules: list[AllowRule],
                      point: str = "attach") -> None:
        self.records.write(SlotRecord(index=index, state="attached", sandbox_id=sandbox_id,
                                      allow=entries, cidr=self.settings.net_cidr))
        fault(f"{point}.recorded")
        self.nft.run(allow_script(self.params, self.names(index), rules))
        fault(f"{point}.nft")

    def destroy(self, index: int, inventory: Inventory | None = None) -> int:
        """Remove every resource of slot ``index``; returns how many were removed.
        ``inventory`` None = fast path for a complete slot we built (falls back to a
        listing if the kernel disagrees)."""
        n = self.names(index)
        removed = 0
        rec_existed = index in self.records.load_all() if inventory is not None else True
        self.records.write(SlotRecord(index=index, state="deleting", cidr=self.settings.net_cidr))
        fault("detach.recorded")
        if inventory is None:
            script = slot_delete_script(self.params, n, None, [ident(n, self.addr(index))])
            try:
                self.nft.run(script)
                removed += script.count("\n")
            except NftError:
                inventory = self.inventory()
        if inventory is not None:
            script = slot_delete_script(self.params, n, inventory.nft_present, inventory.idents.get(index, []))
            self.nft.run(script)
            removed += script.count("\n")
        fault("detach.nft")
        for ifname in (n.host_if, n.ifb_if):
            removed += links.delete_link(ifname)
        fault("detach.links")
        removed += links.delete_netns(self.netns_path(index))
        self.records.remove(index)
        return removed + (1 if rec_existed else 0)

    # --- inventory (for reconcile) ---------------------------------------------------
    def inventory(self) -> Inventory:
        t = self.params.table
        present: set[str] = set()
        idents: dict[int, list[str]] = {}
        indices: set[int] = set()
        for fam in ("inet", "arp"):
            for obj in self.nft.list_json(f"list table {fam} {t}"):
                kind = next(iter(obj))
                body = obj[kind]
                if kind in ("chain", "set", "map") and fam == "inet":
                    idx = slot_index_of(body["name"], self.tag)
                    if idx is not None:
                        present.add(body["name"])
                        indices.add(idx)
                if kind in ("set", "map") and body["name"] in ("fwdmap", "inmap", "ids"):
                    for elem in body.get("elem", []):
                        key = elem[0] if kind == "map" else elem
                        if isinstance(key, dict) and "concat" in key:
                            ifname, ip, mac = key["concat"]
                            idx = slot_index_of(ifname, self.tag)
                            if idx is None:
                                continue
                            text = f'"{ifname}" . {ip} . {mac}'
                            present.add(f"{'arpids' if fam == 'arp' else 'ids'}:{text}")
                            idents.setdefault(idx, [])
                            if text not in idents[idx]:
                                idents[idx].append(text)
                        elif isinstance(key, str):
                            idx = slot_index_of(key, self.tag)
                            if idx is not None:
                                present.add(f"{body['name']}:{key}")
                        else:
                            continue
                        if idx is not None:
                            indices.add(idx)
        link_names = set(links.list_links(self.if_prefix))
        indices |= {i for i in (slot_index_of(x, self.tag) for x in link_names) if i is not None}
        ns_names = {p.name for p in self.ns_dir.iterdir()}
        indices |= {i for i in (slot_index_of(x, self.tag) for x in ns_names) if i is not None}
        indices |= set(self.records.load_all())
        return Inventory(indices, present, idents, link_names, ns_names)

    def close(self) -> None:
        self.nft.close()
