"""Warm-pool bookkeeping inside the scheduler (the sizing policy is ``warmpool``).

Pool members are ordinary sandboxes owned by the pseudo-tenant ``__pool__``: placed by
the same policy, holding their allocation on their node, and counted per node (at most
``warm_pool_max_per_node``). A request of a member's shape takes one (a warm hit): the
member changes owner and its TTL starts at that moment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsec.config import Settings
from dsec.control.types import LOW, Node, Placement, Request, Running, Shape
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
            # A ready member that vanished (its node lost or drained, or it died): rebuild
            # at the next batch on a healthy node, not at the next full plan (30 s away), so
            # the pool target stays met cluster-wide. A surplus destroy leaves no gap.
            self.dirty[r.shape] = None  # type: ignore[index]

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
                req = self._new_request(shape, now)
                choice = sched.policy.choose(req, image, sched.cluster, sched.rng)
                if choice is None and self._below_floor(shape):
                    # An operator's floor beats demand guesses: make room by dropping a
                    # demand-driven member of another shape (recycled members fill a pool
                    # to its demand target at once and may hold the whole node).
                    victim = self._surplus_member(shape)
                    if victim is not None:
                        sched.on_released(victim.sandbox_id, now)
                        out.append(Placement("destroy", victim.node_id, sandbox_id=victim.sandbox_id,
                                             shape=victim.shape))
                        self.destroyed["floor"] = self.destroyed.get("floor", 0) + 1
                        choice = sched.policy.choose(req, image, sched.cluster, sched.rng)
                if choice is None or choice[0].warm_count + choice[0].inflight >= cap:
                    if choice is None and self._below_floor(shape):
                        self.dirty[shape] = None  # retry at the next batch, not at the next full plan
                    break
                node, miss = choice
                self._start_member(req, node)
                out.append(Placement("pool", node.node_id, req, shape=shape, missing_bytes=miss))
        return out

    def _below_floor(self, shape: Shape) -> bool:
        return len(self.free.get(shape, ())) + self.inflight.get(shape, 0) < self.demand.floors.get(shape, 0)

    def _surplus_member(self, shape: Shape) -> Running | None:
        """The oldest free member of another shape held above that shape's own floor."""
        best: Running | None = None
        for other, lst in self.free.items():
            if other == shape or len(lst) <= self.demand.floors.get(other, 0):
                continue
            for r in lst:
                if best is None or r.started_at < best.started_at:
                    best = r
        return best

    def _new_request(self, shape: Shape, now: float) -> Request:
        self._seq += 1
        return Request(f"pool-{self._seq}", self.TENANT, shape[0], shape[2], shape[3], shape[4], LOW,
                       shape[1], None, shape[5], 0.0, submitted_at=now, cpu_limit=shape[6],
                       memory_limit=shape[7], disk_limit=shape[8])

    def _start_member(self, req: Request, node: Node) -> None:
        """Account a member being made on ``node`` (completed by on_created / on_failed)."""
        sched = self.sched
        sched._alloc(node, req.cpu, req.memory, req.disk, None, 1)
        node.inflight += 1
        node.batch_load += 1
        sched._touched.append(node)
        sched.placed[req.request_id] = (req, node.node_id)
        self.inflight[req.shape] = self.inflight.get(req.shape, 0) + 1

    def may_recycle(self, r: Running, now: float) -> bool:
        """A user released ``r``: should the same sandbox become a member of its shape's pool
        (reset in place by the node under a new id) instead of being destroyed while a cold
        create refills the pool? Only members it handed out go back (so recycling never
        grows a pool past what its builder made, e.g. after a burst of cold creates), and
        only the container tier without a network slot."""
        shape = r.shape
        if shape is None or r.pool or not r.from_pool or r.gpu is not None or shape[1] != "container" or shape[5]:
            return False
        node = self.sched.cluster.nodes.get(r.node_id)
        image = self.sched.images.get(shape[0])
        if node is None or not node.healthy or image is None or image.version != r.image_version:
            return False
        return wants_member(self.demand.target(now, shape), len(self.free.get(shape, ())),
                            self.inflight.get(shape, 0), node.warm_count + node.inflight,
                            self.s.warm_pool_max_per_node)

    def start_recycled(self, r: Running, now: float) -> Request:
        """Account released ``r`` as a member being made on its node; returns its pool request."""
        assert r.shape is not None
        req = self._new_request(r.shape, now)
        self._start_member(req, self.sched.cluster.nodes[r.node_id])
        return req


def wants_member(target: int, ready: int, making: int, on_node: int, node_cap: int) -> bool:
    """Does a pool (``ready`` + ``making`` members of ``target``) take one more on a node
    holding ``on_node`` members and creations (at most ``node_cap``)?"""
    return ready + making < target and on_node < node_cap
