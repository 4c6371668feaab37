"""One scheduler leader among the API servers of a deployment (issue 13).

Placement decisions (create, warm hand-over, pool members, evictions, reaping) are made
by one server at a time: the holder of the lease ``scheduler`` in the state store. The
lease carries a fencing token that grows by one at every new holder
(``StateStore.lease_acquire``: a Lua script on Redis, one ``BEGIN IMMEDIATE`` on SQLite),
and the leader passes it with every placement and destroy it sends to a node; the node
refuses a token below the highest it has seen (``dsec.node.api.FenceGate``). So a leader
that lost its lease (paused, partitioned, slow) can never place or destroy again: the
first call of its successor raised the bar on that node.

The leader renews every ``scheduler_lease_renew_s``; the others try to take the lease at
the same pace, so a dead leader is replaced within ``scheduler_lease_ttl_s`` plus one
interval. A leader counts itself deposed as soon as its lease may have expired (judged
from the time it *sent* its last successful renewal), before anyone else can hold it.

Solo mode (the embedded SQLite default: one server, its own state file): the server takes
the lease once at start, even over the unexpired lease of a previous process (that process
is gone: the state file is its own), and is the leader from then on. No renewals, nothing
on the create path: single-server creates cost exactly what they did.

Pure decisions (``lease_still_valid``, ``solo_start_time``) are small functions; the
elector only does the state-store I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from dsec.config import Settings
from dsec.errors import NotLeader, StateUnavailable, error_from_dict
from dsec.models import SandboxInfo, SandboxSpec
from dsec.node.api import RestoreSource
from dsec.state.store import Lease, StateStore

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("dsec.leader")

LEASE_NAME = "scheduler"


class LeaderView(BaseModel):
    """What ``GET /v1/scheduler`` shows about leadership."""

    leader: str | None = Field(None, description="URL of the server holding the scheduler lease (None: none now)")
    this_server: str = Field("", description="This server's own URL (its lease holder name)")
    is_leader: bool = False
    token: int | None = Field(None, description="The current lease's fencing token (as last seen by this server)")
    solo: bool = Field(False, description="Embedded single-server state: always the leader")
    elections: int = Field(0, description="Times this server became the leader")
    last_takeover_s: float | None = Field(None, description="Seconds from the previous leader's last renewal "
                                          "to this server's takeover, at its latest election")


def lease_still_valid(now: float, renewed_sent_at: float, ttl_s: float) -> bool:
    """A holder may act only while its lease cannot have expired: the store stamped the
    expiry from a time no earlier than when the renewal was sent."""
    return now < renewed_sent_at + ttl_s


def solo_start_time(now: float, current: Lease | None, holder: str) -> float:
    """The time a solo server claims the lease at: past any other holder's expiry (that
    holder was a previous process on this server's own state file)."""
    if current is None or current.holder == holder:
        return now
    return max(now, current.expires_at + 1e-3)


class LeaderElector:
    def __init__(self, state: StateStore, settings: Settings, *, solo: bool,
                 clock: Callable[[], float] = time.time) -> None:
        self.state = state
        self.s = settings
        self.solo = solo
        self.clock = clock
        self.holder = ""
        self.token: int | None = None  # the fencing token of this server's term (None: not leading)
        self.leader_url: str | None = None
        self.seen_token: int | None = None  # the current lease's token as a follower last read it
        self._renewed_sent_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()  # set at every change of leader (followers waiting on one)
        self.on_elected: Callable[[int], Awaitable[None]] | None = None  # (token) -> rebuild the view
        self.on_deposed: Callable[[], None] | None = None
        self.elections = 0
        self.last_takeover_s: float | None = None
        self._takeover_lock = asyncio.Lock()

    @property
    def is_leader(self) -> bool:
        if self.token is None:
            return False
        return self.solo or lease_still_valid(self.clock(), self._renewed_sent_at, self.s.scheduler_lease_ttl_s)

    def fence(self) -> int | None:
        """The token to send with a placement or destroy now, or None when not leading."""
        return self.token if self.is_leader else None

    def view(self) -> LeaderView:
        leading = self.is_leader
        return LeaderView(leader=self.holder if leading else self.leader_url, this_server=self.holder,
                          is_leader=leading, token=self.token if leading else self.seen_token, solo=self.solo,
                          elections=self.elections, last_takeover_s=self.last_takeover_s)

    async def start(self, holder: str) -> None:
        """Take part under the name ``holder`` (this server's URL): one election step now
        (a solo or first server leads before it answers its first request), then the loop."""
        self.holder = holder
        if self.solo:
            now = self.clock()
            current = await self.state.lease_get(LEASE_NAME)
            lease = await self.state.lease_acquire(LEASE_NAME, holder, self.s.scheduler_lease_ttl_s,
                                                   solo_start_time(now, current, holder))
            assert lease is not None  # nobody else can hold a lease dated after the old expiry
            await self._elected(lease, now, current)
            return
        await self.step()
        self._task = asyncio.create_task(self._loop(), name="dsec-leader-elector")

    async def close(self) -> None:
        """Stop taking part; a leader gives its lease up so a successor needs no TTL wait."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.token is not None and not self.solo:
            with contextlib.suppress(Exception):
                await self.state.lease_release(LEASE_NAME, self.holder)
            self._depose("shutting down")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.scheduler_lease_renew_s)
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - the next step retries; a leader deposes itself on expiry
                log.exception("scheduler lease step failed")
                if self.token is not None and not self.is_leader:
                    self._depose("its lease expired while the state store failed")

    async def step(self) -> None:
        """Renew (leader) or try to take (follower) the lease once."""
        sent = self.clock()
        previous = None if self.token is not None else await self._current()
        try:
            lease = await self.state.lease_acquire(LEASE_NAME, self.holder, self.s.scheduler_lease_ttl_s, sent)
        except StateUnavailable:
            if self.token is not None and not self.is_leader:
                self._depose("the state store is unreachable and its lease expired")
            raise
        if lease is not None:
            if self.token != lease.token:
                await self._elected(lease, sent, previous)
            self._renewed_sent_at = sent
            return
        if self.token is not None:
            self._depose("another server holds the lease")
        current = await self._current()
        self.seen_token = current.token if current is not None else None
        url = current.holder if current is not None and current.expires_at > sent else None
        if url != self.leader_url:
            self.leader_url = url
            self.changed.set()
            self.changed = asyncio.Event()

    async def _current(self) -> Lease | None:
        return await self.state.lease_get(LEASE_NAME)

    async def _elected(self, lease: Lease, sent: float, previous: Lease | None) -> None:
        self._renewed_sent_at = sent
        self.token = lease.token
        self.leader_url = self.holder
        self.elections += 1
        if previous is not None and previous.holder != self.holder:
            # Lease expiry - TTL = the old leader's last renewal: how long nobody led.
            self.last_takeover_s = round(max(0.0, sent - (previous.expires_at - self.s.scheduler_lease_ttl_s)), 3)
        log.warning("this server (%s) is the scheduler leader, fencing token %d", self.holder, lease.token)
        if self.on_elected is not None:
            await self.on_elected(lease.token)
        self.changed.set()
        self.changed = asyncio.Event()

    def _depose(self, why: str) -> None:
        log.warning("this server (%s) is no longer the scheduler leader: %s", self.holder, why)
        self.token = None
        self.leader_url = None
        if self.on_deposed is not None:
            self.on_deposed()
        self.changed.set()
        self.changed = asyncio.Event()

    async def take_from_dead(self, dead: str) -> bool:
        """The leader ``dead`` refuses connections (its process is gone): take the lease now
        instead of waiting out its TTL. Safe even if it were alive: the token grows and the
        nodes fence it. Returns whether this server leads now."""
        if self.is_leader or self.solo or not self.holder:
            return self.is_leader
        async with self._takeover_lock:
            if self.is_leader:
                return True
            previous = await self._current()
            if previous is None or previous.holder != dead:
                return self.is_leader  # someone else already took it
            sent = self.clock()
            lease = await self.state.lease_takeover(LEASE_NAME, self.holder, dead, self.s.scheduler_lease_ttl_s, sent)
            if lease is None:
                return False
            log.warning("the scheduler leader %s refuses connections: taking its lease now", dead)
            await self._elected(lease, sent, previous)
            return True

    async def lift(self, min_token: int) -> int | None:
        """A node already saw a token >= ours (a store wiped or replaced under live nodes):
        lift this term's token to ``min_token`` (the lease stays ours). None if we lost it."""
        sent = self.clock()
        lease = await self.state.lease_takeover(LEASE_NAME, self.holder, self.holder, self.s.scheduler_lease_ttl_s,
                                                sent, min_token)
        if lease is None:
            return None
        self.token, self._renewed_sent_at = lease.token, sent
        log.warning("scheduler fencing token lifted to %d (a node had seen a higher one)", lease.token)
        return lease.token

    def fenced(self, why: str) -> None:
        """A node refused this server's token: a newer leader exists, whatever our clock says."""
        if self.token is not None:
            self._depose(f"a node refused its fencing token: {why}")

    async def wait_for_change(self, timeout: float) -> None:
        """Until the leader changes (or ``timeout``)."""
        ev = self.changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), timeout)


# --- a follower hands placements to the leader ---------------------------------------------

PEER_HEADER = "x-dsec-peer"
PLACE_PATH = "/peer/v1/place"  # outside /v1/: peers authenticate with the deployment's peer secret


class PlaceRequest(BaseModel):
    """One placement a follower hands to the leader: the follower already authenticated,
    admitted and recorded the create (and reserved its request id); the leader queues,
    places and builds it under ``sandbox_id``."""

    spec: SandboxSpec
    sandbox_id: str = Field(..., min_length=1, max_length=128)
    tenant: str = Field(..., min_length=1, max_length=128, description="The tenant's name (node label)")
    restore: RestoreSource | None = None


async def peer_secret(state: StateStore) -> str:
    """The deployment's shared secret for server-to-server calls (made by the first server
    that needs it; the state store is already trusted with every tenant's records)."""
    doc = await state.get_doc("cluster", "peer")
    if doc is None:
        await state.put_doc("cluster", "peer", {"secret": secrets.token_hex(32)})
        doc = await state.get_doc("cluster", "peer")  # two servers racing: both read the last write
    return str((doc or {}).get("secret", ""))


def peer_ok(presented: str | None, secret: str) -> bool:
    return bool(presented) and bool(secret) and hmac.compare_digest(presented or "", secret)


class PlacementForwarder:
    """A follower's create path: POST the placement to the leader; when the leader is gone
    (connection refused, 503 not_leader) wait for the next one and send it there, with the
    same sandbox id (the node answers a create for an id it holds with that sandbox)."""

    def __init__(self, state: StateStore, settings: Settings, elector: LeaderElector) -> None:
        self.state, self.s, self.elector = state, settings, elector
        self._secret: str | None = None
        self._http: httpx.AsyncClient | None = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def place(self, spec: SandboxSpec, sandbox_id: str, tenant: str,
                    restore: RestoreSource | None = None) -> SandboxInfo | None:
        """The leader's answer, or None when this server became the leader meanwhile."""
        import httpx

        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.s.api_create_wait_s + self.s.client_timeout_s,
                                                                 connect=2.0))
        body = PlaceRequest(spec=spec, sandbox_id=sandbox_id, tenant=tenant, restore=restore).model_dump_json()
        deadline = time.monotonic() + self.s.api_create_wait_s + 2 * self.s.scheduler_lease_ttl_s
        refreshed = False
        pause = self.s.scheduler_lease_renew_s
        while True:
            if self.elector.is_leader:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise NotLeader(f"no scheduler leader placed sandbox {sandbox_id} within "
                                f"{self.s.api_create_wait_s + 2 * self.s.scheduler_lease_ttl_s:g}s; retry",
                                retry_after=self.s.api_retry_after_s, leader=self.elector.leader_url)
            url = self.elector.leader_url
            if url is None or url == self.elector.holder:
                await self.elector.wait_for_change(min(left, pause))
                continue
            if self._secret is None:
                self._secret = await peer_secret(self.state)
            try:
                r = await self._http.post(url + PLACE_PATH, content=body,
                                          headers={PEER_HEADER: self._secret, "content-type": "application/json"})
            except httpx.TransportError as e:
                # The leader died (or is unreachable): the next one places it, same id. A
                # refused connection means its process is gone: take over at once rather
                # than wait out its lease (the fence keeps that safe if it was not).
                log.warning("handing %s to the scheduler leader %s failed (%s)", sandbox_id, url, type(e).__name__)
                if isinstance(e, httpx.ConnectError) and await self.elector.take_from_dead(url):
                    return None
                await self.elector.wait_for_change(min(left, pause))
                continue
            if r.status_code == 201:
                return SandboxInfo.model_validate_json(r.content)
            try:
                payload = r.json()
            except ValueError:
                payload = None
            if not isinstance(payload, dict):
                payload = {"code": "transient", "message": f"leader {url} answered HTTP {r.status_code}"}
            err = error_from_dict(payload, r.status_code)
            if isinstance(err, NotLeader):
                await self.elector.wait_for_change(min(left, pause))
                continue
            if r.status_code == 403 and payload.get("code") == "forbidden" and not refreshed:
                self._secret, refreshed = None, True  # the secret was (re)made after we read it
                continue
            raise err
