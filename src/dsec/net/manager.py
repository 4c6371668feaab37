"""NetworkManager: the node agent's sandbox-networking service.

``attach`` takes a pre-built slot from the pool (or builds one if the pool is dry),
records the owner, and installs the allow-list in one nft transaction. Blocking kernel
work runs in worker threads so the node's event loop never stalls.

Start/restart contract: ``start()`` removes every slot of ours that is not recorded as
attached (half-built, pooled by a previous process, half-deleted, orphan kernel objects);
then the caller passes the sandboxes that survived to ``reconcile(live_ids)``, which
removes the rest and re-adopts the survivors' slots.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import time

from dsec.config import Settings
from dsec.errors import Conflict, NotFound
from dsec.net import links
from dsec.net.alloc import allocate
from dsec.net.allowlist import AllowRule, parse_allow_list, system_resolver
from dsec.net.hostaddrs import HostGuard, kernel_delivers_locally, parse_host_allow, parse_node_addresses
from dsec.net.models import DeniedAttempt, NetAttachment
from dsec.net.nflog import NflogSocket, parse_ipv4
from dsec.net.slots import SlotOps

log = logging.getLogger(__name__)

__all__ = ["DeniedAttempt", "NetAttachment", "NetworkManager"]


RETIRED_MAX = 4096
"""Detached sandboxes whose denied attempts stay readable (bounded: at most this many)."""


class NetworkManager:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._ops: SlotOps | None = None
        self._ready: collections.deque[int] = collections.deque()
        self._building: set[int] = set()
        self._owner: dict[int, str] = {}  # slot -> sandbox id
        self._slot_of: dict[str, int] = {}  # sandbox id -> slot
        self._attachments: dict[str, NetAttachment] = {}
        self._events: dict[str, collections.deque[DeniedAttempt]] = {}
        # Attempts of detached sandboxes, most recent RETIRED_MAX kept: the API server (maybe on
        # another machine) reads a sandbox's last attempts over the node protocol after its
        # teardown, with no hook into this process.
        self._retired: collections.OrderedDict[str, collections.deque[DeniedAttempt]] = collections.OrderedDict()
        self._cursor = 0
        # Microseconds at start, +1 per attempt: keeps increasing across node restarts, so
        # a reader resuming with denied_events(since_seq=...) never skips new attempts.
        self._seq = time.time_ns() // 1000
        self._nflog: NflogSocket | None = None
        self._fill_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._closing = False
        self._inflight: dict[int, asyncio.Future[None]] = {}  # slot -> build still in its thread
        self._guard = HostGuard(ipaddress.IPv4Network(settings.net_cidr),
                                tuple(parse_node_addresses(settings.net_node_addresses)),
                                tuple(parse_host_allow(settings.net_host_allow)))

    @property
    def ops(self) -> SlotOps:
        if self._ops is None:
            raise Conflict("NetworkManager is not started: call await start() first")
        return self._ops

    # --- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.close()  # never leave a half-started manager's table behind
            raise

    async def _start(self) -> None:
        ops = self._ops = await asyncio.to_thread(SlotOps, self.settings)
        clash = await asyncio.to_thread(links.routes_overlapping, self.settings.net_cidr, ops.if_prefix)
        if clash:
            raise Conflict(f"Settings.net_cidr {self.settings.net_cidr} overlaps existing routes "
                           f"({', '.join(clash)}); pick a free private range for DSEC_NET_CIDR")
        if self.settings.net_enable_forwarding:
            await asyncio.to_thread(_enable_forwarding)
        await asyncio.to_thread(ops.install_base)
        self._nflog = NflogSocket(ops.params.log_group)
        asyncio.get_running_loop().add_reader(self._nflog.fileno(), self._on_nflog)
        await self._reconcile(live=None)
        self._fill_task = asyncio.create_task(self._fill_pool(), name="dsec-net-pool")

    async def close(self) -> None:
        """Stop the pool, remove pooled slots; attached slots stay for the next start."""
        self._closing = True
        if self._fill_task:
            self._fill_task.cancel()
            try:
                await self._fill_task
            except asyncio.CancelledError:
                pass
            except Exception:
                log.debug("pool filler ended with an error", exc_info=True)
        if self._inflight:
            builds = dict(self._inflight)
            await asyncio.wait(builds.values())
            for idx, fut in builds.items():  # built for the pool, never handed out
                if fut.exception() is None and idx not in self._owner and idx not in self._ready:
                    self._ready.append(idx)
        if self._nflog:
            asyncio.get_running_loop().remove_reader(self._nflog.fileno())
            self._nflog.close()
            self._nflog = None
        if self._ops is None:
            return
        while self._ready:
            idx = self._ready.popleft()
            await asyncio.to_thread(self.ops.destroy, idx)
        if not self._slot_of and not await asyncio.to_thread(self.ops.records.load_all):
            await asyncio.to_thread(self.ops.remove_base)
        await asyncio.to_thread(self.ops.close)
        self._ops = None

    # --- the four operations -------------------------------------------------------
    async def attach(self, sandbox_id: str, allow: list[str]) -> NetAttachment:
        entries, rules = await self._parse(allow)
        if sandbox_id in self._slot_of:
            raise Conflict(f"sandbox {sandbox_id} already has a network; use update() to change it")
        self._slot_of[sandbox_id] = -1  # reserve the id against a concurrent attach
        try:
            idx = self._ready.popleft() if self._ready else await self._build_one()
            self._owner[idx] = sandbox_id
            self._slot_of[sandbox_id] = idx
            self._events[sandbox_id] = collections.deque(maxlen=self.settings.net_denied_log_max)
            try:
                await asyncio.to_thread(self.ops.install_allow, idx, sandbox_id, entries, rules)
            except BaseException:
                await asyncio.to_thread(self.ops.destroy, idx)
                self._owner.pop(idx, None)
                raise
            finally:
                self._wake.set()  # refill after our transaction, not competing with it
        except BaseException:
            self._slot_of.pop(sandbox_id, None)
            self._events.pop(sandbox_id, None)
            raise
        att = self._attachment(idx, rules)
        self._attachments[sandbox_id] = att
        return att

    async def update(self, sandbox_id: str, allow: list[str]) -> NetAttachment:
        idx = self._slot_of.get(sandbox_id)
        if idx is None or idx < 0:
            raise NotFound(f"sandbox {sandbox_id} has no network attached; create it with network=[...]")
        entries, rules = await self._parse(allow)
        await asyncio.to_thread(self.ops.install_allow, idx, sandbox_id, entries, rules, "attach")
        att = self._attachment(idx, rules)
        self._attachments[sandbox_id] = att
        return att

    async def detach(self, sandbox_id: str) -> None:
        idx = self._slot_of.get(sandbox_id)
        if idx is None or idx < 0:
            return
        await asyncio.to_thread(self.ops.destroy, idx)
        self._slot_of.pop(sandbox_id, None)
        self._owner.pop(idx, None)
        self._attachments.pop(sandbox_id, None)
        self._retire(sandbox_id)

    def _retire(self, sandbox_id: str) -> None:
        self._on_nflog()  # attempts logged up to the teardown belong to this sandbox
        events = self._events.pop(sandbox_id, None)
        if events:
            self._retired[sandbox_id] = events
            while len(self._retired) > RETIRED_MAX:
                self._retired.popitem(last=False)

    def knows(self, sandbox_id: str) -> bool:
        """Attached now, or detached recently with attempts still retained."""
        return sandbox_id in self._events or sandbox_id in self._retired

    async def reconcile(self, live_sandbox_ids: set[str]) -> int:
        return await self._reconcile(set(live_sandbox_ids))

    def denied_events(self, sandbox_id: str, since_seq: int = 0) -> list[DeniedAttempt]:
        """Denied attempts recorded so far with ``seq > since_seq`` (oldest first, at most
        net_denied_log_max), also for a sandbox detached recently (the last RETIRED_MAX)."""
        self._on_nflog()
        events = self._events.get(sandbox_id) or self._retired.get(sandbox_id, ())
        out: list[DeniedAttempt] = []
        for e in reversed(events):  # newest first: stop at the reader's resume point
            if e.seq <= since_seq:
                break
            out.append(e)
        out.reverse()
        return out

    def attachment(self, sandbox_id: str) -> NetAttachment | None:
        return self._attachments.get(sandbox_id)

    # --- internals -----------------------------------------------------------------
    async def _parse(self, allow: list[str]) -> tuple[list[str], list[AllowRule]]:
        rules = await asyncio.to_thread(parse_allow_list, allow, system_resolver)
        if any(r.exact_host for r in rules):  # a clear 422 for node addresses (nftables refuses them anyway)
            await asyncio.to_thread(self._guard.check, rules, kernel_delivers_locally)
        return [str(e) for e in allow], rules

    def _attachment(self, idx: int, rules: list[AllowRule]) -> NetAttachment:
        ops = self.ops
        a, n = ops.addr(idx), ops.names(idx)
        hosts: dict[str, list[str]] = {}
        for r in rules:
            host = r.entry.strip().lower().rsplit(":", 1)[0] if ":" in r.entry else r.entry.strip().lower()
            if not _is_ip_or_cidr(host):
                hosts.setdefault(host, []).append(str(r.network.network_address))
        return NetAttachment(netns_path=ops.netns_path(idx), address=str(a.address),
                             gateway=str(a.gateway), resolved=[r.canonical() for r in rules],
                             hosts=hosts, mac=n.mac, host_if=n.host_if, slot=idx)

    def _next_index(self) -> int:
        used = set(self._owner) | set(self._ready) | self._building
        idx = allocate(self.settings.net_cidr, used, self._cursor)
        self._cursor = idx + 1
        self._building.add(idx)
        return idx

    async def _build_one(self) -> int:
        idx = self._next_index()
        # A cancelled caller cannot stop the worker thread: close() waits for it (a build
        # racing the freed nft context would crash) and removes what it made.
        fut = asyncio.get_running_loop().run_in_executor(None, self.ops.build, idx)
        self._inflight[idx] = fut
        fut.add_done_callback(lambda _: self._inflight.pop(idx, None))
        try:
            await asyncio.shield(fut)
        finally:
            self._building.discard(idx)
        return idx

    async def _fill_pool(self) -> None:
        backoff = 0.1
        while not self._closing:
            want = self.settings.net_slot_pool - len(self._ready) - len(self._building)
            if want <= 0:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                self._ready.append(await self._build_one())
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("building a network slot failed; retrying in %.1fs", backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _reconcile(self, live: set[str] | None) -> int:
        ops = self.ops
        inv = await asyncio.to_thread(ops.inventory)
        records = await asyncio.to_thread(ops.records.load_all)
        keep = set(self._ready) | self._building
        for idx, rec in records.items():
            if rec.state != "attached" or not rec.sandbox_id:
                continue
            if live is None or rec.sandbox_id in live:  # start(): leave attached to the caller
                keep.add(idx)
                if rec.sandbox_id not in self._slot_of:
                    if idx in inv.indices:  # chains of an older run may be wider than ours
                        await asyncio.to_thread(ops.refresh_chains, idx)
                    self._slot_of[rec.sandbox_id] = idx
                    self._owner[idx] = rec.sandbox_id
                    self._events.setdefault(rec.sandbox_id,
                                            collections.deque(maxlen=self.settings.net_denied_log_max))
        removed = 0
        for idx in sorted(inv.indices - keep):
            removed += await asyncio.to_thread(ops.destroy, idx, inv)
            sid = self._owner.pop(idx, None)
            if sid is not None:
                self._slot_of.pop(sid, None)
                self._attachments.pop(sid, None)
                self._events.pop(sid, None)
        if removed:
            log.info("network reconcile removed %d resources", removed)
        self._wake.set()
        return removed

    def _on_nflog(self) -> None:
        if self._nflog is None or self._ops is None:
            return
        head = f"dsec{self._ops.tag}:"
        for pkt in self._nflog.read():
            if not pkt.prefix.startswith(head):
                continue
            try:
                _, slot_hex, where = pkt.prefix.split(":")
                sid = self._owner.get(int(slot_hex, 16))
            except ValueError:
                continue
            parsed = parse_ipv4(pkt.payload)
            if sid is None or parsed is None or sid not in self._events:
                continue
            dst, proto, port = parsed
            self._seq += 1
            self._events[sid].append(DeniedAttempt(time=time.time(), destination=dst, protocol=proto,
                                                   port=port, target="host" if where == "i" else "remote",
                                                   seq=self._seq))


def _is_ip_or_cidr(text: str) -> bool:
    try:
        ipaddress.IPv4Network(text, strict=False)
        return True
    except ValueError:
        return False


def _enable_forwarding() -> None:
    """Sandbox egress is routed through the host: IPv4 forwarding must be on. Only our
    table's forward chain decides about our interfaces; other traffic is untouched."""
    path = "/proc/sys/net/ipv4/ip_forward"
    with open(path) as fh:
        if fh.read().strip() == "1":
            return
    log.warning("enabling net.ipv4.ip_forward for sandbox egress")
    with open(path, "w") as fh:
        fh.write("1")
