"""The scheduler facade: one object, no I/O, driven by the server's driver or the simulator.

Flow: ``submit`` validates and queues (or raises), ``next_batch(now)`` returns placements
for everything placeable, the driver executes them and reports back with
``on_created`` / ``on_failed`` / ``on_released``; node facts arrive via ``upsert_node``,
``layers_changed``, ``usage_sample``, ``node_lost``. Time is always passed in (``now``),
never read, so the simulator and tests control it.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict

from dsec.config import Settings
from dsec.control.backpressure import Backpressure, retry_after_s
from dsec.control.leases import Lease, LeasedSandbox, ReapDecision, reap_by_labels, reap_decisions
from dsec.control.overcommit import UsageWindow, could_ever_fit
from dsec.control.placement import ClusterView, Policy, make_policy
from dsec.control.pools import PoolBook
from dsec.control.preemption import select_victims
from dsec.control.retry import RetryBudget, should_retry
from dsec.control.rightsize import RightSizer
from dsec.control.tenants import Quota, TenantQueues
from dsec.control.types import HIGH, LOW, MEDIUM, Image, Node, Placement, Request, Running, Shape, Ticket
from dsec.errors import InvalidArgument, NotFound, Overloaded

KNOWN_TIERS = frozenset({"container", "gvisor"})


class Scheduler:
    def __init__(self, settings: Settings | None = None, policy: str | Policy = "ours", seed: int = 0,
                 pools: bool = True) -> None:
        self.s = s = settings or Settings()
        self.cluster = ClusterView()
        # The driver turns this off when it cannot checkpoint victims (no silent data loss).
        self.preemption = s.preemption_enabled
        self.queues = TenantQueues(s)
        self.bp = Backpressure(s)
        self.policy: Policy = make_policy(policy, s) if isinstance(policy, str) else policy
        self.rng = random.Random(seed)
        self.images: dict[str, Image] = {}
        self.tickets: OrderedDict[str, Ticket] = OrderedDict()
        self._finished_at: dict[str, float] = {}
        self.pending: dict[str, Request] = {}  # queued or delayed, by request id
        self.placed: dict[str, tuple[Request, str]] = {}  # awaiting on_created: (request, node)
        self.running: dict[str, Running] = {}
        self.residents: dict[str, dict[str, Running]] = {}  # node -> sandbox -> Running
        self.delayed: list[tuple[float, int, Request]] = []
        self.usage: dict[str, UsageWindow] = {}
        self.leases: dict[str, Lease] = {}
        self.rightsizer = RightSizer(s)
        self.budget = RetryBudget(s)
        self.pools = PoolBook(s, self) if pools else None
        self.drain_rate = 0.0
        self._seq = 0
        self._fit_cache: dict[tuple, bool] = {}
        self._cpu_sum: float = 0
        self._mem_sum = 0
        self._touched: list[Node] = []
        self._no_victims: dict[tuple[int, str, str | None], tuple[float, int, int]] = {}
        self.stats = {k: 0 for k in ("submitted", "placements", "warm_hits", "warm_misses", "retries",
                                     "failed", "preemptions", "evictions", "rejected_overload",
                                     "rejected_quota", "rejected_invalid", "abnormal", "duplicates", "recycled")}

    # ------------------------------------------------------------------ nodes, images
    def upsert_node(self, node_id: str, cpu: float, memory: int, disk: int, *, max_sandboxes: int | None = None,
                    isolation: tuple[str, ...] | frozenset[str] = ("container",),
                    gpus: dict[str, int] | None = None, labels: dict[str, str] | None = None,
                    layers: set[str] | None = None) -> Node:
        if cpu <= 0 or memory <= 0 or disk <= 0:
            raise InvalidArgument(f"node {node_id!r}: cpu, memory and disk must be > 0")
        node = self.cluster.nodes.get(node_id)
        added = node is None
        if node is None:
            node = Node(node_id, cpu, memory, disk, max_sandboxes or self.s.node_max_sandboxes,
                        frozenset(isolation), dict(gpus or {}), dict(labels or {}))
            self.cluster.add_node(node)
            self.residents[node_id] = {}
            self.usage[node_id] = UsageWindow.from_settings(self.s)
        else:
            node.cpu, node.memory, node.disk = cpu, memory, disk
            node.max_sandboxes = max_sandboxes or node.max_sandboxes
            node.isolation, node.gpus = frozenset(isolation), dict(gpus or {})
            node.labels = dict(labels or {})
        if layers:
            self.cluster.add_layers(node, layers)
        self._cluster_changed(node if added else None)
        return node

    def _cluster_changed(self, appended: Node | None = None) -> None:
        self._fit_cache.clear()
        if appended is not None:
            # One node appended: extend the running sums (the same left-to-right additions
            # as a full sum) instead of re-summing every node, O(n^2) over a 10k-node start.
            self._cpu_sum += appended.cpu
            self._mem_sum += appended.memory
        else:
            self._cpu_sum = sum(n.cpu for n in self.cluster.node_list)
            self._mem_sum = sum(n.memory for n in self.cluster.node_list)
        self.queues.total_cpu = self._cpu_sum or 1.0
        self.queues.total_memory = self._mem_sum or 1

    def set_node_health(self, node_id: str, healthy: bool) -> None:
        self._node(node_id).healthy = healthy

    def _node(self, node_id: str) -> Node:
        node = self.cluster.nodes.get(node_id)
        if node is None:
            raise NotFound(f"node {node_id!r} is not registered with the scheduler; upsert_node it first")
        return node

    def layers_changed(self, node_id: str, added: tuple[str, ...] | list[str] = (),
                       removed: tuple[str, ...] | list[str] = ()) -> None:
        node = self._node(node_id)
        self.cluster.add_layers(node, added)
        self.cluster.remove_layers(node, removed)

    def usage_sample(self, node_id: str, now: float, frac: float) -> None:
        """Feed one usage sample (fraction of the node's CPU really in use)."""
        w = self.usage[node_id]
        w.add(now, frac)
        self.cluster.nodes[node_id].predicted = w.predicted()

    def node_lost(self, node_id: str, now: float) -> list[Running]:
        """A node died: mark it unhealthy, retry its pending creations, forget its sandboxes."""
        node = self._node(node_id)
        node.healthy = False
        for rid, (req, nid) in list(self.placed.items()):
            if nid == node_id:
                self.on_failed(rid, now, f"node {node_id} lost", retriable=True)
        lost = list(self.residents[node_id].values())
        for r in lost:
            self.on_released(r.sandbox_id, now)
        return [r for r in lost if not r.pool]

    def register_image(self, name: str, layers: list[tuple[str, int]] | tuple[tuple[str, int], ...],
                       version: str = "") -> Image:
        if not layers:
            raise InvalidArgument(f"image {name!r} has no layers; import or build it first")
        img = self.images[name] = Image(name, tuple(layers), version)
        return img

    def set_quota(self, tenant: str, quota: Quota) -> None:
        self.queues.set_quota(tenant, quota)

    # ------------------------------------------------------------------ requests
    def _validate(self, req: Request) -> None:
        if req.image not in self.images:
            raise InvalidArgument(f"request {req.request_id!r}: unknown image {req.image!r}; import it first")
        if req.isolation not in KNOWN_TIERS:
            raise InvalidArgument(f"request {req.request_id!r}: unknown isolation tier {req.isolation!r}; "
                                  f"use one of {sorted(KNOWN_TIERS)}")
        if req.cpu <= 0 or req.memory <= 0 or req.disk <= 0:
            raise InvalidArgument(f"request {req.request_id!r}: cpu, memory and disk must be > 0")
        sel = req.selector
        key = (req.isolation, req.gpu, req.cpu, req.memory, req.disk, tuple(sorted(sel.items())) if sel else ())
        ok = self._fit_cache.get(key)
        if ok is None:
            ok = self._fit_cache[key] = any(could_ever_fit(n, req, self.s.overcommit_ratio)
                                            for n in self.cluster.node_list)
        if not ok:
            nl = self.cluster.node_list
            gpus = sorted({g for n in nl for g in n.gpus})
            if req.gpu is not None and req.gpu not in gpus:
                why = f"GPU type {req.gpu!r} exists on no node (known: {gpus or 'none'})"
            elif not any(req.isolation in n.isolation for n in nl):
                why = f"no node offers isolation {req.isolation!r}"
            else:
                big = max(nl, key=lambda n: n.cpu, default=None)
                why = (f"no node can ever hold cpu={req.cpu} memory={req.memory} disk={req.disk}"
                       + (f" (largest node: cpu={big.cpu} memory={big.memory} disk={big.disk})" if big else
                          " (no nodes registered)"))
            raise InvalidArgument(f"request {req.request_id!r}: {why}; ask for less or add such nodes")

    def submit(self, req: Request, now: float) -> Ticket:
        """Queue ``req``; idempotent by request id. Raises InvalidArgument/QuotaExceeded/Overloaded."""
        t = self.tickets.get(req.request_id)
        if t is not None:
            self.stats["duplicates"] += 1
            return self.ticket(req.request_id)
        try:
            self._validate(req)
        except InvalidArgument:
            self.stats["rejected_invalid"] += 1
            raise
        if req.task_type is not None:
            asked = (req.cpu, req.memory)
            req.cpu, req.memory, req.abnormal = self.rightsizer.adjust(req.task_type, req.cpu, req.memory)
            if (req.cpu, req.memory) != asked:
                req.asked = asked
            self.stats["abnormal"] += req.abnormal
        try:
            self.queues.check_quota(req)
        except Exception:
            self.stats["rejected_quota"] += 1
            raise
        depth = self.depth()
        active = self.bp.update(depth)
        if depth >= self.s.queue_capacity or (active and req.priority != HIGH):
            self.stats["rejected_overload"] += 1
            ra = retry_after_s(depth, self.s, self.drain_rate)
            raise Overloaded(f"scheduler queue is at {depth}/{self.s.queue_capacity}; retry request "
                             f"{req.request_id!r} after {ra}s", retry_after=ra, queue_depth=depth)
        req.submitted_at = now
        if req.owner is not None and req.owner not in self.leases:
            self.heartbeat(req.owner, now)  # the lease starts with the first request
        self.queues.push(req)
        self.pending[req.request_id] = req
        self.tickets[req.request_id] = Ticket(req.request_id, "queued")
        self.budget.first_attempt()
        self.stats["submitted"] += 1
        if self.pools is not None:
            self.pools.demand.observe(now, req.shape, req.tenant)
        t = self.tickets[req.request_id]
        t.position = self.queues.position(req, own=len(self.queues.tenants[req.tenant].queues[req.priority]) - 1)
        t.eta_s = (t.position + 1) / self.drain_rate if self.drain_rate > 0 else 0.0
        return t

    def take_warm_now(self, request_id: str, now: float) -> Placement | None:
        """Hand a queued request a warm member at once, skipping the batch window: the
        common path must not wait 50 ms for a decision that is a list pop. Only when the
        members left still cover the queued requests of the same shape (they came first)
        and the queue is small (a burst goes through batching and fair share as usual)."""
        req = self.pending.get(request_id)
        if req is None or self.pools is None or req.cold or len(self.pending) > self.s.warm_fast_path_max_queue:
            return None
        shape = req.shape
        # Other requests of the shape queued came first, or the batch orders them (priority,
        # fair share): go ahead only while enough members remain for every one of them (the
        # next batch hands those out). Without
        # this, one request that found the pool empty for a moment held every later one
        # of its shape back to the next batch (an RL loop's creates, issue 15).
        ahead = sum(1 for rid, r in self.pending.items() if rid != request_id and r.shape == shape)
        if len(self.pools.free.get(shape, ())) <= ahead:
            return None
        taken = self.pools.take(req)
        if taken is None or not self.queues.remove(req):
            if taken is not None:
                self.pools.free.setdefault(shape, []).append(taken)
                self.cluster.nodes[taken.node_id].warm_count += 1
            return None
        self.stats["warm_hits"] += 1
        return self._commit_warm(req, taken, now)

    def first_waiting(self, shape: Shape) -> str | None:
        """The earliest queued request of ``shape`` a warm member may serve (or None)."""
        for rid, r in self.pending.items():
            if r.shape == shape and not r.cold:
                return rid
        return None

    def depth(self) -> int:
        return len(self.queues) + len(self.delayed)

    def ticket(self, request_id: str) -> Ticket:
        t = self.tickets.get(request_id)
        if t is None:
            raise NotFound(f"request {request_id!r} is unknown (never submitted, or forgotten after "
                           f"{self.s.idempotency_ttl_s}s)")
        if t.state == "queued":
            req = self.pending.get(request_id)
            t.position = self.queues.position(req) if req is not None else 0
            t.eta_s = (t.position + 1) / self.drain_rate if self.drain_rate > 0 else 0.0
        return t

    def cancel(self, request_id: str) -> bool:
        """Withdraw a request still waiting (queued, or delayed before a retry). Its id is
        forgotten, so the client may submit it again later; False once it was placed."""
        req = self.pending.get(request_id)
        if req is None:
            return False
        if not self.queues.remove(req):
            at = next((i for i, (_, _, r) in enumerate(self.delayed) if r is req), None)
            if at is None:
                return False
            self.delayed.pop(at)
            heapq.heapify(self.delayed)
        del self.pending[request_id]
        self.forget(request_id)
        self.stats["cancelled"] = self.stats.get("cancelled", 0) + 1
        return True

    def set_pool_floor(self, req: Request, size: int) -> None:
        """Keep at least ``size`` warm members of ``req``'s shape (0 removes the floor)."""
        if self.pools is None:
            raise InvalidArgument("warm pools are disabled on this scheduler")
        self._validate(req)
        self.pools.demand.set_floor(req.shape, size)
        self.pools.dirty[req.shape] = None

    def forget(self, request_id: str) -> None:
        """Drop a request id's ticket so the id may be submitted afresh."""
        self.tickets.pop(request_id, None)
        self._finished_at.pop(request_id, None)

    def parallel_limit(self) -> int:
        """Creations one node may run at once (raised while backpressure is on)."""
        lim = self.s.node_parallel_creates
        return int(lim * self.s.backpressure_parallel_boost) if self.bp.active else lim

    # ------------------------------------------------------------------ placement
    def next_batch(self, now: float) -> list[Placement]:
        """Place everything placeable now. Call once per ``batch_window_s``."""
        for node in self._touched:
            node.batch_load = 0
        self._touched = []
        self._no_victims.clear()
        while self.delayed and self.delayed[0][0] <= now:
            _, _, req = heapq.heappop(self.delayed)
            self.queues.push(req, front=True)
        self.bp.update(self.depth())
        out: list[Placement] = []
        skip: set[tuple[str, int]] = set()
        limit_skips = 3 * max(1, len(self.queues.tenants))
        while True:
            req = self.queues.pop_next(now, skip)
            if req is None:
                break
            p = self._place(req, now)
            if p is None:
                self.queues.push(req, front=True)
                skip.add((req.tenant, req.priority))
                if len(skip) >= limit_skips:
                    break
                continue
            out.append(p)
        if out:
            self.drain_rate = 0.9 * self.drain_rate + 0.1 * (len(out) / self.s.batch_window_s)
        if self.pools is not None:
            out.extend(self.pools.replenish(now))
        self._prune_tickets(now)
        return out

    def _place(self, req: Request, now: float) -> Placement | None:
        image = self.images[req.image]
        pools = self.pools
        if pools is not None and not req.cold:
            taken = pools.take(req)
            if taken is not None:
                self.stats["warm_hits"] += 1
                return self._commit_warm(req, taken, now)
            self.stats["warm_misses"] += 1
        choice = self.policy.choose(req, image, self.cluster, self.rng)
        if choice is None and req.excluded:
            # Retry elsewhere when possible; with no other node (a 1-node server) the same
            # node is better than waiting forever.
            req.excluded.clear()
            choice = self.policy.choose(req, image, self.cluster, self.rng)
        evict: list[Running] = []
        if choice is None:
            # No room anywhere: make room. A request at least as large as one that already
            # found no victims this batch (same class, tier, GPU) cannot find any either.
            key = (req.priority, req.isolation, req.gpu)
            failed = self._no_victims.get(key)
            if failed is not None and all(a >= b for a, b in zip((req.cpu, req.memory, req.disk), failed)):
                return None
            nl = self.cluster.node_list
            cands = nl if len(nl) <= 4 * self.s.sparrow_min_nodes else self.rng.sample(nl, self.s.sparrow_min_nodes)
            allow = self.preemption and req.priority < LOW
            pick = select_victims(req, cands, self.residents, self.s.overcommit_ratio,
                                  self.s.overcommit_threshold, allow)
            if pick is None:
                self._no_victims[key] = (req.cpu, req.memory, req.disk)
                return None
            node, evict = pick
            choice = (node, sum(sz for d, sz in image.layers if d not in node.layers))
        node, miss = choice
        p = Placement("create", node.node_id, req, missing_bytes=miss)
        for r in evict:
            (p.evict if r.pool else p.preempt).append(r.sandbox_id)
            self.stats["evictions" if r.pool else "preemptions"] += 1
            self._preempted(r, now)
        self._alloc(node, req.cpu, req.memory, req.disk, req.gpu, 1)
        node.inflight += 1
        node.batch_load += 1
        self._touched.append(node)
        self.queues.charge(req.tenant, req.cpu, req.memory, 1)
        self.pending.pop(req.request_id, None)
        self.placed[req.request_id] = (req, node.node_id)
        t = self.tickets[req.request_id]
        t.state, t.node_id, t.position, t.eta_s = "placed", node.node_id, 0, 0.0
        self.stats["placements"] += 1
        return p

    def _commit_warm(self, req: Request, r: Running, now: float) -> Placement:
        # The member already holds its allocation on the node; it changes owner, and its
        # TTL starts now, at hand-over.
        r.pool, r.tenant, r.priority, r.request_id, r.request = False, req.tenant, req.priority, req.request_id, req
        r.owner, r.labels, r.task_type, r.expires_at = req.owner, req.labels, req.task_type, now + req.ttl
        r.from_pool = True
        self.queues.charge(req.tenant, req.cpu, req.memory, 1)
        self.pending.pop(req.request_id, None)
        self._finish(req.request_id, "created", sandbox_id=r.sandbox_id, node_id=r.node_id, now=now)
        self.stats["placements"] += 1
        return Placement("warm", r.node_id, req, sandbox_id=r.sandbox_id, shape=r.shape)

    def _alloc(self, node: Node, cpu: float, mem: int, disk: int, gpu: str | None, sign: int) -> None:
        node.used_cpu += sign * cpu
        node.used_memory += sign * mem
        node.used_disk += sign * disk
        node.count += sign
        if gpu is not None:
            node.gpu_used[gpu] = node.gpu_used.get(gpu, 0) + sign

    def _preempted(self, r: Running, now: float) -> None:
        """Account a victim as gone now; a running victim's request is re-queued to resume."""
        self.on_released(r.sandbox_id, now)
        if not r.pool and r.request is not None:
            old = r.request
            self._seq += 1
            new = Request(f"{old.request_id}~resume{self._seq}", old.tenant, old.image, old.cpu, old.memory,
                          old.disk, old.priority, old.isolation, old.gpu, old.network, old.ttl, old.labels,
                          old.selector, old.task_type, old.owner, submitted_at=now, resume_of=r.sandbox_id,
                          payload=old.payload, cpu_limit=old.cpu_limit, memory_limit=old.memory_limit,
                          disk_limit=old.disk_limit)
            self.queues.push(new)
            self.pending[new.request_id] = new
            self.tickets[new.request_id] = Ticket(new.request_id, "queued")

    # ------------------------------------------------------------------ driver feedback
    def on_created(self, request_id: str, sandbox_id: str, now: float) -> Running:
        got = self.placed.pop(request_id, None)
        if got is None:
            r = next((x for x in self.running.values() if x.request_id == request_id), None)
            if r is not None:  # warm hand-over: already accounted at placement
                return r
            raise NotFound(f"request {request_id!r} has no placement awaiting creation")
        req, node_id = got
        node = self.cluster.nodes[node_id]
        node.inflight -= 1
        pool = req.tenant == PoolBook.TENANT
        r = Running(sandbox_id, node_id, req.tenant, req.priority, req.cpu, req.memory, req.disk, req.gpu,
                    now, None if pool else request_id, req.shape, pool,
                    self.images[req.image].version, None if pool else req, req.owner,
                    None if pool else now + req.ttl, req.labels, req.task_type)
        self.running[sandbox_id] = r
        self.residents[node_id][sandbox_id] = r
        if pool:
            self.pools.member_ready(r, now)  # type: ignore[union-attr]
        else:
            self._finish(request_id, "created", sandbox_id=sandbox_id, node_id=node_id, now=now)
        return r

    def on_failed(self, request_id: str, now: float, error: str, retriable: bool = True) -> Ticket | None:
        got = self.placed.pop(request_id, None)
        if got is None:
            raise NotFound(f"request {request_id!r} has no placement awaiting creation")
        req, node_id = got
        node = self.cluster.nodes[node_id]
        node.inflight -= 1
        self._alloc(node, req.cpu, req.memory, req.disk, req.gpu, -1)
        if req.tenant == PoolBook.TENANT:
            self.pools.member_failed(req)  # type: ignore[union-attr]
            return None
        self.queues.charge(req.tenant, req.cpu, req.memory, -1)
        req.attempts += 1
        req.excluded.add(node_id)
        delay = should_retry(req.attempts, retriable, self.budget, self.s)
        if delay is None:
            self.stats["failed"] += 1
            return self._finish(request_id, "failed", error=f"{error} (after {req.attempts} attempts)", now=now)
        self.stats["retries"] += 1
        self._seq += 1
        heapq.heappush(self.delayed, (now + delay, self._seq, req))
        self.pending[request_id] = req
        t = self.tickets[request_id]
        t.state, t.node_id = "queued", None
        return t

    def adopt(self, node_id: str, sandbox_id: str, tenant: str, cpu: float, memory: int, disk: int,
              now: float, *, ttl_left: float | None = None, labels: dict[str, str] | None = None,
              owner: str | None = None) -> Running:
        """Account a sandbox that already lives on a node (found at start, e.g. after a server
        restart), so capacity and quotas stay true. Idempotent."""
        r = self.running.get(sandbox_id)
        if r is not None:
            return r
        r = Running(sandbox_id, node_id, tenant, MEDIUM, cpu, memory, disk, None, now, labels=dict(labels or {}),
                    expires_at=None if ttl_left is None else now + ttl_left, owner=owner)
        if owner is not None and owner not in self.leases:
            self.heartbeat(owner, now)  # a restart grants the owner a fresh grace period
        self.running[sandbox_id] = r
        self.residents[node_id][sandbox_id] = r
        self._alloc(self._node(node_id), cpu, memory, disk, None, 1)
        self.queues.charge(tenant, cpu, memory, 1)
        return r

    def sync_node(self, node_id: str, live: set[str], listed_at: float) -> list[Running]:
        """Forget sandboxes the node no longer has (reaped or killed by the node itself):
        otherwise their allocation would hold capacity forever. Only entries older than the
        listing are judged, so a creation finishing meanwhile is never dropped."""
        gone = [r for sid, r in self.residents[node_id].items()
                if sid not in live and r.started_at < listed_at]
        for r in gone:
            self.on_released(r.sandbox_id, listed_at)
        return gone

    def on_released(self, sandbox_id: str, now: float, cpu_peak: float | None = None,
                    memory_peak: int | None = None) -> Running | None:
        """A sandbox is gone (destroyed, reaped, expired, lost). Unknown ids are ignored (idempotent)."""
        r = self.running.pop(sandbox_id, None)
        if r is None:
            return None
        self.residents[r.node_id].pop(sandbox_id, None)
        node = self.cluster.nodes.get(r.node_id)
        if node is not None:
            self._alloc(node, r.cpu, r.memory, r.disk, r.gpu, -1)
        if r.pool:
            self.pools.member_gone(r)  # type: ignore[union-attr]
        else:
            self.queues.charge(r.tenant, r.cpu, r.memory, -1)
            if r.task_type is not None and cpu_peak is not None and memory_peak is not None:
                self.rightsizer.observe(r.task_type, cpu_peak, memory_peak)
            elif r.task_type is not None and cpu_peak is not None:
                self.rightsizer.observe_cpu(r.task_type, cpu_peak)
        return r

    def recycle(self, sandbox_id: str, now: float, cpu_peak: float | None = None) -> Request | None:
        """The user released ``sandbox_id``; when its shape's pool wants a member, release it
        and account the same sandbox as that member being made on its node (the driver has
        the node reset it under a new id and reports on_created / on_failed for the returned
        pool request). None: nothing changed, destroy and ``on_released`` as usual."""
        r = self.running.get(sandbox_id)
        if r is None or self.pools is None or not self.pools.may_recycle(r, now):
            return None
        self.on_released(sandbox_id, now, cpu_peak=cpu_peak)
        self.stats["recycled"] += 1
        return self.pools.start_recycled(r, now)

    def _finish(self, request_id: str, state: str, *, now: float, sandbox_id: str | None = None,
                node_id: str | None = None, error: str | None = None) -> Ticket:
        t = self.tickets[request_id]
        t.state, t.sandbox_id, t.node_id, t.error, t.position, t.eta_s = state, sandbox_id, node_id, error, 0, 0.0
        self._finished_at[request_id] = now
        return t

    def _prune_tickets(self, now: float) -> None:
        # Tickets are kept for idempotency_ttl_s after they finish, oldest first; bounded.
        cutoff = now - self.s.idempotency_ttl_s
        tk, fin = self.tickets, self._finished_at
        while tk:
            rid = next(iter(tk))
            done = fin.get(rid)
            if done is None or done > cutoff:
                break
            del tk[rid]
            del fin[rid]

    # ------------------------------------------------------------------ leases and reaping
    def heartbeat(self, owner: str, now: float) -> None:
        lease = self.leases.get(owner)
        if lease is None:
            self.leases[owner] = Lease(owner, now)
        else:
            lease.last_heartbeat = now

    def drop_lease(self, owner: str) -> None:
        self.leases.pop(owner, None)

    def owned_by(self, owner: str) -> list[str]:
        """Sandbox ids held under ``owner``'s lease."""
        return [r.sandbox_id for r in self.running.values() if r.owner == owner]

    def _leased(self) -> list[LeasedSandbox]:
        return [LeasedSandbox(r.sandbox_id, r.owner, r.expires_at, r.labels)
                for r in self.running.values() if not r.pool]

    def reap(self, now: float) -> list[ReapDecision]:
        """Sandboxes the driver must destroy now (TTL passed, owner silent, owner unknown)."""
        return reap_decisions(now, self._leased(), self.leases, self.s)

    def reap_labels(self, selector: dict[str, str]) -> list[ReapDecision]:
        return reap_by_labels(self._leased(), selector)
