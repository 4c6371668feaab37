"""Pools of reset-able sandboxes behind ``/run_code``: one pool per (tenant, image, memory).

A call takes a free member (or creates one, up to ``fusion_pool_max``; beyond, it waits
for one to come back), runs, and hands it back. Giving back *resets* the sandbox
(``sb.reset()``: processes, files, /dev, IPC, limits and network as created) before any
other call may use it, so no state is carried from one call to the next. Members are
ordinary sandboxes of the tenant (created through ``SandboxService``: quotas, image
allow-lists, audit and metrics apply), labelled ``dsec.fusion=pool``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dsec.api.services import Services
from dsec.errors import DSecError
from dsec.models import SandboxSpec
from dsec.state.store import TenantRecord

log = logging.getLogger("dsec.fusion")

POOL_LABEL = {"dsec.fusion": "pool"}
IDLE_TRIM_S = 120.0
"""Free members unused this long are killed (their reservation goes back to the node)."""
MAX_PARALLEL_CREATES = 4
"""Creates in flight per pool: a burst of calls grows the pool a few at a time while
returned members serve the rest (a create costs ~10x a reset)."""
FULL_BACKOFF_S = 5.0
"""After a create found no room (429/503), calls wait for members this long before trying again."""

PoolKey = tuple[str, str, int]  # tenant uid (never the name: issue 18 #7), image, memory MB


@dataclass
class _Member:
    id: str
    tenant: TenantRecord
    born: float
    last_used: float


@dataclass
class _Pool:
    free: list[_Member] = field(default_factory=list)
    size: int = 0  # members that exist or are being created (free + busy + creating)
    creating: int = 0
    full_until: float = 0.0  # no creates before this (monotonic): the last one found no room
    waiters: deque[asyncio.Future[_Member | None]] = field(default_factory=deque)


class FusionPools:
    def __init__(self, services: Services) -> None:
        self.svc = services
        self.settings = services.settings
        self._pools: dict[PoolKey, _Pool] = {}
        self._swept: set[str] = set()  # tenants whose members from an earlier server run were killed
        self._sweep_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters = {"created": 0, "reused": 0, "reset_failed": 0, "trimmed": 0}

    # --- public -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def sandbox(self, tenant: TenantRecord, image: str, memory_mb: int) -> AsyncIterator[str]:
        """A clean sandbox for one call; reset and given back afterwards."""
        key = (tenant.uid, image, memory_mb)
        member = await self._acquire(tenant, key)
        try:
            yield member.id
        finally:
            self._spawn(self._give_back(key, member))

    def stats(self) -> dict[str, object]:
        return {"pools": {f"{t}/{i}/{m}MB": {"size": p.size, "free": len(p.free), "waiting": len(p.waiters)}
                          for (t, i, m), p in self._pools.items()}, **self.counters}

    async def close(self) -> None:
        """Kill every member (server shutdown)."""
        for t in list(self._tasks):
            t.cancel()
        for pool in self._pools.values():
            for m in pool.free:
                await self._kill(m)
            pool.free.clear()
        self._pools.clear()

    # --- internals ----------------------------------------------------------------------

    def _spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _acquire(self, tenant: TenantRecord, key: PoolKey) -> _Member:
        """A free member at once, else wait for the first one back. Growing the pool runs
        beside the wait (a create may queue for room; a returned member often comes first)."""
        await self._sweep_old_members(tenant)
        pool = self._pools.setdefault(key, _Pool())
        now = time.monotonic()
        self._trim(pool, now)
        while pool.free:
            m = pool.free.pop()  # most recently used first: warm caches
            if now - m.born < self.settings.fusion_sandbox_ttl_s:
                self.counters["reused"] += 1
                return m
            self._retire(key, pool, m)
        if pool.size == 0 or (pool.size < self.settings.fusion_pool_max and now >= pool.full_until
                              and pool.creating < MAX_PARALLEL_CREATES
                              and pool.creating < len(pool.waiters) + 1):
            pool.size += 1
            pool.creating += 1
            self._spawn(self._grow(tenant, key, pool))
        return await self._wait(pool)

    async def _grow(self, tenant: TenantRecord, key: PoolKey, pool: _Pool) -> None:
        try:
            try:
                member = await self._create(tenant, key)
            except DSecError as e:
                # The first member of a pool found no room, while other pools sit on idle
                # members (another language, another memory size): give their room back, retry once.
                if e.http_status not in (429, 503) or pool.size > 1 or not await self._free_room(key):
                    raise
                member = await self._create(tenant, key)
        except BaseException as e:
            pool.size -= 1
            if isinstance(e, DSecError) and e.http_status in (429, 503) and pool.size > 0:
                # No room for one more (tenant quota, node full): the members there are serve.
                pool.full_until = time.monotonic() + FULL_BACKOFF_S
            elif pool.size == 0:  # nobody will ever hand a member back: fail the callers
                while pool.waiters:
                    fut = pool.waiters.popleft()
                    if not fut.done():
                        fut.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
            if not isinstance(e, Exception):
                raise
            return
        finally:
            pool.creating -= 1
        if not self._wake(pool, member):
            pool.free.append(member)

    async def _wait(self, pool: _Pool) -> _Member:
        fut: asyncio.Future[_Member | None] = asyncio.get_running_loop().create_future()
        pool.waiters.append(fut)
        try:
            got = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None and fut.result() is not None:
                pool.free.append(fut.result())  # type: ignore[arg-type]  # handed one while cancelled
            raise
        assert got is not None
        return got

    def _wake(self, pool: _Pool, member: _Member) -> bool:
        """Hand ``member`` to the first live waiter."""
        while pool.waiters:
            fut = pool.waiters.popleft()
            if not fut.done():
                fut.set_result(member)
                return True
        return False

    async def _create(self, tenant: TenantRecord, key: PoolKey) -> _Member:
        _, image, memory_mb = key
        s = self.settings
        spec = SandboxSpec(image=image, cpu=s.fusion_cpu, memory=memory_mb * 1024 * 1024, disk="1G",
                           pids=s.fusion_pids, timeout=s.fusion_sandbox_ttl_s + 600, labels=dict(POOL_LABEL))
        info = await self.svc.sandboxes.create(tenant, spec, server_labels=POOL_LABEL)
        self.counters["created"] += 1
        now = time.monotonic()
        return _Member(id=info.id, tenant=tenant, born=now, last_used=now)

    async def _give_back(self, key: PoolKey, member: _Member) -> None:
        pool = self._pools.get(key)
        try:
            await self.svc.node.reset(member.id)  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - dead (TTL, node restart) or broken: replace it
            self.counters["reset_failed"] += 1
            log.warning("run_code sandbox %s could not be reset (%s); replacing it", member.id, e)
            await self._kill(member)
            if pool is not None:
                pool.size -= 1
                if pool.waiters:  # someone waits for this member: make a new one
                    pool.size += 1
                    pool.creating += 1
                    self._spawn(self._grow(member.tenant, key, pool))
            return
        if pool is None:  # closed meanwhile
            await self._kill(member)
            return
        member.last_used = time.monotonic()
        if not self._wake(pool, member):
            pool.free.append(member)

    async def _free_room(self, needy: PoolKey) -> bool:
        """Kill the idle members of every other pool (least recently used first); True if any."""
        victims: list[_Member] = []
        for key, pool in self._pools.items():
            if key != needy and pool.free:
                victims += pool.free
                pool.size -= len(pool.free)
                pool.free.clear()
        victims.sort(key=lambda m: m.last_used)
        self.counters["trimmed"] += len(victims)
        await asyncio.gather(*(self._kill(m) for m in victims))
        return bool(victims)

    def _retire(self, key: PoolKey, pool: _Pool, m: _Member) -> None:
        pool.size -= 1
        self._spawn(self._kill(m))

    def _trim(self, pool: _Pool, now: float) -> None:
        keep = []
        for m in pool.free:
            if now - m.last_used > IDLE_TRIM_S:
                pool.size -= 1
                self.counters["trimmed"] += 1
                self._spawn(self._kill(m))
            else:
                keep.append(m)
        pool.free[:] = keep

    async def _kill(self, m: _Member) -> None:
        with contextlib.suppress(Exception):  # already gone (TTL): nothing left to free
            await self.svc.sandboxes.kill(m.tenant, m.id)

    async def _sweep_old_members(self, tenant: TenantRecord) -> None:
        """Members left by an earlier run of the server belong to no pool now: kill them
        once per tenant, before this run makes its own."""
        if tenant.uid in self._swept:
            return
        async with self._sweep_lock:
            if tenant.uid in self._swept:
                return
            with contextlib.suppress(Exception):
                await self.svc.sandboxes.kill_by_labels(tenant, dict(POOL_LABEL))
            self._swept.add(tenant.uid)

