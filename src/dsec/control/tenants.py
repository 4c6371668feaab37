"""Tenant level: per-tenant priority queues, quotas and weighted fair share. Pure.

Which request goes next:
1. Effective class = priority class minus one per ``priority_aging_s`` waited (floor 0),
   so a low request queued long enough competes as high: low priority never starves.
2. Among tenants, the lowest weighted dominant share wins (DRF: a tenant's share is the
   larger of its CPU and memory fraction of the cluster, divided by its weight).
3. Ties: the oldest request.
A tenant whose head request would exceed its quota is skipped (its request waits in its
queue, never in anyone else's way). Every queue is bounded (``tenant_max_queued``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dsec.config import Settings, parse_bytes
from dsec.control.types import PRIORITY_NAMES, Request
from dsec.errors import QuotaExceeded


@dataclass(slots=True)
class Quota:
    max_sandboxes: int
    cpu: float
    memory: int
    weight: float = 1.0

    @classmethod
    def default(cls, s: Settings) -> Quota:
        return cls(s.tenant_max_sandboxes, s.tenant_max_cpu, parse_bytes(s.tenant_max_memory))


@dataclass(slots=True)
class TenantState:
    name: str
    quota: Quota
    queues: tuple[deque[Request], deque[Request], deque[Request]] = field(
        default_factory=lambda: (deque(), deque(), deque()))
    count: int = 0
    cpu: float = 0.0
    memory: int = 0

    @property
    def queued(self) -> int:
        return len(self.queues[0]) + len(self.queues[1]) + len(self.queues[2])

    def admits(self, req: Request) -> bool:
        q = self.quota
        return (self.count < q.max_sandboxes and self.cpu + req.cpu <= q.cpu + 1e-9
                and self.memory + req.memory <= q.memory)


class TenantQueues:
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.aging = s.priority_aging_s
        self.max_queued = s.tenant_max_queued
        self.tenants: dict[str, TenantState] = {}
        self.total_cpu = 1.0
        self.total_memory = 1
        self._len = 0
        self._class_len = [0, 0, 0]  # queued per priority class, all tenants (for position)

    def __len__(self) -> int:
        return self._len

    def tenant(self, name: str) -> TenantState:
        t = self.tenants.get(name)
        if t is None:
            t = self.tenants[name] = TenantState(name, Quota.default(self.s))
        return t

    def set_quota(self, name: str, quota: Quota) -> None:
        if quota.weight <= 0:
            raise ValueError(f"tenant {name!r}: quota weight must be > 0, got {quota.weight}")
        self.tenant(name).quota = quota

    def check_quota(self, req: Request) -> None:
        """Raise ``QuotaExceeded`` if ``req`` can never run for its tenant or the queue is full."""
        t = self.tenants.get(req.tenant) or self.tenant(req.tenant)
        q = t.quota
        if req.cpu <= q.cpu and req.memory <= q.memory and 0 < q.max_sandboxes and (
                len(t.queues[0]) + len(t.queues[1]) + len(t.queues[2]) < self.max_queued):
            return  # the common case, without building the error tuples
        for what, need, limit in (("cpu", req.cpu, q.cpu), ("memory", req.memory, q.memory)):
            if need > limit:
                raise QuotaExceeded(
                    f"tenant {req.tenant!r}: request {req.request_id!r} asks for {what}={need}, above the "
                    f"tenant's {what} quota {limit}; ask for less or have the quota raised",
                    quota=what, limit=limit, requested=need)
        if q.max_sandboxes <= 0:
            raise QuotaExceeded(f"tenant {req.tenant!r} has a max_sandboxes quota of 0; have it raised",
                                quota="max_sandboxes", limit=0)
        if t.queued >= self.max_queued:
            raise QuotaExceeded(
                f"tenant {req.tenant!r} already has {t.queued} queued requests (tenant_max_queued="
                f"{self.max_queued}); wait for some to start", quota="max_queued", limit=self.max_queued)

    def push(self, req: Request, front: bool = False) -> None:
        t = self.tenants.get(req.tenant) or self.tenant(req.tenant)
        q = t.queues[req.priority]
        if front:
            q.appendleft(req)
        else:
            q.append(req)
        self._len += 1
        self._class_len[req.priority] += 1

    def remove(self, req: Request) -> bool:
        try:
            self.tenant(req.tenant).queues[req.priority].remove(req)
        except ValueError:
            return False
        self._len -= 1
        self._class_len[req.priority] -= 1
        return True

    def _share(self, t: TenantState) -> float:
        return max(t.cpu / self.total_cpu, t.memory / self.total_memory) / t.quota.weight

    def pop_next(self, now: float, skip: set[tuple[str, int]] | None = None) -> Request | None:
        """Pop the next request to place, or None (empty, or everything blocked/skipped)."""
        if not self._len:
            return None
        aging = self.aging
        best_key: tuple[float, float, float] | None = None
        best: tuple[TenantState, int] | None = None
        for t in self.tenants.values():
            qs = t.queues
            if not (qs[0] or qs[1] or qs[2]):
                continue  # most tenants have nothing queued at any moment
            share = -1.0
            for cls in (0, 1, 2):
                q = qs[cls]
                if not q:
                    continue
                head = q[0]
                if (skip and (t.name, cls) in skip) or head.not_before > now:
                    continue
                if not t.admits(head):
                    continue
                eff = cls - int((now - head.submitted_at) / aging) if aging > 0 else cls
                eff = max(eff, 0)
                if share < 0:
                    share = self._share(t)
                key = (eff, share, head.submitted_at)
                if best_key is None or key < best_key:
                    best_key, best = key, (t, cls)
        if best is None:
            return None
        t, cls = best
        self._len -= 1
        self._class_len[cls] -= 1
        return t.queues[cls].popleft()

    def charge(self, tenant: str, cpu: float, memory: int, sign: int) -> None:
        t = self.tenants.get(tenant) or self.tenant(tenant)
        t.count += sign
        t.cpu += sign * cpu
        t.memory += sign * memory

    def position(self, req: Request, own: int | None = None) -> int:
        """Estimated number of requests placed before ``req`` (0 = next).

        ``own``: its index in its tenant's class queue when the caller knows it (just pushed).
        """
        t = self.tenants.get(req.tenant)
        if t is None:
            return 0
        if own is None:
            try:
                own = t.queues[req.priority].index(req)
            except ValueError:
                return 0
        ahead = sum(self._class_len[: req.priority])
        p = req.priority
        sharing = sum(1 for o in self.tenants.values() if o.queues[p]) or 1
        return ahead + own * sharing

    def describe(self) -> dict[str, dict[str, int]]:
        return {n: {PRIORITY_NAMES[c]: len(t.queues[c]) for c in range(3)} for n, t in self.tenants.items()}
