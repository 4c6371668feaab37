"""Warm-pool bookkeeping inside the scheduler (the sizing policy is ``warmpool``).

Pool members are ordinary sandboxes owned by the pseudo-tenant ``__pool__``: placed by
the same policy, holding their allocation on their node, and counted per node (at most
``warm_pool_max_per_node``). A request of a member's shape takes one (a warm hit): the
member changes owner and its TTL starts at that moment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsec.config import Settings
from dsec.control.types import LOW, Placement, Request, Running, Shape
from dsec.control.warmpool import PoolDemand, plan_pools

if TYPE_CHECKING:
    from dsec.control.scheduler import Scheduler


class PoolBook:
    TENANT = "__pool__"

    def __init__(self, s: Settings, sched: Scheduler) -> None:
        self.s = s
        self.sched = sched
        self.demand = PoolDemand(s)
        self.free: dict[Shape, list[Running]] = {}
        self.inflight: dict[Shape, int] = {}
        self.targets: dict[Shape, int] = {}
        # Insertion-ordered (a dict, not a set): shapes are replenished in a seed-determined
        # order, never in string-hash order (PYTHONHASHSEED would change the decisions).
        self.dirty: dict[Shape, None] = {}
        self.next_plan = 0.0
        self._seq = 0
        self.destroyed: dict[str, int] = {}
        self.misses = {"cold": 0, "empty": 0}  # shape had no target yet / pool ran dry

    def size(self) -> int:
        return sum(len(v) for v in self.free.values())

    def take(self, req: Request) -> Running | None:
        shape = req.shape
        lst = self.free.get(shape)
        if not lst:
            self.dirty[shape] = None
            self.misses["empty" if self.targets.get(shape) else "cold"] += 1
            return None
        nodes = self.sched.cluster.nodes
        excluded, selector = req.excluded, req.selector
        for i in range(len(lst) - 1, -1, -1):
            r = lst[i]
            node = nodes[r.node_id]
            if not node.healthy or (excluded and r.node_id in excluded):
                continue
            if selector and any(node.labels.get(k) != v for k, v in selector.items()):
                continue
            if i == len(lst) - 1:
                lst.pop()
            else:
                lst.pop(i)
            node.warm_count -= 1
            self.dirty[shape] = None
            return r
        return None

    def member_ready(self, r: Running, now: float) -> None:
        shape = r.shape
        assert shape is not None
        self.inflight[shape] = self.inflight.get(shape, 1) - 1
        self.free.setdefault(shape, []).append(r)
        self.sched.cluster.nodes[r.node_id].warm_count += 1

    def member_failed(self, req: Request) -> None:
        self.inflight[req.shape] = self.inflight.get(req.shape, 1) - 1

    def member_gone(self, r: Running) -> None:
        lst = self.free.get(r.shape)  # type: ignore[arg-type]
        if lst is not None:
            try:
                lst.remove(r)
            except ValueError:
                return
            node = self.sched.cluster.nodes.get(r.node_id)
            if node is not None:
                node.warm_count -= 1

    def replenish(self, now: float) -> list[Placement]:
        """Pool creations (and expiries) due now; called at the end of every batch."""
        out: list[Placement] = []
        sched = self.sched
        if now >= self.next_plan:
            self.next_plan = now + self.s.warm_pool_plan_interval_s
            self.targets = self.demand.targets(now)
            versions = {name: img.version for name, img in sched.images.items()}
            plan = plan_pools(now, self.targets, self.free, self.inflight, versions, self.s)
            for sid, why in plan.destroy:
                r = sched.running.get(sid)
                if r is not None:
                    sched.on_released(sid, now)
                    out.append(Placement("destroy", r.node_id, sandbox_id=sid, shape=r.shape))
                    self.destroyed[why] = self.destroyed.get(why, 0) + 1
            todo = plan.create
        else:
            todo = {}
            for shape in self.dirty:
                # Between full plans a shape's target is refreshed in O(1) so bursts grow it now.
                self.targets[shape] = tgt = self.demand.target(now, shape)
                gap = tgt - len(self.free.get(shape, ())) - self.inflight.get(shape, 0)
                if gap > 0:
                    todo[shape] = gap
        self.dirty.clear()
        if not todo:
            return out
        # Requests that could not be placed this batch come first: no new members then.
        if len(sched.queues):
            return out
        cap = self.s.warm_pool_max_per_node
        for shape, n in todo.items():
            image = sched.images.get(shape[0])
            if image is None:
                continue
            for _ in range(n):
                self._seq += 1
                req = Request(f"pool-{self._seq}", self.TENANT, shape[0], shape[2], shape[3], shape[4], LOW,
                              shape[1], None, shape[5], 0.0, submitted_at=now, cpu_limit=shape[6],
                              memory_limit=shape[7], disk_limit=shape[8])
                choice = sched.policy.choose(req, image, sched.cluster, sched.rng)
                if choice is None or choice[0].warm_count + choice[0].inflight >= cap:
                    break
                node, miss = choice
                sched._alloc(node, req.cpu, req.memory, req.disk, None, 1)
                node.inflight += 1
                node.batch_load += 1
                sched._touched.append(node)
                sched.placed[req.request_id] = (req, node.node_id)
                self.inflight[shape] = self.inflight.get(shape, 0) + 1
                out.append(Placement("pool", node.node_id, req, shape=shape, missing_bytes=miss))
        return out
