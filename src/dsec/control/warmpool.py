"""Warm pools per shape: how many members to keep, which to expire. Pure.

Demand signal: acquisitions (requests of a shape, hit or miss) per bucket of
``warm_pool_refill_s`` -- the time a taken member needs to be rebuilt. The peak bucket
over ``warm_pool_window_s`` is the peak number of members wanted at once before
replacements arrive (Little's law: concurrency = rate x rebuild time), and the target is
that peak x ``warm_pool_factor`` (rounded, at least 1). One tenant's demand counts at most
``warm_pool_max_per_tenant`` per bucket, the cluster keeps at most ``warm_pool_max_total``
members, and placement keeps at most ``warm_pool_max_per_node`` per node.

Members expire when idle longer than ``warm_pool_max_idle_s`` or when their image's
version changed; members beyond ``warm_pool_trim_factor`` x target are trimmed; expired or surplus members are destroyed and (if still wanted)
rebuilt by the next plan. A member's TTL starts when it is handed to a user.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dsec.config import Settings
from dsec.control.types import Running, Shape


class _Demand:
    """Sliding-window maximum of per-bucket acquisition counts (monotonic deque, O(1))."""

    __slots__ = ("bucket", "count", "maxq", "per_tenant")

    def __init__(self, bucket: int) -> None:
        self.bucket = bucket
        self.count = 0
        self.per_tenant: dict[str, int] = {}
        self.maxq: deque[tuple[int, int]] = deque()  # (bucket, count), counts decreasing

    def close(self) -> None:
        c = self.count
        while self.maxq and self.maxq[-1][1] <= c:
            self.maxq.pop()
        self.maxq.append((self.bucket, c))

    def peak(self, bucket: int, nbuckets: int) -> int:
        while self.maxq and self.maxq[0][0] <= bucket - nbuckets:
            self.maxq.popleft()
        closed = self.maxq[0][1] if self.maxq else 0
        return max(closed, self.count if self.bucket > bucket - nbuckets else 0)


class PoolDemand:
    def __init__(self, s: Settings) -> None:
        if s.warm_pool_refill_s <= 0 or s.warm_pool_window_s < s.warm_pool_refill_s:
            raise ValueError("need 0 < warm_pool_refill_s <= warm_pool_window_s")
        self.bucket_s = s.warm_pool_refill_s
        self.nbuckets = max(1, round(s.warm_pool_window_s / s.warm_pool_refill_s))
        self.per_tenant_cap = s.warm_pool_max_per_tenant
        self.factor = s.warm_pool_factor
        self.max_total = s.warm_pool_max_total
        self.shapes: dict[Shape, _Demand] = {}
        # Operator-declared minimum sizes (a known rollout shape kept warm before demand).
        self.floors: dict[Shape, int] = {}

    def set_floor(self, shape: Shape, size: int) -> None:
        if size <= 0:
            self.floors.pop(shape, None)
        else:
            self.floors[shape] = size

    def observe(self, now: float, shape: Shape, tenant: str) -> None:
        b = int(now // self.bucket_s)
        d = self.shapes.get(shape)
        if d is None:
            d = self.shapes[shape] = _Demand(b)
        elif d.bucket != b:
            d.close()
            d.bucket, d.count = b, 0
            d.per_tenant.clear()
        n = d.per_tenant.get(tenant, 0)
        if n < self.per_tenant_cap:
            d.per_tenant[tenant] = n + 1
            d.count += 1

    def _size(self, peak: int) -> int:
        # Rounded, not ceiled: a shape seen once per bucket gets 1 member, not 2 (the tail of
        # a Zipf image mix is hundreds of such shapes, each a rebuild per window). A factor
        # of 0 turns demand-driven pools off (declared floors still apply).
        return max(1, round(peak * self.factor)) if peak and self.factor > 0 else 0

    def target(self, now: float, shape: Shape) -> int:
        """Current target of one shape (O(1)); used between full plans."""
        floor = self.floors.get(shape, 0)
        d = self.shapes.get(shape)
        if d is None:
            return floor
        b = int(now // self.bucket_s)
        if d.bucket != b:
            d.close()
            d.bucket, d.count = b, 0
            d.per_tenant.clear()
        return max(floor, self._size(d.peak(b, self.nbuckets)))

    def targets(self, now: float) -> dict[Shape, int]:
        """Pool size per shape; shapes with no demand in the window get 0 and are forgotten."""
        b = int(now // self.bucket_s)
        out: dict[Shape, int] = {}
        for shape, d in list(self.shapes.items()):
            if d.bucket != b and d.bucket > b - self.nbuckets:
                d.close()
                d.bucket, d.count = b, 0
                d.per_tenant.clear()
            p = d.peak(b, self.nbuckets)
            if p == 0:
                del self.shapes[shape]
                continue
            out[shape] = self._size(p)
        total = sum(out.values())
        if total > self.max_total:
            scale = self.max_total / total
            out = {k: int(v * scale) for k, v in out.items()}
        for shape, floor in self.floors.items():
            out[shape] = max(out.get(shape, 0), floor)
        return out


@dataclass(slots=True)
class Member:
    """What the plan needs of a pool member (``Running`` has the same attributes)."""

    sandbox_id: str
    node_id: str
    shape: Shape
    started_at: float
    image_version: str


@dataclass(slots=True)
class PoolPlan:
    create: dict[Shape, int] = field(default_factory=dict)
    destroy: list[tuple[str, str]] = field(default_factory=list)  # (sandbox_id, reason)


def plan_pools(now: float, targets: dict[Shape, int], members: Mapping[Shape, Sequence[Member | Running]],
               inflight: dict[Shape, int], versions: dict[str, str], s: Settings) -> PoolPlan:
    """Given demand targets and current members, what to create and destroy per shape."""
    plan = PoolPlan()
    # Targets' order, then members' (dicts): never set order, which follows string hashes.
    for shape in list(targets) + [sh for sh in members if sh not in targets]:
        want = targets.get(shape, 0)
        keep: list[Member | Running] = []
        for m in members.get(shape, ()):
            if versions.get(shape[0], m.image_version) != m.image_version:
                plan.destroy.append((m.sandbox_id, "image_changed"))
            elif now - m.started_at > s.warm_pool_max_idle_s:
                plan.destroy.append((m.sandbox_id, "idle_expired"))
            else:
                keep.append(m)
        have = len(keep) + inflight.get(shape, 0)
        # Hysteresis: a target that dips for a moment must not destroy members that the
        # next peak rebuilds (pull + start for nothing); trim only well above target.
        surplus = have - math.floor(want * s.warm_pool_trim_factor) if have > want else have - want
        if surplus > 0:
            keep.sort(key=lambda m: m.started_at)
            for m in keep[:surplus]:
                plan.destroy.append((m.sandbox_id, "surplus"))
        elif surplus < 0:
            plan.create[shape] = -surplus
    return plan
