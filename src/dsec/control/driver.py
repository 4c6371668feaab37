"""The thin async driver: runs the pure ``Scheduler`` against real ``NodeAgent``s.

All decisions are the scheduler's; this module only does I/O: it ticks ``next_batch``
every ``batch_window_s``, executes placements (create / warm hand-over / pool create /
destroy) with at most ``Scheduler.parallel_limit()`` creations per node in flight,
reports results back, runs the reaper every ``reaper_interval_s``, and resolves the
awaiting ``create`` calls.

Wiring into the API service (its ``Creator`` seam)::

    driver = SchedulerDriver(Scheduler(settings), {agent.node_id: agent}, settings)
    await driver.start()
    service.set_creator(driver.create)      # (spec, sandbox_id, tenant) -> SandboxInfo
    ...
    await driver.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from dsec.config import Settings, parse_bytes
from dsec.control.backpressure import retry_after_s
from dsec.control.book import PreemptedDoc, floor_key, to_monotonic
from dsec.control.convert import (
    FOR_LABEL,
    OWNER_LABEL,
    POOL_LABEL,
    cpu_request,
    lease_key,
    pool_can_serve,
    pool_member_spec,
    share_request,
    spec_to_request,
)
from dsec.control.overcommit import refusal_reason
from dsec.control.prefetch import ImageDemand
from dsec.control.scheduler import Scheduler
from dsec.control.types import Placement, Request, Running, Shape, Ticket
from dsec.errors import (
    Forbidden,
    ImageError,
    InvalidArgument,
    LeaderFenced,
    NotFound,
    NotLeader,
    Overloaded,
    SandboxFailure,
    Timeout,
)
from dsec.models import SandboxInfo, SandboxSpec
from dsec.node.api import NodeAgent

if TYPE_CHECKING:
    from dsec.control.book import ControlBook
    from dsec.control.leader import LeaderElector, PlacementForwarder

log = logging.getLogger(__name__)

# Preemption on a real node: (tenant, sandbox_id) -> checkpoint id, taken before the stop;
# (tenant, checkpoint_id, sandbox_id) -> the victim re-created from it under the same id.
Creator = Callable[[SandboxSpec, str, str], Awaitable[SandboxInfo]]  # (spec, sandbox_id, tenant) -> info
PreemptCheckpoint = Callable[[str, str], Awaitable[str]]
PreemptResume = Callable[[str, str, str], Awaitable[SandboxInfo]]
ImageResolver = Callable[[str], tuple[list[tuple[str, int]], str]]  # image -> ([(digest, size)], version)
UsageProbe = Callable[[str], float]  # node_id -> fraction of its CPU in use now (default: NodeAgent.usage)
_PERMANENT = (InvalidArgument, ImageError, Forbidden, NotFound)  # the same on every node: no retry


class SchedulerDriver:
    def __init__(self, scheduler: Scheduler, agents: Mapping[str, NodeAgent], settings: Settings, *,
                 image_resolver: ImageResolver | None = None,
                 usage_probe: UsageProbe | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.sched = scheduler
        self.agents = dict(agents)
        self.s = settings
        self._checkpoint: PreemptCheckpoint | None = None
        self._resume: PreemptResume | None = None
        self._preempted: dict[str, tuple[str, str]] = {}  # victim sandbox id -> (tenant, checkpoint id)
        # Told when the driver itself removes a user's sandbox (TTL, silent owner, release),
        # so the service can audit it.
        self.on_reaped: Callable[[str, str], Awaitable[None]] | None = None
        self.sched.preemption = False  # until enable_preemption: a victim must be resumable
        self.image_resolver = image_resolver
        self.usage_probe = usage_probe
        self.clock = clock
        self._waiters: dict[str, asyncio.Future[SandboxInfo]] = {}
        self._sids: dict[str, str] = {}  # request id -> sandbox id chosen by the caller
        self._via: dict[str, Creator] = {}  # request id -> how to build it (restores)
        self._sems: dict[str, asyncio.Semaphore] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        # Scheduler leadership (dsec.control.leader): None = this driver alone decides (no
        # election: in-process use). Otherwise it places only while it holds the lease and
        # its view was rebuilt for that term (``_view_token``); a follower hands creates to
        # the leader (``forwarder``).
        self.leader: LeaderElector | None = None
        self.forwarder: PlacementForwarder | None = None
        self._view_token: int | None = None
        # Records a new leader needs (owner leases, pool floors, preemptions): the state
        # store (dsec.control.book); None = memory only (in-process use without a store).
        self.book: ControlBook | None = None
        self._floors_applied: dict[str, int] = {}  # floor_key -> size, as this scheduler applies it
        self._floor_specs: dict[str, SandboxSpec] = {}
        # Creates per image (dsec.control.prefetch): which images the leader prefetches.
        self.image_demand = ImageDemand(settings.image_prefetch_window_s)
        self.prefetcher: object | None = None  # dsec.cluster.prefetch.Prefetcher, set by `serve --cluster`

    # ------------------------------------------------------------------ lifecycle
    def attach_leader(self, elector: LeaderElector, forwarder: PlacementForwarder | None) -> None:
        """Place only as the elected scheduler leader (before ``start``)."""
        self.leader, self.forwarder = elector, forwarder
        elector.on_elected = self._take_over
        elector.on_deposed = self._step_down

    def leading(self) -> bool:
        """May this driver make placement decisions now?"""
        if self.leader is None:
            return True
        tok = self.leader.fence()
        return tok is not None and tok == self._view_token

    def _fence(self) -> int | None:
        """The fencing token for a call to a node now. Not leading: no call at all (a call
        without a token would not be checked by the node)."""
        if self.leader is None:
            return None
        tok = self.leader.fence()
        if tok is None:
            raise NotLeader("this API server lost the scheduler lease: the placement is left to the new leader; "
                            "retry", retry_after=self.s.scheduler_lease_renew_s)
        return tok

    async def start(self) -> None:
        """Register every agent's capacity with the scheduler and start the loop. Under an
        election the nodes' sandboxes are adopted when this server becomes the leader."""
        for node_id, agent in self.agents.items():
            cap = agent.capacity()
            self.sched.upsert_node(node_id, cap.cpu, cap.memory, cap.disk, max_sandboxes=cap.max_sandboxes,
                                   isolation=tuple(cap.isolation), gpus=cap.gpus, labels=cap.labels)
            if self.leader is None:
                await self._adopt(node_id, agent)
        if self.leader is not None and self.leader.solo:
            # The embedded single server leads from its start (its view is built here).
            await self.leader.start(self.s.api_advertise_url or "local")
        self._loop_task = asyncio.create_task(self._loop(), name="dsec-scheduler-driver")

    async def _take_over(self, token: int) -> None:
        """Elected with ``token``: raise the fence on every node first (from now on the
        previous leader's calls are refused there), then rebuild the view from the nodes:
        forget what they no longer hold, adopt what they hold (the state store keeps who
        owns each sandbox; the nodes keep what exists)."""
        self._view_token = None
        for node_id, agent in self.agents.items():
            try:
                await agent.raise_fence(token)
            except LeaderFenced as e:
                # The node saw a higher token than the store's (the store was wiped or
                # replaced under live nodes; a live rival would hold the lease, not us):
                # lift ours above it, keeping the lease.
                lifted = await self.leader.lift(int(e.details.get("highest", token)) + 1) if self.leader else None
                if lifted is None:
                    raise
                token = lifted
                await agent.raise_fence(token)
            except Exception:  # noqa: BLE001 - a node that cannot answer is fenced at our first call
                log.exception("raising the scheduler fence on %s failed", node_id)
        stray: dict[str, list[str]] = {}
        for node_id, agent in self.agents.items():
            listed_at = self.clock()
            try:
                infos = await agent.list()
            except Exception:  # noqa: BLE001 - judged again by the periodic node sync
                log.exception("listing %s for the new leader's view failed", node_id)
                continue
            self.sched.sync_node(node_id, {i.id for i in infos}, listed_at)
            await self._adopt(node_id, agent, fence=token, infos=infos, stray=stray.setdefault(node_id, []))
        if self.book is not None:
            await self._load_preempted(token)
            await self._sync_book()
        self._view_token = token
        self._wake.set()
        # The previous leader's idle pool members go after placements resumed (each destroy
        # is a node round trip; a burst must not wait for them).
        for node_id, ids in stray.items():
            for sid in ids:
                self._spawn(self._destroy_stray(node_id, sid, token))

    async def _destroy_stray(self, node_id: str, sandbox_id: str, token: int) -> None:
        try:
            await self.agents[node_id].destroy(sandbox_id, fence=token)
        except Exception:  # noqa: BLE001 - a later takeover or the node's reaper gets it
            log.warning("destroying the previous leader's pool member %s failed", sandbox_id, exc_info=True)

    async def _load_preempted(self, token: int) -> None:
        """Queue again the resumption of every preempted sandbox the store still records
        (the previous leader checkpointed and stopped it, then died before resuming it)."""
        assert self.book is not None
        for sid, doc in (await self.book.all_preempted()).items():
            if sid in self._preempted or doc.spec is None:
                continue
            self._preempted[sid] = (doc.tenant, doc.checkpoint_id)
            try:
                self._know_image(doc.spec.image)
                req = spec_to_request(doc.spec, doc.tenant, f"{sid}~resume-t{token}", self.s)
            except Exception:  # noqa: BLE001 - an image gone since: that one stays preempted (503), logged
                log.exception("cannot queue the resumption of preempted sandbox %s", sid)
                continue
            req.resume_of = sid
            req.cold = True
            self.sched.submit(req, self.clock())

    async def _sync_book(self) -> None:
        """The leader takes in what any server wrote: owners' heartbeats (the newest wins),
        released owners (their sandboxes are reaped now), pool floors."""
        assert self.book is not None
        now_wall, now = time.time(), self.clock()
        for owner, doc in (await self.book.owners()).items():
            if doc.released:
                ids = self.sched.owned_by(owner)
                self.sched.drop_lease(owner)
                await asyncio.gather(*(self._destroy(sid, f"owner {owner} released its lease") for sid in ids))
                await self.book.forget_owner(owner)
                continue
            seen = to_monotonic(doc.last_heartbeat, now_wall, now)
            lease = self.sched.leases.get(owner)
            if lease is None or lease.last_heartbeat < seen:
                self.sched.heartbeat(owner, seen)
        floors = await self.book.floors()
        want = {floor_key(f.spec): f.size for f in floors}
        if want != self._floors_applied:
            for f in floors:
                if self._floors_applied.get(floor_key(f.spec)) != f.size:
                    self._set_floor(f.spec, f.size)
            for key in set(self._floors_applied) - set(want):
                spec = self._floor_specs.pop(key, None)
                if spec is not None and self._floors_applied.get(key):
                    self._set_floor(spec, 0)  # removed on another server
            self._floors_applied = want
            self._floor_specs.update({floor_key(f.spec): f.spec for f in floors})

    def _step_down(self) -> None:
        """Deposed: decide nothing more. Queued requests are withdrawn and their callers
        told to retry (503 not_leader): the same request id reaches the new leader."""
        self._view_token = None
        for rid, fut in list(self._waiters.items()):
            t = self.sched.tickets.get(rid)
            if t is not None and t.state == "queued":
                self.sched.cancel(rid)
            elif t is not None and t.state == "placed":
                continue  # in flight on a node: its outcome still resolves the waiter
            self._waiters.pop(rid, None)
            self._sids.pop(rid, None)
            self._via.pop(rid, None)
            if not fut.done():
                fut.set_exception(NotLeader(f"request {rid!r}: this server lost the scheduler lease before "
                                            "placing it; retry (the new leader places it)",
                                            retry_after=self.s.scheduler_lease_renew_s))
                fut.exception()
        self._wake.set()

    async def close(self) -> None:
        """Stop the loop, wait for in-flight operations, fail remaining waiters."""
        self._stopping = True
        self._wake.set()
        if self._loop_task is not None:
            await self._loop_task
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for rid, fut in list(self._waiters.items()):
            if not fut.done():
                fut.set_exception(SandboxFailure(f"request {rid!r}: scheduler shut down before it was placed"))
                fut.exception()  # a waiter may be gone already: no "never retrieved" noise
        self._waiters.clear()
        if self.leading():
            await self._drain_pools()
        if self.leader is not None:
            await self.leader.close()
        if self.forwarder is not None:
            await self.forwarder.close()

    async def _adopt(self, node_id: str, agent: NodeAgent, fence: int | None = None,
                     infos: list[SandboxInfo] | None = None, stray: list[str] | None = None) -> None:
        """Account the sandboxes a node already runs (a restart adopted them); pool members
        left by a crash (or a previous leader) are destroyed, since pools are rebuilt from
        demand (or listed in ``stray``, for the caller to destroy later)."""
        now = self.clock()
        for info in infos if infos is not None else await agent.list():
            if info.labels.get(POOL_LABEL) == "1" and info.state.value == "ready":
                if stray is not None:
                    stray.append(info.id)
                else:
                    await agent.destroy(info.id, fence=fence)
                continue
            left = None
            if info.started_at is not None:
                left = max(0.0, info.timeout - (time.time() - info.started_at))
            owner = info.labels.get(OWNER_LABEL)
            self.sched.adopt(node_id, info.id, info.tenant or "", cpu_request(info.cpu, self.s),
                             share_request(info.memory, self.s.memory_request_ratio),
                             share_request(info.disk, self.s.disk_request_ratio), now, ttl_left=left, labels=info.labels,
                             owner=lease_key(info.tenant or "", owner) if owner else None)

    async def _sync_nodes(self) -> None:
        """Release what the nodes dropped on their own (TTL, dead init, a kill that bypassed us)."""
        for node_id, agent in self.agents.items():
            listed_at = self.clock()
            try:
                live = {i.id for i in await agent.list()}
            except Exception:  # noqa: BLE001 - a node that cannot answer is judged next time
                log.exception("listing sandboxes on %s failed", node_id)
                continue
            for r in self.sched.sync_node(node_id, live, listed_at):
                log.info("sandbox %s left node %s outside the scheduler; capacity released", r.sandbox_id, node_id)
        self._wake.set()

    async def _drain_pools(self) -> None:
        """Destroy unclaimed warm-pool members: nobody owns them, and a restart rebuilds
        pools from demand, so keeping them would only be a leak across shutdowns."""
        for node_id, agent in self.agents.items():
            try:
                members = await agent.list(labels={POOL_LABEL: "1"})
            except Exception:  # noqa: BLE001 - best effort on shutdown; the reaper/reconcile remain
                log.exception("listing pool members on %s failed", node_id)
                continue
            for info in members:
                if info.state.value == "ready":
                    try:
                        await agent.destroy(info.id, fence=self._fence())
                    except Exception:  # noqa: BLE001
                        log.exception("destroying pool member %s failed", info.id)

    def enable_preemption(self, checkpoint: PreemptCheckpoint, resume: PreemptResume) -> None:
        """Let high-priority requests preempt lower-priority sandboxes: each victim is
        checkpointed, stopped, queued, and re-created from its checkpoint under the same
        sandbox id when capacity returns (its user's handle stays valid)."""
        self._checkpoint, self._resume = checkpoint, resume
        self.sched.preemption = self.s.preemption_enabled

    def preempted(self, sandbox_id: str) -> float | None:
        """Seconds to wait before retrying an operation on a preempted sandbox awaiting its
        resumption, or None when it is not preempted."""
        if sandbox_id not in self._preempted:
            return None
        return max(self.s.retry_after_min_s, round(self.sched.depth() / max(self.sched.drain_rate, 1.0), 1))

    async def forget_preempted(self, sandbox_id: str) -> bool:
        """The user killed a preempted sandbox: withdraw its resumption."""
        if self._preempted.pop(sandbox_id, None) is None:
            return False
        if self.book is not None:
            await self.book.resumed(sandbox_id)
        for rid, req in list(self.sched.pending.items()):
            if req.resume_of == sandbox_id:
                self.sched.cancel(rid)
        return True

    # ------------------------------------------------------------------ API
    def submit(self, spec: SandboxSpec, tenant: str, request_id: str, *, owner: str | None = None,
               task_type: str | None = None, sandbox_id: str | None = None, cold: bool = False) -> Ticket:
        """Queue a create; raises InvalidArgument / QuotaExceeded / Overloaded (429 + retry_after)."""
        self._know_image(spec.image)
        spec = self._default_to_fit(spec)
        req = spec_to_request(spec, tenant, request_id, self.s, owner=owner, task_type=task_type)
        req.cold = cold or not pool_can_serve(spec, self.s)
        t = self.sched.submit(req, self.clock())
        if self.s.image_prefetch_enabled:
            self.image_demand.observe(spec.image, self.clock(), req)
        if t.state in ("queued", "placed") and request_id not in self._waiters:
            self._waiters[request_id] = asyncio.get_running_loop().create_future()
            if sandbox_id is not None:
                self._sids[request_id] = sandbox_id
            if t.state == "queued":
                fast = self.sched.take_warm_now(request_id, self.clock())
                if fast is not None:
                    self._spawn(self._execute(fast))
                    return self.sched.ticket(request_id)
        self._wake.set()
        return t

    def _know_image(self, image: str) -> None:
        """Register an image's layer index with the scheduler on first sight (NotFound if the
        resolver does not know it)."""
        if image not in self.sched.images:
            layers, version = (self.image_resolver(image) if self.image_resolver
                               else ([(f"image:{image}", 1)], ""))
            self.sched.register_image(image, layers, version)

    def _default_to_fit(self, spec: SandboxSpec) -> SandboxSpec:
        """Fill sizes the user left out with the defaults, clamped to the largest node (a
        2-core dev box still runs the 4-CPU default shape); explicit sizes are kept and
        judged by the scheduler, which rejects what no node can ever hold."""
        if spec.cpu is not None and spec.memory is not None and spec.disk is not None:
            return spec
        caps = [a.capacity() for a in self.agents.values()]
        if not caps:
            return spec
        fill: dict[str, object] = {}
        if spec.cpu is None:
            fill["cpu"] = min(self.s.default_cpu, max(c.cpu for c in caps))
        if spec.memory is None:
            fill["memory"] = min(parse_bytes(self.s.default_memory), max(c.memory for c in caps))
        if spec.disk is None:
            fill["disk"] = min(parse_bytes(self.s.default_disk), max(c.disk for c in caps))
        return spec.model_copy(update=fill)

    async def wait(self, request_id: str, timeout: float | None = None) -> SandboxInfo:
        """Wait until ``request_id`` has a sandbox (or failed: raises)."""
        fut = self._waiters.get(request_id)
        if fut is None:
            t = self.sched.ticket(request_id)
            if t.state == "created" and t.sandbox_id and t.node_id:
                return await self.agents[t.node_id].get(t.sandbox_id)
            raise SandboxFailure(f"request {request_id!r} failed: {t.error}")
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            t = self.sched.tickets.get(request_id)
            raise Timeout(f"request {request_id!r} not placed within {timeout}s "
                          f"(state {t.state if t else 'unknown'}, position {t.position if t else 0})") from None

    def route(self, via: Creator) -> Creator:
        """A creator that places like ``create`` (queue, capacity, 429) but builds the sandbox
        with ``via`` (e.g. a restore from a checkpoint: never a warm hand-over)."""
        async def routed(spec: SandboxSpec, sandbox_id: str, tenant: str) -> SandboxInfo:
            return await self.create(spec, sandbox_id, tenant, via=via)
        return routed

    async def create(self, spec: SandboxSpec, sandbox_id: str, tenant: str, *,
                     via: Creator | None = None) -> SandboxInfo:
        """The API service's ``Creator`` seam: submit and wait. Idempotent by request id.

        The returned info's id may differ from ``sandbox_id`` on a warm-pool hit (the
        pool member is handed over); callers must use ``info.id``.
        """
        if self.leader is not None and not self.leader.is_leader and self.forwarder is not None:
            # A follower: the leader places it (the same sandbox id, so a retry after the
            # leader died finds what it made instead of making a second one).
            restore = getattr(via, "restore", None) if via is not None else None
            if via is not None and restore is None:
                raise NotLeader("this API server is not the scheduler leader and this kind of create cannot be "
                                "handed over; retry on the leader", retry_after=self.s.scheduler_lease_renew_s,
                                leader=self.leader.leader_url)
            info = await self.forwarder.place(spec, sandbox_id, tenant, restore)
            if info is not None:
                return info
            # None: this server became the leader meanwhile; place it here.
        return await self.place_here(spec, sandbox_id, tenant, via=via)

    async def place_here(self, spec: SandboxSpec, sandbox_id: str, tenant: str, *,
                         via: Creator | None = None) -> SandboxInfo:
        """Submit to this server's scheduler and wait (the leader, or no election)."""
        rid = f"{tenant}/{spec.request_id}" if spec.request_id else sandbox_id
        owner = None
        if spec.owner is not None:
            owner = lease_key(tenant, spec.owner)
            spec = spec.model_copy(update={"labels": {**spec.labels, OWNER_LABEL: spec.owner}})
        if via is not None:
            self._via[rid] = via
        try:
            self.submit(spec, tenant, rid, sandbox_id=sandbox_id, owner=owner, cold=via is not None)
        except Exception:
            self._via.pop(rid, None)
            raise
        try:
            return await self.wait(rid, self.s.api_create_wait_s)
        except Timeout:
            if not self._withdraw(rid):
                raise
        # Placed meanwhile: the creation is under way and bounded by the node's own timeouts.
        return await self.wait(rid, self.s.client_timeout_s)

    def _withdraw(self, request_id: str) -> bool:
        """A create that found no room within ``api_create_wait_s``: take it out of the queue
        and answer 429, so no HTTP call hangs and nothing is created after the client gave
        up. Returns False when it was placed meanwhile (then it is waited for)."""
        t = self.sched.tickets.get(request_id)
        position = t.position if t is not None else 0
        req = self.sched.pending.get(request_id)
        why = refusal_reason(req, list(self.sched.cluster.nodes.values()), self.s.overcommit_ratio,
                             self.s.overcommit_threshold) if req is not None else "no room"
        if t is None or t.state != "queued" or not self.sched.cancel(request_id):
            return False
        self._sids.pop(request_id, None)
        self._via.pop(request_id, None)
        ra = retry_after_s(self.sched.depth(), self.s, self.sched.drain_rate)
        err = Overloaded(f"request {request_id!r} found no node with room within {self.s.api_create_wait_s:g}s "
                         f"(queue position {position}): {why}. It was withdrawn: retry after {ra:g}s, or free "
                         "capacity (kill idle sandboxes, ask for less)", retry_after=ra, resource=why)
        fut = self._waiters.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(err)
            fut.exception()  # every waiter re-raises it; do not warn "never retrieved"
        raise err

    def set_pool(self, spec: SandboxSpec, size: int) -> dict[str, object]:
        """Keep ``size`` warm sandboxes of ``spec``'s shape ready (0 = demand-driven only)."""
        shape = self._set_floor(spec, size)
        if self.book is not None:  # the leader (now or a later one) keeps it
            self._spawn(self._logged(self.book.set_floor(spec, size), "recording a pool floor"))
        return self.pool_status(shape)

    def _set_floor(self, spec: SandboxSpec, size: int) -> tuple:  # type: ignore[type-arg]
        self._know_image(spec.image)
        req = spec_to_request(self._default_to_fit(spec), "__pool__", "pool-floor", self.s)
        self.sched.set_pool_floor(req, size)
        self._wake.set()
        return req.shape

    def pool_status(self, shape: tuple | None = None) -> dict[str, object]:  # type: ignore[type-arg]
        pools = self.sched.pools
        if pools is None:
            return {}
        shapes = [shape] if shape is not None else sorted(set(pools.targets) | set(pools.demand.floors)
                                                          | set(pools.free), key=str)
        return {"pools": [{"image": sh[0], "isolation": sh[1], "cpu": sh[6] or sh[2], "cpu_request": sh[2],
                           "memory": sh[3], "disk": sh[4], "network": sh[5],
                           "floor": pools.demand.floors.get(sh, 0), "target": pools.targets.get(sh, 0),
                           "ready": len(pools.free.get(sh, ())), "creating": pools.inflight.get(sh, 0)}
                          for sh in shapes]}

    async def release(self, sandbox_id: str) -> None:
        """Destroy a sandbox the user is done with and free its capacity."""
        r = self.sched.running.get(sandbox_id)
        if r is None:
            raise NotFound(f"sandbox {sandbox_id!r} is not known to the scheduler")
        cpu = await self._cpu_used(r.node_id, r)
        agent = self.agents[r.node_id]
        start = getattr(agent, "start_recycle", None) if self.s.warm_pool_recycle else None
        fence = None
        if start is not None:
            try:
                fence = self._fence()
            except NotLeader:  # only the leader refills pools: destroy as before
                start = None
        pool_req = self.sched.recycle(sandbox_id, self.clock(), cpu_peak=cpu) if start is not None else None
        if pool_req is not None:
            # The node retires the id before this returns; the reset runs after the user's
            # kill has been answered (off the hot path), the member is ready when it is done.
            try:
                done = await start(sandbox_id, pool_member_spec(pool_req), fence=fence)
            except Exception as e:  # noqa: BLE001 - Conflict: not like a fresh member (or gone): destroy as usual
                self.sched.on_failed(pool_req.request_id, self.clock(), str(e), retriable=False)
                self._wake.set()
                if not isinstance(e, NotFound):
                    await agent.destroy(sandbox_id)
                return
            self._spawn(self._recycled(sandbox_id, pool_req, done))
            return
        try:
            await agent.destroy(sandbox_id)
        finally:
            self.sched.on_released(sandbox_id, self.clock(), cpu_peak=cpu)
            self._wake.set()

    async def _recycled(self, sandbox_id: str, req: Request, done: Awaitable[SandboxInfo]) -> None:
        """A recycle the node is finishing: the new member joins the pool, or (the node tore
        it down) the pool request fails and the pool builder makes another."""
        try:
            info = await done
        except Exception as e:  # noqa: BLE001 - the node has already cleaned up
            log.warning("recycling %s failed: %s", sandbox_id, e)
            self.sched.on_failed(req.request_id, self.clock(), str(e), retriable=False)
        else:
            self.sched.on_created(req.request_id, info.id, self.clock())
            self._serve_waiting(req.shape)
        self._wake.set()

    def _serve_waiting(self, shape: Shape) -> None:
        """A member of ``shape`` is ready: hand it to the earliest request of that shape
        queued for it now, not at the next batch (up to a batch window later)."""
        rid = self.sched.first_waiting(shape)
        fast = self.sched.take_warm_now(rid, self.clock()) if rid is not None else None
        if fast is not None:
            self._spawn(self._execute(fast))

    async def _cpu_used(self, node_id: str, r: Running | None) -> float | None:
        """A task-typed sandbox's mean CPU use, read just before it goes (right-sizing)."""
        agent = self.agents.get(node_id)
        if r is None or r.task_type is None or agent is None:
            return None
        try:
            return await agent.cpu_used(r.sandbox_id)
        except Exception:  # noqa: BLE001 - a missing sample only delays right-sizing
            return None

    def heartbeat(self, owner: str) -> tuple[int, float]:
        """Renew ``owner``'s lease (a tenant-qualified key, see ``lease_key``); returns
        (sandboxes it holds, seconds of silence before they are reaped)."""
        self.sched.heartbeat(owner, self.clock())
        if self.book is not None:  # any server takes heartbeats; the leader's reaper reads them
            self._spawn(self._logged(self.book.heartbeat(owner, time.time()), f"recording {owner}'s heartbeat"))
        return len(self.sched.owned_by(owner)), self.s.heartbeat_interval_s * self.s.heartbeat_misses

    async def _logged(self, coro: Awaitable[None], what: str) -> None:
        try:
            await coro
        except Exception:  # noqa: BLE001 - best effort; the next write carries the news
            log.warning("%s in the state store failed", what, exc_info=True)

    async def release_owner(self, owner: str) -> list[str]:
        """The owner is done (a run finished): reap everything it holds now, drop its lease."""
        if self.book is not None and not self.leading():
            # A follower: the leader reaps them at its next pass (a tombstone in the store).
            await self.book.release_owner(owner, time.time())
            return []
        ids = self.sched.owned_by(owner)
        self.sched.drop_lease(owner)
        await asyncio.gather(*(self._destroy(sid, f"owner {owner} released its lease") for sid in ids))
        if self.book is not None:
            await self.book.forget_owner(owner)
        return ids

    # ------------------------------------------------------------------ loop
    async def _loop(self) -> None:
        next_reap = next_usage = 0.0
        next_sync = self.clock() + self.s.node_sync_interval_s
        while not self._stopping:
            now = self.clock()
            if not self.leading():
                # A follower (or a leader still rebuilding its view) decides nothing.
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.s.scheduler_lease_renew_s)
                continue
            if now >= next_sync:
                next_sync = now + self.s.node_sync_interval_s
                self._spawn(self._sync_nodes())
            if now >= next_usage:
                next_usage = now + self.s.overcommit_window_s / 10
                if self.usage_probe is not None:
                    for node_id in self.agents:
                        self.sched.usage_sample(node_id, now, self.usage_probe(node_id))
                else:
                    self._spawn(self._sample_usage(now))
            if now >= next_reap:
                next_reap = now + self.s.reaper_interval_s
                if self.book is not None:
                    self._spawn(self._sync_book_logged())
                for d in self.sched.reap(now):
                    self._spawn(self._destroy(d.sandbox_id, f"reaped: {d.reason}"))
                self._settle_orphans()
            for p in self.sched.next_batch(now):
                self._spawn(self._execute(p))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.s.batch_window_s)
            except TimeoutError:
                pass
            # Gather requests arriving within one window into the next batch.
            await asyncio.sleep(self.s.batch_window_s if len(self.sched.queues) else 0)

    async def _sync_book_logged(self) -> None:
        try:
            await self._sync_book()
        except Exception:  # noqa: BLE001 - the store may be away: judged again next pass
            log.warning("reading the control records from the state store failed", exc_info=True)

    async def _sample_usage(self, now: float) -> None:
        """Each node's CPU use, measured on the node (``NodeAgent.usage``), for the
        usage-based overcommit guard: the same on one machine and across a cluster."""
        async def one(node_id: str, agent: NodeAgent) -> None:
            try:
                u = await agent.usage()
            except Exception:  # noqa: BLE001 - a node that cannot answer keeps its last sample
                return
            if node_id in self.sched.cluster.nodes:
                self.sched.usage_sample(node_id, now, u.cpu_busy)

        await asyncio.gather(*(one(n, a) for n, a in self.agents.items()))

    def _settle_orphans(self) -> None:
        """Safety net: a waiter whose request already finished (or was forgotten) without
        being resolved would hang its HTTP call; settle it from the ticket."""
        for rid, fut in list(self._waiters.items()):
            t = self.sched.tickets.get(rid)
            if t is not None and t.state in ("queued", "placed"):
                continue
            if t is not None and t.state == "created" and t.sandbox_id and t.node_id:
                self._spawn(self._resolve_from_node(rid, t.node_id, t.sandbox_id))
                continue
            log.error("request %s had an unresolved waiter in state %s", rid, t.state if t else "unknown")
            self._waiters.pop(rid, None)
            self._sids.pop(rid, None)
            if not fut.done():
                fut.set_exception(SandboxFailure(f"request {rid!r} failed: {t.error if t else 'lost'}; retry it"))

    async def _resolve_from_node(self, request_id: str, node_id: str, sandbox_id: str) -> None:
        try:
            info = await self.agents[node_id].get(sandbox_id)
        except Exception as e:  # noqa: BLE001 - the waiter must learn the outcome either way
            fut = self._waiters.pop(request_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(SandboxFailure(f"request {request_id!r}: its sandbox {sandbox_id} is gone: {e}"))
            return
        self._resolve(request_id, info)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _sem(self, node_id: str) -> asyncio.Semaphore:
        sem = self._sems.get(node_id)
        if sem is None:
            sem = self._sems[node_id] = asyncio.Semaphore(self.sched.parallel_limit())
        return sem

    async def _destroy(self, sandbox_id: str, why: str) -> None:
        r = self.sched.running.get(sandbox_id)
        node_id = r.node_id if r else None
        cpu = await self._cpu_used(node_id, r) if node_id is not None else None
        fence = self._fence()
        self.sched.on_released(sandbox_id, self.clock(), cpu_peak=cpu)
        if node_id is not None:
            try:
                await self.agents[node_id].destroy(sandbox_id, fence=fence)
            except NotFound:
                pass
            log.info("destroyed %s on %s (%s)", sandbox_id, node_id, why)
            if self.on_reaped is not None and r is not None and not r.pool:
                try:
                    await self.on_reaped(sandbox_id, why)
                except Exception:  # noqa: BLE001 - auditing must not stop the reaper
                    log.exception("recording the reap of %s failed", sandbox_id)

    async def _execute(self, p: Placement) -> None:
        agent = self.agents[p.node_id]
        try:
            fence = self._fence()
            if p.kind == "destroy":
                await agent.destroy(p.sandbox_id, fence=fence)  # type: ignore[arg-type]
                return
            req = p.request
            assert req is not None
            if p.kind == "warm":
                try:
                    info = await self._claim(agent, p.sandbox_id, req)  # type: ignore[arg-type]
                except Exception as e:  # noqa: BLE001 - a broken member must not fail the request
                    log.warning("claiming pool member %s failed (%s): placing the request anew", p.sandbox_id, e)
                    self._spawn(self._destroy(p.sandbox_id, "pool member failed its claim"))  # type: ignore[arg-type]
                    self._requeue(req)
                    return
                self._resolve(req.request_id, info)
                return
            for sid in p.evict:
                await agent.destroy(sid, fence=fence)
            for sid in p.preempt:
                await self._preempt(agent, p.node_id, sid)
            await self._create(agent, p, req)
        except Exception as e:  # noqa: BLE001 - every failure is reported, never lost
            log.warning("placement %s on %s failed: %s", p.kind, p.node_id, e)
            retriable = not isinstance(e, _PERMANENT)
            if isinstance(e, (LeaderFenced, NotLeader)):
                # Deposed (the node saw a newer leader, or our lease ran out): nothing is
                # retried here; the caller retries and the new leader places it.
                if isinstance(e, LeaderFenced) and self.leader is not None:
                    self.leader.fenced(e.message)
                e, retriable = NotLeader(f"this server is no longer the scheduler leader ({e.message}); retry",
                                         retry_after=self.s.scheduler_lease_renew_s), False
            if p.kind in ("create", "pool") and p.request is not None and p.request.request_id in self.sched.placed:
                # A bad spec or image fails the same way on every node: no retry.
                self._failed(p.request.request_id, str(e), retriable, cause=e)
                victim = p.request.resume_of
                t = self.sched.tickets.get(p.request.request_id)
                if victim is not None and (t is None or t.state == "failed"):
                    self._preempted.pop(victim, None)
                    log.error("preempted sandbox %s could not be resumed: %s", victim, e)

    async def _preempt(self, agent: NodeAgent, node_id: str, sandbox_id: str) -> None:
        """Checkpoint, then stop, a victim. If the checkpoint fails the victim keeps running
        (accounted again, its resumption withdrawn) and the placement fails retriably."""
        info = await agent.get(sandbox_id)
        tenant = info.tenant or ""
        try:
            assert self._checkpoint is not None
            checkpoint_id = await self._checkpoint(tenant, sandbox_id)
        except Exception:
            for rid, req in list(self.sched.pending.items()):
                if req.resume_of == sandbox_id:
                    self.sched.cancel(rid)
            self.sched.adopt(node_id, sandbox_id, tenant, cpu_request(info.cpu, self.s),
                             share_request(info.memory, self.s.memory_request_ratio),
                             share_request(info.disk, self.s.disk_request_ratio),
                             self.clock(), labels=info.labels)
            raise
        self._preempted[sandbox_id] = (tenant, checkpoint_id)
        if self.book is not None:  # before the stop: a new leader must be able to resume it
            resume = next((r for r in self.sched.pending.values() if r.resume_of == sandbox_id), None)
            spec = resume.payload if resume is not None and isinstance(resume.payload, SandboxSpec) else None
            await self.book.preempted(sandbox_id, PreemptedDoc(tenant=tenant, checkpoint_id=checkpoint_id, spec=spec))
        await agent.destroy(sandbox_id, fence=self._fence())
        log.info("preempted %s on %s (checkpoint %s); queued for resumption", sandbox_id, node_id, checkpoint_id)

    async def _claim(self, agent: NodeAgent, sandbox_id: str, req: Request) -> SandboxInfo:
        """Hand a pool member to the user: the node applies the request's labels/env/tenant
        and starts its TTL."""
        spec = req.payload if isinstance(req.payload, SandboxSpec) else SandboxSpec(image=req.image)
        asked = self._sids.get(req.request_id)
        if asked and self.leader is not None and not self.leader.solo:
            # Several API servers: the member carries the id the caller reserved, so a retry
            # after the leader died mid-hand-over finds it (dsec.api.service._made_for).
            spec = spec.model_copy(update={"labels": {**spec.labels, FOR_LABEL: asked}})
        return await agent.claim(sandbox_id, spec, req.tenant, fence=self._fence())

    async def _create(self, agent: NodeAgent, p: Placement, req: Request) -> None:
        if p.kind == "pool":
            spec = pool_member_spec(req)
        else:
            spec = req.payload if isinstance(req.payload, SandboxSpec) else SandboxSpec(image=req.image)
        async with self._sem(p.node_id):
            if req.resume_of is not None and req.resume_of in self._preempted and self._resume is not None:
                tenant, checkpoint_id = self._preempted[req.resume_of]
                info = await self._resume(tenant, checkpoint_id, req.resume_of)
                del self._preempted[req.resume_of]
                if self.book is not None:
                    await self._logged(self.book.resumed(req.resume_of), "clearing a preemption record")
            elif req.resume_of is not None:
                # Killed by its user while queued (or never checkpointed): nothing to resume.
                self.sched.on_failed(req.request_id, self.clock(), "resumption withdrawn", retriable=False)
                return
            elif req.request_id in self._via:
                via = self._via[req.request_id]
                restore = getattr(via, "restore", None)  # dsec.cluster.checkpoints.RestoreCreator
                build_on = getattr(via, "build_on", None)  # dsec.cluster.episodes.EpisodeOpener
                if restore is not None:  # built on the node placed here, which unpacks the checkpoint
                    info = await agent.create(spec, sandbox_id=self._sids.get(req.request_id) or None,
                                              tenant=req.tenant, restore=restore, fence=self._fence())
                elif build_on is not None:  # a creator that must run on the node placed here
                    info = await build_on(p.node_id, agent, spec, self._sids.get(req.request_id) or "", req.tenant,
                                          fence=self._fence())
                else:
                    info = await via(spec, self._sids.get(req.request_id) or "", req.tenant)
                self._via.pop(req.request_id, None)
            elif p.kind == "pool":
                # A pooled create stays "ready" with no TTL running until it is claimed.
                info = await agent.create(spec, pooled=True, fence=self._fence())
            else:
                info = await agent.create(spec, sandbox_id=self._sids.get(req.request_id),
                                          tenant=None if p.kind == "pool" else req.tenant, fence=self._fence())
        now = self.clock()
        img = self.sched.images.get(req.image)
        if img is not None:
            self.sched.layers_changed(p.node_id, [d for d, _ in img.layers])
        self.sched.on_created(req.request_id, info.id, now)
        if p.kind != "pool":
            self._resolve(req.request_id, info)
        else:
            self._serve_waiting(req.shape)

    def _requeue(self, req: Request) -> None:
        """Submit again a request whose warm hand-over failed (its waiter keeps waiting)."""
        self.sched.forget(req.request_id)
        req.excluded.clear()
        req.cold = True
        try:
            self.sched.submit(req, self.clock())
        except Exception as e:  # noqa: BLE001 - e.g. overloaded now: tell the waiter
            self._sids.pop(req.request_id, None)
            fut = self._waiters.pop(req.request_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(e)
        self._wake.set()

    def _failed(self, request_id: str, error: str, retriable: bool, cause: Exception | None = None) -> None:
        t = self.sched.on_failed(request_id, self.clock(), error, retriable=retriable)
        if t is not None and t.state == "failed":
            self._sids.pop(request_id, None)
            self._via.pop(request_id, None)
            fut = self._waiters.pop(request_id, None)
            if fut is not None and not fut.done():
                # The user's own mistake (bad spec, image, permission) keeps its type and
                # status (4xx naming the field); only node failures become SandboxFailure.
                fut.set_exception(cause if isinstance(cause, (*_PERMANENT, NotLeader)) else
                                  SandboxFailure(f"request {request_id!r} failed: {t.error}"))
        self._wake.set()

    def _resolve(self, request_id: str, info: SandboxInfo) -> None:
        self._sids.pop(request_id, None)
        self._via.pop(request_id, None)
        fut = self._waiters.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(info)
