"""SandboxService: every sandbox operation of the API goes through here.

It enforces tenancy (ownership, image allow-lists, quotas), idempotent create, audit
and metrics, then calls the placement seam. Today that seam (``Creator``) is the node
agent's ``create``; the control plane's scheduler driver plugs in by passing its submit
function as ``creator`` — nothing else changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import ipaddress
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

from dsec.api.audit import AuditLog
from dsec.api.metrics import Metrics
from dsec.config import Settings, parse_bytes
from dsec.control.admission import Limits, Reservations, pids_limit
from dsec.errors import (
    DSecError,
    Forbidden,
    InvalidArgument,
    NotFound,
    Overloaded,
    QuotaExceeded,
    TransientError,
)
from dsec.ids import new_sandbox_id
from dsec.models import (
    BackgroundProcess,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    SandboxInfo,
    SandboxSpec,
)
from dsec.models.sandbox import RESERVED_LABEL_PREFIX, SandboxState, reserved_label_keys
from dsec.net.allowlist import parse_allow_list, system_resolver
from dsec.net.hostaddrs import HostGuard, kernel_delivers_locally, parse_host_allow, parse_node_addresses
from dsec.node.api import NodeAgent
from dsec.state.store import IdempotencyRecord, StateStore, TenantRecord

log = logging.getLogger("dsec.api")

Creator = Callable[[SandboxSpec, str, str], Awaitable[SandboxInfo]]
"""(spec, sandbox_id, tenant) -> SandboxInfo: where a validated create is placed. The
returned id may differ from ``sandbox_id`` (a warm-pool member handed over)."""
Destroyer = Callable[[str], Awaitable[None]]
"""sandbox_id -> None: how a kill frees the sandbox (and its scheduler capacity)."""
ImageCheck = Callable[[str], Awaitable[None]]
"""image ref -> None or raises NotFound naming it (checked before queueing a create)."""

_DEAD = {SandboxState.destroyed, SandboxState.failed, SandboxState.stopped}
_ADMIT_LISTINGS = 8  # node listings one admission may take while creations keep settling


def host_pid_max(path: str = "/proc/sys/kernel/pid_max") -> int:
    """The host's pid_max (I/O edge); Linux's default 32768 when it cannot be read."""
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return 32768


def _unknown_image(image: str) -> NotFound:
    # Never list the node's images: a tenant restricted to some images must not learn the
    # names of the others (issue 18 #13).
    return NotFound(f"image {image!r} is unknown on this node or not available to you; check the name "
                    "(an operator imports images with `dsec image import`)", image=image)


def _check_labels(labels: dict[str, str], server_labels: Collection[str]) -> None:
    """A tenant cannot set a label the control plane acts on (e.g. pass its sandbox off as
    a warm-pool member or a lease's): refuse ``dsec.`` keys the server did not put there."""
    bad = [k for k in reserved_label_keys(labels) if k not in server_labels]
    if bad:
        raise InvalidArgument(f"label {bad[0]!r}: keys starting with {RESERVED_LABEL_PREFIX!r} are reserved for "
                              "DSec itself; rename the label", field="labels", label=bad[0])


def _not_found(sandbox_id: str) -> NotFound:
    return NotFound(f"sandbox {sandbox_id} not found: it never existed, was killed or expired, or belongs "
                    "to another tenant; list yours with `dsec ps`", sandbox_id=sandbox_id)


class SandboxService:
    def __init__(self, settings: Settings, node: NodeAgent, state: StateStore, metrics: Metrics,
                 audit: AuditLog, creator: Creator | None = None, image_check: ImageCheck | None = None) -> None:
        self.settings = settings
        self.node = node
        self.state = state
        self.metrics = metrics
        self.audit = audit
        self._creator: Creator = creator or (lambda spec, sid, t: node.create(spec, sandbox_id=sid, tenant=t))
        self._destroyer: Destroyer = node.destroy
        self._route: Callable[[Creator], Creator] | None = None
        self._image_check = image_check
        self._owners: dict[str, str] = audit.owners  # one map: the audit's sync teardown hook reads it
        self._inflight = 0
        self._creating: set[str] = set()  # recorded in state, not yet listed by the node
        self._writes: set[asyncio.Future[Any]] = set()  # state writes sent off the hand-over's and kill's path
        self._dead_soon: list[str] = []  # killed ids whose dead mark is about to be written
        # Admitted creates not settled yet: quota usage = node listing + these (reserve, then create).
        self._reserved = Reservations()
        self.max_pids = pids_limit(settings.sandbox_max_pids, host_pid_max())
        # The node's own addresses, judged at submit exactly as the network manager judges them.
        self._host_guard = HostGuard(ipaddress.IPv4Network(settings.net_cidr),
                                     tuple(parse_node_addresses(settings.net_node_addresses)),
                                     tuple(parse_host_allow(settings.net_host_allow)))
        self._tenant_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._idem_locks: dict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)
        # Set by the scheduler: preempted sandboxes awaiting resumption (ops answer 503).
        self.preempted: Callable[[str], float | None] | None = None
        self.forget_preempted: Callable[[str], Awaitable[bool]] | None = None
        # Run-level accounting (dsec.accounting.ledger.UsageLedger), set by the app: per-label
        # quotas at admission, exec counts.
        self.usage: Any = None

    def set_placement(self, creator: Creator, destroyer: Destroyer | None = None,
                      route: Callable[[Creator], Creator] | None = None) -> None:
        """Route creates (and kills) through another placement path: the scheduler driver.
        ``route`` wraps a per-call creator (a restore) so it is queued and accounted too."""
        self._creator = creator
        self._route = route
        if destroyer is not None:
            self._destroyer = destroyer

    # --- checks ------------------------------------------------------------------
    def _check_image(self, tenant: TenantRecord, image: str) -> None:
        if tenant.images is not None and not any(fnmatch.fnmatchcase(image, g) for g in tenant.images):
            raise Forbidden(f"tenant {tenant.name!r} may not use image {image!r}; allowed: "
                            f"{', '.join(tenant.images) or 'none'} (ask an admin)", image=image)

    def _check_limits(self, tenant: TenantRecord, spec: SandboxSpec) -> None:
        """Requests that can NEVER fit are 422 naming the limit (retrying would not help)."""
        cap = self.node.capacity()
        factor = self.settings.overcommit_ratio
        if spec.cpu is not None and spec.cpu > cap.cpu * factor:
            raise InvalidArgument(f"cpu={spec.cpu} exceeds the node limit of {cap.cpu * factor:g} CPUs; "
                                  "request fewer CPUs", field="cpu", limit=cap.cpu * factor)
        if isinstance(spec.memory, int) and spec.memory > cap.memory * factor:
            raise InvalidArgument(f"memory={spec.memory} bytes exceeds the node limit of "
                                  f"{int(cap.memory * factor)} bytes; request less memory",
                                  field="memory", limit=int(cap.memory * factor))
        if isinstance(spec.disk, int) and spec.disk > cap.disk:
            raise InvalidArgument(f"disk={spec.disk} bytes exceeds the node limit of {cap.disk} bytes",
                                  field="disk", limit=cap.disk)
        if spec.isolation is not None and spec.isolation not in cap.isolation:
            raise InvalidArgument(f"isolation={spec.isolation!r} is not available on this node "
                                  f"(available: {', '.join(cap.isolation)})", field="isolation")
        if spec.pids is not None and spec.pids > self.max_pids:
            raise InvalidArgument(f"pids={spec.pids} exceeds this node's per-sandbox limit of {self.max_pids} "
                                  "processes (setting sandbox_max_pids, never above the host's pid_max); "
                                  "ask for fewer", field="pids", limit=self.max_pids)
        if tenant.max_sandboxes == 0:
            raise InvalidArgument(f"tenant {tenant.name!r} has quota max_sandboxes=0: it can never create a "
                                  "sandbox; ask an admin to raise it", field="max_sandboxes", quota="max_sandboxes",
                                  limit=0)
        cpu, mem = self._effective(spec)
        if tenant.max_cpu is not None and cpu > tenant.max_cpu:
            raise InvalidArgument(f"cpu={cpu:g} exceeds tenant {tenant.name!r} limit max_cpu={tenant.max_cpu:g}",
                                  field="cpu", limit=tenant.max_cpu)
        if tenant.max_memory is not None and mem > tenant.max_memory:
            raise InvalidArgument(f"memory={mem} exceeds tenant {tenant.name!r} limit "
                                  f"max_memory={tenant.max_memory}", field="memory", limit=tenant.max_memory)

    def _effective(self, spec: SandboxSpec) -> tuple[float, int]:
        cpu = spec.cpu if spec.cpu is not None else self.settings.default_cpu
        mem = spec.memory if isinstance(spec.memory, int) else parse_bytes(self.settings.default_memory)
        return cpu, mem

    async def _check_network(self, spec: SandboxSpec) -> None:
        """The allow-list is validated (and its names resolved) at submit, before the
        request can reach a warm pool: a bad entry found at hand-over would cost the pool
        the member being claimed (issue 18 #13)."""
        if spec.network:
            await asyncio.to_thread(self._judge_allow_list, spec.network)

    def _judge_allow_list(self, allow: list[str]) -> None:
        rules = parse_allow_list(allow, system_resolver)
        if any(r.exact_host for r in rules):
            self._host_guard.check(rules, kernel_delivers_locally)

    async def _live(self, tenant: TenantRecord) -> list[tuple[str, float, int]]:
        """(id, cpu, memory) of the tenant's live sandboxes, listed while no reservation
        settled: a creation that finished (and released) mid-listing might be in neither."""
        for _ in range(_ADMIT_LISTINGS):
            gen = self._reserved.generation
            live = [(i.id, i.cpu, i.memory) for i in await self.node.list(tenant=tenant.name)
                    if i.state not in _DEAD]
            if self._reserved.generation == gen:
                return live
        raise Overloaded(f"tenant {tenant.name!r}: creations kept settling while admitting this one; "
                         "retry after the Retry-After delay", retry_after=self.settings.api_retry_after_s)

    async def _admit(self, tenant: TenantRecord, spec: SandboxSpec, key: str) -> None:
        """Reserve the create against the tenant's quotas, or raise 429 naming the quota
        that ran out. Call under the tenant's lock; the reservation is held until the
        creation settles (``Reservations.release``)."""
        limits = Limits(tenant.max_sandboxes, tenant.max_cpu, tenant.max_memory)
        cpu, mem = self._effective(spec)
        live = [] if limits.unlimited else await self._live(tenant)
        why = self._reserved.try_reserve(key, tenant.name, limits, live, cpu, mem)
        if why is not None:
            raise QuotaExceeded(why.message(tenant.name), quota=why.quota, limit=why.limit, in_use=why.in_use,
                                requested=why.requested, retry_after=self.settings.api_retry_after_s)

    async def _owned(self, tenant: TenantRecord, sandbox_id: str) -> None:
        owner = self._owners.get(sandbox_id)
        if owner is None:
            owner = await self.state.sandbox_owner(sandbox_id)  # the owner's uid (issue 18 #7)
            if owner is None:  # not created through this API: the node's tenant label (a name) decides
                try:
                    label = (await self.node.get(sandbox_id)).tenant
                except NotFound:
                    label = None
                owner = tenant.uid if label is not None and label == tenant.name else None
            if owner is not None:
                self._owners[sandbox_id] = owner
        if owner != tenant.uid:
            raise _not_found(sandbox_id)
        if self.preempted is not None and (wait := self.preempted(sandbox_id)) is not None:
            raise TransientError(f"sandbox {sandbox_id} was preempted by a higher-priority request; its "
                                 "checkpoint is queued to resume under the same id: retry after the "
                                 "Retry-After delay (nothing was run)", retry_after=wait, sandbox_id=sandbox_id)

    # --- create ------------------------------------------------------------------
    def set_image_check(self, check: ImageCheck) -> None:
        """Judge a spec's image with ``check`` before queueing (NotFound: 404 naming it)."""
        self._image_check = check

    async def check_spec(self, tenant: TenantRecord, spec: SandboxSpec,
                         server_labels: Collection[str] = ()) -> None:
        """Everything a create is judged on before it is queued or touches a pool (labels,
        image allow-list, node and tenant limits, pids, allow-list, image known): every path
        that makes a sandbox from a tenant's spec calls this first. ``server_labels``: the
        reserved (``dsec.``) label keys the server itself puts on this spec."""
        _check_labels(spec.labels, server_labels)
        self._check_image(tenant, spec.image)
        self._check_limits(tenant, spec)
        await self._check_network(spec)
        if self._image_check is not None:
            try:
                await self._image_check(spec.image)
            except NotFound:
                raise _unknown_image(spec.image) from None

    def _check_inflight(self) -> None:
        if self._inflight >= self.settings.api_max_inflight_creates:
            self.metrics.creates.labels(result=Overloaded.code).inc()
            raise Overloaded(f"{self._inflight} creates in flight (limit {self.settings.api_max_inflight_creates});"
                             " retry after the Retry-After delay", retry_after=self.settings.api_retry_after_s)

    async def create(self, tenant: TenantRecord, spec: SandboxSpec, creator: Creator | None = None,
                     server_labels: Collection[str] = ()) -> SandboxInfo:
        """``creator`` overrides the placement for this one create (restore from a checkpoint)."""
        await self.check_spec(tenant, spec, server_labels)
        self._check_inflight()
        if spec.request_id is None:
            return await self._create_new(tenant, spec, new_sandbox_id(), creator)
        key = (tenant.uid, spec.request_id)
        async with self._idem_locks[key]:
            try:
                return await self._create_idempotent(tenant, spec, creator)
            finally:
                self._idem_locks.pop(key, None)

    async def create_as(self, tenant: TenantRecord, spec: SandboxSpec, sandbox_id: str,
                        creator: Creator) -> SandboxInfo:
        """A create whose caller picked the id and how the sandbox is built: an episode's
        sandbox (recorded in the blob store before it exists, built on checkpoint layers).
        It is admitted, placed, owned and audited like any create, so an episode is no way
        around the tenant's quotas or the node's bound (issue 18 #4)."""
        self._check_inflight()
        return await self._create_new(tenant, spec, sandbox_id, creator)

    async def _create_idempotent(self, tenant: TenantRecord, spec: SandboxSpec,
                                 creator: Creator | None = None) -> SandboxInfo:
        assert spec.request_id is not None
        # The state store is async (SQLite on its own thread, or Redis shared by every API
        # server): a request id reserved here is seen by all servers, so a client failing
        # over to another server with the same id gets this sandbox, never a second one.
        fresh = new_sandbox_id()
        now = time.time()
        # The fresh id's owner row goes with the reservation (one trip to the state store,
        # not two in a row; issue 15), still before anything can be built under the id. A
        # replay (the request id was seen) leaves it the row of an id never used, marked dead.
        owner_row = asyncio.ensure_future(self.state.record_sandbox(fresh, tenant.uid, now))
        owner_row.add_done_callback(lambda t: t.cancelled() or t.exception())  # awaited below, or moot
        rec = await self.state.idem_reserve(IdempotencyRecord(
            tenant=tenant.uid, request_id=spec.request_id, sandbox_id=fresh, created_at=now))
        if rec.sandbox_id != fresh:
            self._write_behind(self._bury(owner_row, fresh))
        if rec.sandbox_id != fresh or rec.done:  # seen before (here or on another API server)
            found = await self._made_for(rec)
            if found is not None:
                if not rec.done:  # created, then its server crashed (or failed over) before recording it
                    await self.state.idem_complete(tenant.uid, spec.request_id, found.model_dump(mode="json"))
                return found
            if rec.done and rec.info is not None:  # created earlier and since gone: replay the answer
                return SandboxInfo.model_validate({**rec.info, "state": SandboxState.destroyed})
        rid = spec.request_id

        async def complete(info: SandboxInfo) -> None:
            await self.state.idem_complete(tenant.uid, rid, info.model_dump(mode="json"))

        try:
            return await self._create_new(tenant, spec, rec.sandbox_id, creator, finish=complete,
                                          owner_row=owner_row if rec.sandbox_id == fresh else None)
        except TransientError:
            # Outcome unknown (the scheduler leader died or moved with it in flight): the
            # retry keeps this sandbox id, so it finds what was made instead of a second one.
            raise
        except DSecError:
            await self.state.idem_delete(tenant.uid, spec.request_id)  # retry afresh
            raise

    async def _bury(self, owner_row: Awaitable[None], sandbox_id: str) -> None:
        """Mark dead the owner row of an id that will never be built (after it landed)."""
        with contextlib.suppress(Exception):
            await owner_row
        await self.state.mark_dead([sandbox_id], time.time())

    async def _made_for(self, rec: IdempotencyRecord) -> SandboxInfo | None:
        """The sandbox a seen request id made, if it exists: under its reserved id, or a
        warm member handed over for it (labelled with that id by the scheduler)."""
        sid = str(rec.info["id"]) if rec.done and rec.info else rec.sandbox_id
        try:
            return await self.node.get(sid)
        except NotFound:
            pass
        if rec.done:
            return None
        from dsec.control.convert import FOR_LABEL

        made = await self.node.list(labels={FOR_LABEL: rec.sandbox_id})
        return made[0] if made else None

    async def _create_new(self, tenant: TenantRecord, spec: SandboxSpec, sandbox_id: str,
                          creator: Creator | None = None,
                          finish: Callable[[SandboxInfo], Awaitable[None]] | None = None,
                          owner_row: Awaitable[None] | None = None) -> SandboxInfo:
        """``finish`` records the outcome (the request id's answer) once the sandbox exists;
        ``owner_row``: the id's owner row, already sent (else it is written here)."""
        self._inflight += 1
        self.metrics.inflight_creates.set(self._inflight)
        t0 = time.perf_counter()
        reserved = False
        try:
            async with self._tenant_locks[tenant.name]:
                # Admission and registration are atomic per tenant; the create itself is not
                # serialised (its reservation counts it while in flight).
                await self._admit(tenant, spec, sandbox_id)
                reserved = True
                if self.usage is not None:  # per-label quotas (run=r1): 429 naming the quota
                    await self.usage.admit(tenant, spec.labels, sandbox_id)
                self._creating.add(sandbox_id)
            # Owned by the uid before anything is built under the id; outside the tenant's
            # lock (the reservation above already counts it): a tenant's concurrent creates
            # no longer queue behind each other's state store trips (issue 15).
            await (owner_row if owner_row is not None else self.state.record_sandbox(sandbox_id, tenant.uid,
                                                                                      time.time()))
            self._owners[sandbox_id] = tenant.uid
            if creator is not None and self._route is not None:
                creator = self._route(creator)
            # The reservation lasts as long as the creation, not the HTTP call: a caller
            # cancelled mid-create must not free quota for a sandbox still being built.
            task = asyncio.ensure_future((creator or self._creator)(spec, sandbox_id, tenant.name))
            task.add_done_callback(lambda t: (self._reserved.release(sandbox_id), self._usage_release(sandbox_id),
                                              t.cancelled() or t.exception()))
            reserved = False  # released by the task's callback from here on
            info = await asyncio.shield(task)
        except Exception as e:
            self.metrics.creates.labels(result=e.code if isinstance(e, DSecError) else "internal").inc()
            if not isinstance(e, TransientError):  # unknown outcome: it may exist (found on retry)
                await self.state.mark_dead([sandbox_id], time.time())
            if isinstance(e, NotFound) and "available" in e.details:  # the node's image list: never shown
                raise _unknown_image(spec.image) from None
            raise
        finally:
            if reserved:
                self._reserved.release(sandbox_id)
                self._usage_release(sandbox_id)
            self._creating.discard(sandbox_id)
            self._inflight -= 1
            self.metrics.inflight_creates.set(self._inflight)
        handed_over = info.id != sandbox_id  # warm-pool hand-over: the user owns the pool member

        # Independent writes, sent together: one trip to the state store's thread, not three
        # (a warm hand-over's latency is mostly such hops; issue 15).
        now = time.time()
        writes = [self.state.record_sandbox(info.id, tenant.uid, now), self.state.mark_dead([sandbox_id], now)] \
            if handed_over else []
        if handed_over:
            self._owners[info.id] = tenant.uid  # this server answers for it at once, from memory
            self._owners.pop(sandbox_id, None)
        if finish is not None:  # a request id's answer is durable before it is given
            writes.append(finish(info))
            await asyncio.gather(*writes)
        elif writes:
            # Off the hand-over's critical path: until the owner row lands, this server knows
            # the owner from memory, and another server (or this one after a crash) falls
            # back to the node's tenant label, which the claim has already set.
            self._write_behind(asyncio.gather(*writes))
        self.metrics.child(self.metrics.create_seconds, info.isolation).observe(time.perf_counter() - t0)
        self.metrics.child(self.metrics.creates, "ok").inc()
        self.audit.record(info.id, tenant.name, "create", image=info.image, image_id=info.image_id,
                          cpu=info.cpu, memory=info.memory, isolation=info.isolation, labels=info.labels,
                          network=info.network, request_id=spec.request_id)
        return info

    async def flush(self) -> None:
        """Wait for the state writes sent off the hand-over's and the kill's path (before
        the store closes)."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    def _write_behind(self, write: Awaitable[Any]) -> None:
        """Send a state write off the request's path (``flush`` waits for it)."""
        task = asyncio.ensure_future(write)
        self._writes.add(task)
        task.add_done_callback(self._write_done)

    def _write_done(self, task: asyncio.Future[Any]) -> None:
        self._writes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a state write sent off the request's path failed: %s", task.exception())

    def _usage_release(self, sandbox_id: str) -> None:
        if self.usage is not None:
            self.usage.release(sandbox_id)

    # --- lifecycle ---------------------------------------------------------------
    async def get(self, tenant: TenantRecord, sandbox_id: str) -> SandboxInfo:
        await self._owned(tenant, sandbox_id)
        return await self.node.get(sandbox_id)

    async def list(self, tenant: TenantRecord, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        infos = await self.node.list(labels=labels or None, tenant=tenant.name)
        # The node labels by name; a sandbox this API made for a removed namesake (another
        # uid) is not this tenant's (issue 18 #7).
        return [i for i in infos if self._owners.get(i.id, tenant.uid) == tenant.uid]

    async def kill(self, tenant: TenantRecord, sandbox_id: str) -> None:
        try:
            await self._owned(tenant, sandbox_id)
        except TransientError:  # preempted and queued: killing it withdraws the resumption
            assert self.forget_preempted is not None
            await self.forget_preempted(sandbox_id)
        else:
            await self.audit.before_destroy(sandbox_id, tenant.name)
            await self._destroyer(sandbox_id)
        self.audit.record(sandbox_id, tenant.name, "kill")
        self._owners.pop(sandbox_id, None)
        self._mark_dead_soon(sandbox_id)

    def _mark_dead_soon(self, sandbox_id: str) -> None:
        """A killed id's dead mark, off the kill's critical path and batched with the other
        kills answered in the same loop iteration: one state store trip for all of them
        (issue 15: an RL episode ends with a kill). The id is already gone on the node and
        from this server's owners, so any call naming it fails at once; another server
        finds no sandbox behind the owner row. If the mark is lost (a crash), ``reconcile``
        sets it. ``flush`` waits for it."""
        self._dead_soon.append(sandbox_id)
        if len(self._dead_soon) == 1:
            self._write_behind(self._write_dead_soon())

    async def _write_dead_soon(self) -> None:
        await asyncio.sleep(0)  # kills answered in this loop iteration join the batch
        ids, self._dead_soon = self._dead_soon, []
        await self.state.mark_dead(ids, time.time())

    async def reaped(self, sandbox_id: str, why: str) -> None:
        """The control plane removed a sandbox on its own (TTL, silent owner lease, release)."""
        owner = self._owners.pop(sandbox_id, None) or await self.state.sandbox_owner(sandbox_id)
        if owner is not None:
            self.audit.record(sandbox_id, owner, "reaped", reason=why)
        await self.state.mark_dead([sandbox_id], time.time())

    async def kill_by_labels(self, tenant: TenantRecord, labels: dict[str, str]) -> list[str]:
        if not labels:
            raise InvalidArgument("bulk kill needs at least one label (refusing to kill everything)",
                                  field="labels")
        victims = [i.id for i in await self.list(tenant, labels)]
        results = await asyncio.gather(*(self.kill(tenant, v) for v in victims), return_exceptions=True)
        return [v for v, r in zip(victims, results) if not isinstance(r, BaseException)]

    async def update_network(self, tenant: TenantRecord, sandbox_id: str, allow: list[str]) -> SandboxInfo:
        await self._owned(tenant, sandbox_id)
        info = await self.node.update_network(sandbox_id, allow)
        self.audit.record(sandbox_id, tenant.name, "network_update", allow=allow)
        return info

    async def set_timeout(self, tenant: TenantRecord, sandbox_id: str, timeout: float) -> SandboxInfo:
        await self._owned(tenant, sandbox_id)
        info = await self.node.set_timeout(sandbox_id, timeout)
        self.audit.record(sandbox_id, tenant.name, "set_timeout", timeout=timeout)
        return info

    # --- exec --------------------------------------------------------------------
    def _audit_exec(self, tenant: TenantRecord, sandbox_id: str, req: ExecRequest, res: ExecResult,
                    mode: str) -> None:
        result = "timeout" if res.timed_out else ("ok" if res.exit_code == 0 else "nonzero")
        self.metrics.child(self.metrics.execs, result).inc()
        self.audit.record(sandbox_id, tenant.name, "exec", argv=req.argv(), cwd=req.cwd, mode=mode,
                          exit_code=res.exit_code, duration=round(res.duration, 6), timed_out=res.timed_out,
                          pid=res.pid)

    async def exec(self, tenant: TenantRecord, sandbox_id: str, req: ExecRequest) -> ExecResult:
        await self._owned(tenant, sandbox_id)
        t0 = time.perf_counter()
        try:
            res = await self.node.exec(sandbox_id, req)
        except DSecError as e:
            self.metrics.child(self.metrics.execs, e.code).inc()
            self.audit.record(sandbox_id, tenant.name, "exec_error", argv=req.argv(), code=e.code)
            raise
        mode = "background" if req.background else "sync"
        if self.usage is not None:
            self.usage.count_exec(sandbox_id)
        self.metrics.child(self.metrics.exec_seconds, mode).observe(time.perf_counter() - t0)
        self._audit_exec(tenant, sandbox_id, req, res, mode)
        return res

    async def exec_stream(self, tenant: TenantRecord, sandbox_id: str,
                          req: ExecRequest) -> AsyncIterator[ExecEvent]:
        """Check ownership first (so errors are a proper HTTP status), then stream."""
        await self._owned(tenant, sandbox_id)
        return self._stream(tenant, sandbox_id, req)

    async def _stream(self, tenant: TenantRecord, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        t0 = time.perf_counter()
        async for ev in self.node.exec_stream(sandbox_id, req):
            if ev.kind == "exit" and ev.result is not None:
                if self.usage is not None:
                    self.usage.count_exec(sandbox_id)
                self.metrics.exec_seconds.labels(mode="stream").observe(time.perf_counter() - t0)
                self._audit_exec(tenant, sandbox_id, req, ev.result, "stream")
            yield ev

    async def processes(self, tenant: TenantRecord, sandbox_id: str) -> list[BackgroundProcess]:
        await self._owned(tenant, sandbox_id)
        return await self.node.processes(sandbox_id)

    async def kill_process(self, tenant: TenantRecord, sandbox_id: str, pid: int, signal: int) -> None:
        await self._owned(tenant, sandbox_id)
        await self.node.kill_process(sandbox_id, pid, signal)
        self.audit.record(sandbox_id, tenant.name, "signal", pid=pid, signal=signal)

    # --- files -------------------------------------------------------------------
    async def read_file(self, tenant: TenantRecord, sandbox_id: str, path: str) -> bytes:
        await self._owned(tenant, sandbox_id)
        return await self.node.read_file(sandbox_id, path)

    async def write_file(self, tenant: TenantRecord, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        await self._owned(tenant, sandbox_id)
        await self.node.write_file(sandbox_id, path, data, mode)
        self.audit.record(sandbox_id, tenant.name, "file_write", path=path, size=len(data), mode=oct(mode),
                          sha256=hashlib.sha256(data).hexdigest())

    async def list_files(self, tenant: TenantRecord, sandbox_id: str, path: str) -> list[FileEntry]:
        await self._owned(tenant, sandbox_id)
        return await self.node.list_files(sandbox_id, path)

    async def remove_file(self, tenant: TenantRecord, sandbox_id: str, path: str, recursive: bool) -> None:
        await self._owned(tenant, sandbox_id)
        await self.node.remove_file(sandbox_id, path, recursive)
        self.audit.record(sandbox_id, tenant.name, "file_remove", path=path, recursive=recursive)

    async def upload_tar(self, tenant: TenantRecord, sandbox_id: str, path: str, data: bytes) -> None:
        await self._owned(tenant, sandbox_id)
        await self.node.upload_tar(sandbox_id, path, data)
        self.audit.record(sandbox_id, tenant.name, "upload", path=path, size=len(data),
                          sha256=hashlib.sha256(data).hexdigest())

    async def download_tar(self, tenant: TenantRecord, sandbox_id: str, path: str) -> bytes:
        await self._owned(tenant, sandbox_id)
        return await self.node.download_tar(sandbox_id, path)

    # --- audit / housekeeping ----------------------------------------------------------
    async def audit_log(self, tenant: TenantRecord, sandbox_id: str, limit: int) -> list[dict[str, Any]]:
        if await self.state.sandbox_owner(sandbox_id) != tenant.uid:
            raise NotFound(f"no audit log for sandbox {sandbox_id}: unknown, another tenant's, or older than "
                           f"the retention period ({self.settings.audit_retention_s:g}s)", sandbox_id=sandbox_id)
        await self.audit.flush()
        recs = await self.state.audit(sandbox_id, limit)
        return [{"ts": r.ts, "kind": r.kind, "data": r.data} for r in recs]

    async def reconcile(self, now: float | None = None) -> int:
        """Mark sandboxes that vanished (TTL, reaper, crash) dead; prune audit past retention."""
        now = time.time() if now is None else now
        await self.flush()  # kills' dead marks first: they carry the kill's time
        live = {i.id for i in await self.node.list() if i.state not in _DEAD}
        recorded = await self.state.live_sandbox_ids()
        gone = [s for s in recorded if s not in live and s not in self._creating]
        await self.state.mark_dead(gone, now)
        for s in gone:
            self._owners.pop(s, None)
        await self.audit.flush()
        return await self.state.prune(now - self.settings.audit_retention_s)
