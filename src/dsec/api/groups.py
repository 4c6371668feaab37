"""Group (gang) admission: n sandboxes of one spec, all or none, within a deadline.

RL rollouts come in groups (GRPO: 8-64 completions of one prompt, each needing the same
environment at the same moment). ``GroupAdmission.create`` admits a group as ONE unit:

- bad input is refused at submit (422 naming it): n outside 1..group_max, n above the
  tenant's ``max_sandboxes``, or more sandboxes of this shape than the whole cluster
  could hold even empty;
- groups queue FIFO behind one lock, each with one position (groups ahead of it) and an
  ETA; only the head group ever takes room, so two groups racing for the last room cannot
  deadlock each holding part of it (the head gets it, the next one waits its turn);
- the head group starts its n creates only when the scheduler's view shows room for all
  of them (warm pool members of the shape count: a hand-over needs no new room; warm
  pools serve groups like any create). If a member still fails (single creates took the
  room meanwhile), every member made is killed and the group tries again until its
  deadline; at the deadline it is 429 with its position and ETA. A caller never gets, and
  the node never keeps, part of a group.

Each member is an ordinary ``SandboxService.create`` (quotas, run quotas, ownership,
audit, accounting); no member carries a request id (a retried group starts over).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from typing import Any

from pydantic import BaseModel, Field

from dsec.errors import (
    CapacityExhausted,
    DSecError,
    InvalidArgument,
    Overloaded,
    SandboxFailure,
    Timeout,
    TransientError,
)
from dsec.models import SandboxInfo, SandboxSpec
from dsec.state.store import TenantRecord

# A member that failed with one of these may succeed on the next attempt.
_RETRIABLE = (Overloaded, CapacityExhausted, Timeout, TransientError, SandboxFailure)


class GroupRequest(BaseModel):
    n: int = Field(..., description="Sandboxes in the group (1..group_max)")
    spec: SandboxSpec
    wait_s: float | None = Field(None, gt=0, description="Deadline to admit the whole group (default group_wait_s)")


class QueuedGroup(BaseModel):
    group_id: str
    n: int
    position: int = Field(..., description="Groups ahead of it now")
    eta_s: float = Field(..., description="Rough wait until it is admitted (recent groups' admission times)")
    waited_s: float


class GroupResult(BaseModel):
    group_id: str
    sandboxes: list[SandboxInfo]
    position: int = Field(..., description="Groups ahead of this one when it was submitted")
    waited_s: float = Field(..., description="Seconds from submit to the whole group admitted")
    attempts: int = Field(..., description="Times the group tried to take room (rolled back in between)")


def max_of_shape(nodes: list[Any], cpu: float, memory: int, disk: int, isolation: str, ratio: float) -> int:
    """How many sandboxes of this shape the nodes could hold if they were empty."""
    total = 0
    for nd in nodes:
        if isolation not in nd.isolation:
            continue
        fit = nd.max_sandboxes
        if cpu > 0:
            fit = min(fit, math.floor(nd.cpu * ratio / cpu + 1e-9))
        if memory > 0:
            fit = min(fit, math.floor(nd.memory * ratio / memory))
        if disk > 0:
            fit = min(fit, nd.disk // disk)
        total += max(0, fit)
    return total


def room_now(nodes: list[Any], need: int, cpu: float, memory: int, disk: int, isolation: str, ratio: float,
             threshold: float) -> bool:
    """Could ``need`` more sandboxes of this shape be placed now (greedy, on copies of each
    healthy node's allocation, by the scheduler's overcommit rule)?"""
    left = need
    for nd in nodes:
        if left <= 0:
            break
        if not nd.healthy or isolation not in nd.isolation or nd.predicted >= threshold:
            continue
        ucpu, umem, udisk, count = nd.used_cpu, nd.used_memory, nd.used_disk, nd.count
        while left > 0 and ucpu + cpu <= nd.cpu * ratio + 1e-9 and umem + memory <= nd.memory * ratio \
                and udisk + disk <= nd.disk and count < nd.max_sandboxes:
            ucpu, umem, udisk, count, left = ucpu + cpu, umem + memory, udisk + disk, count + 1, left - 1
    return left <= 0


class GroupAdmission:
    def __init__(self, svc: Any) -> None:
        self.svc = svc  # SandboxService
        self._lock = asyncio.Lock()  # FIFO: asyncio wakes waiters in arrival order
        self._queue: list[str] = []
        self._meta: dict[str, tuple[str, int, float]] = {}  # group id -> (tenant uid, n, submitted)
        self._done_s: list[float] = []  # recent admission durations (ETA estimate)

    # --- the scheduler's view (read only) ---------------------------------------------
    def _driver(self) -> Any:
        sched = getattr(self.svc, "_creator", None)
        return getattr(sched, "__self__", None)  # the SchedulerDriver whose bound create is the seam

    def _shape(self, spec: SandboxSpec, tenant: TenantRecord) -> tuple[Any, list[Any], int]:
        """(scheduler request of one member, nodes, free warm members of its shape)."""
        from dsec.control.convert import spec_to_request

        driver = self._driver()
        s = self.svc.settings
        if driver is None or not hasattr(driver, "sched"):
            from types import SimpleNamespace

            # On a cluster (the router), each ready node as it is: a group spreads over nodes,
            # and the merged capacity is one node's size with every node's sandbox count.
            per_node = getattr(self.svc.node, "ready_capacities", None)
            caps = per_node() if per_node is not None else [self.svc.node.capacity()]
            nodes = [SimpleNamespace(cpu=cap.cpu, memory=cap.memory, disk=cap.disk, max_sandboxes=cap.max_sandboxes,
                                     isolation=cap.isolation, healthy=True, predicted=0.0, used_cpu=0.0,
                                     used_memory=0, used_disk=0, count=0) for cap in caps]
            return spec_to_request(spec, tenant.name, "group-probe", s), nodes, 0
        req = spec_to_request(driver._default_to_fit(spec), tenant.name, "group-probe", s)
        pools = driver.sched.pools
        warm = len(pools.free.get(req.shape, ())) if pools is not None else 0
        # Lost and draining nodes (unhealthy to the scheduler) hold no group member.
        return req, [n for n in driver.sched.cluster.nodes.values() if n.healthy], warm

    def _check(self, tenant: TenantRecord, spec: SandboxSpec, n: int) -> None:
        s = self.svc.settings
        if not 1 <= n <= s.group_max:
            raise InvalidArgument(f"n={n}: a group has 1 to {s.group_max} sandboxes (setting group_max)",
                                  field="n", limit=s.group_max)
        if tenant.max_sandboxes is not None and n > tenant.max_sandboxes:
            raise InvalidArgument(f"a group of {n} can never fit tenant {tenant.name!r}'s quota max_sandboxes="
                                  f"{tenant.max_sandboxes}; ask for fewer or ask an admin", field="n",
                                  quota="max_sandboxes", limit=tenant.max_sandboxes)
        req, nodes, _ = self._shape(spec, tenant)
        most = max_of_shape(nodes, req.cpu, req.memory, req.disk, req.isolation, s.overcommit_ratio)
        if n > most:
            raise InvalidArgument(f"a group of {n} never fits: the cluster holds at most {most} sandboxes of this "
                                  f"shape (cpu={req.cpu_limit:g}, memory={req.memory}, disk={req.disk}) even "
                                  "when empty; ask for fewer or smaller sandboxes", field="n", limit=most)

    def _has_room(self, tenant: TenantRecord, spec: SandboxSpec, n: int) -> bool:
        s = self.svc.settings
        req, nodes, warm = self._shape(spec, tenant)
        if self._driver() is None:
            return True  # no scheduler view: the creates decide (and roll back)
        return room_now(nodes, max(0, n - warm), req.cpu, req.memory, req.disk, req.isolation,
                        s.overcommit_ratio, s.overcommit_threshold)

    def eta(self, position: int) -> float:
        per = sorted(self._done_s)[len(self._done_s) // 2] if self._done_s else self.svc.settings.api_retry_after_s
        return round((position + 1) * per, 1)

    # --- admission ---------------------------------------------------------------------
    async def create(self, tenant: TenantRecord, spec: SandboxSpec, n: int, wait_s: float | None = None
                     ) -> GroupResult:
        """Admit all ``n`` or none by ``wait_s`` (default ``group_wait_s``)."""
        s = self.svc.settings
        spec = spec.model_copy(update={"request_id": None})
        self._check(tenant, spec, n)
        group_id = "grp-" + secrets.token_hex(6)
        t0 = time.monotonic()
        deadline = t0 + (wait_s or s.group_wait_s)
        position = len(self._queue)
        self._queue.append(group_id)
        self._meta[group_id] = (tenant.uid, n, t0)
        attempts = 0
        try:
            try:
                await asyncio.wait_for(self._lock.acquire(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise self._late(group_id, n, position) from None
            try:
                while True:
                    if self._has_room(tenant, spec, n):
                        attempts += 1
                        made = await self._attempt(tenant, spec, n)
                        if made is not None:
                            waited = time.monotonic() - t0
                            self._done_s = (self._done_s + [waited])[-32:]
                            self.svc.audit.record(made[0].id, tenant.name, "group", group_id=group_id,
                                                  sandboxes=[i.id for i in made], waited_s=round(waited, 3))
                            return GroupResult(group_id=group_id, sandboxes=made, position=position,
                                               waited_s=waited, attempts=attempts)
                    if time.monotonic() >= deadline:
                        raise self._late(group_id, n, position)
                    await asyncio.sleep(min(s.group_poll_s, max(0.0, deadline - time.monotonic())))
            finally:
                self._lock.release()
        finally:
            self._queue.remove(group_id)
            self._meta.pop(group_id, None)

    def queued(self, tenant: TenantRecord) -> list[QueuedGroup]:
        """The tenant's groups not admitted yet, with their positions and ETAs."""
        now = time.monotonic()
        return [QueuedGroup(group_id=g, n=n, position=i, eta_s=self.eta(i), waited_s=round(now - t, 3))
                for i, g in enumerate(self._queue) if (m := self._meta.get(g)) and m[0] == tenant.uid
                for _, n, t in [m]]

    async def _attempt(self, tenant: TenantRecord, spec: SandboxSpec, n: int) -> list[SandboxInfo] | None:
        """All n creates at once; on any failure every member made is killed. None: try
        again (the room was taken meanwhile); a permanent error is raised."""
        results = await asyncio.gather(*(self.svc.create(tenant, spec) for _ in range(n)), return_exceptions=True)
        made = [r for r in results if isinstance(r, SandboxInfo)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return made
        await asyncio.gather(*(self.svc.kill(tenant, i.id) for i in made), return_exceptions=True)
        permanent = [e for e in errors if not isinstance(e, _RETRIABLE)]
        if permanent:
            raise permanent[0]
        return None

    def _late(self, group_id: str, n: int, position: int) -> DSecError:
        ahead = self._queue.index(group_id) if group_id in self._queue else position
        eta = self.eta(ahead)
        return Overloaded(f"group {group_id} of {n} sandboxes was not admitted within its deadline (all or none: "
                          f"nothing was created); {ahead} group(s) ahead of it; retry after ~{eta:g}s or free "
                          "room (kill idle sandboxes, ask for fewer or smaller ones)", group_id=group_id,
                          position=ahead, eta_s=eta, retry_after=max(1.0, eta))
