"""Discrete-event simulation of a cluster driven by the real ``dsec.control.Scheduler``.

The simulator plays the driver's role: it submits the trace's requests, calls
``next_batch`` every ``batch_window_s`` while work is pending, executes placements on
simulated nodes (layer cache + pull bandwidth + start latency + injected failures) and
reports back with ``on_created`` / ``on_failed`` / ``on_released`` / ``usage_sample`` /
``node_lost``. Only the wall time spent inside the scheduler counts as decision time.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dsec.config import Settings
from dsec.control.scheduler import Scheduler
from dsec.control.types import Request
from dsec.errors import Overloaded
from dsec.sim.cache import SimLayerCache
from dsec.sim.config import SimConfig
from dsec.sim.trace import Arrival, arrivals, make_images, node_failures, offered_cpu

BATCH, CREATED, END, USAGE, FAIL, BACK, ARRIVE = range(7)
SERIES_EVERY_S = 300.0
GC_THRESHOLD = 100_000  # gen-0 allocations between cyclic collections during a run


@dataclass(slots=True)
class _Sb:
    node: int
    image: int
    use: float          # CPU really used (0 for an idle pool member)
    end: float
    epoch: int
    arrival: Arrival | None


def cluster_size(cfg: SimConfig) -> int:
    if cfg.nodes:
        return cfg.nodes
    return max(2, math.ceil(offered_cpu(cfg, make_images(cfg)) / (cfg.target_utilisation * cfg.node_cpu)))


PLAIN = ":plain"


def parse_policy(spec: str) -> tuple[str, bool]:
    """``name`` or ``name:plain`` -> (placement policy name, plain)."""
    name, plain = (spec[: -len(PLAIN)], True) if spec.endswith(PLAIN) else (spec, False)
    return name, plain


def settings_for(policy: str, base: Settings) -> Settings:
    """``name``: the scheduler as DSec runs it (overcommit rule, warm pools), with ``name``
    choosing the node -- every policy gets the same admission rule and pool machinery, so
    the comparison is of placement alone. ``name:plain``: the policy stand-alone, as a
    kube-scheduler cluster runs: admit by requests up to capacity (no overcommit, no usage
    rule) and no warm pools."""
    _, plain = parse_policy(policy)
    if not plain:
        return base
    return base.model_copy(update={"overcommit_ratio": 1.0, "overcommit_threshold": 1e9})


def run_policy(cfg: SimConfig, policy: str, base: Settings | None = None,
               progress: Callable[[float], None] | None = None) -> dict:
    # Millions of short-lived acyclic objects (requests, tickets, events): the default
    # gen-0 threshold makes the cyclic collector rescan the live heap thousands of times
    # for nothing (~20 % of the run). Results do not depend on it.
    old = gc.get_threshold()
    gc.collect()
    gc.set_threshold(GC_THRESHOLD, 50, 1000)
    try:
        return _run_policy(cfg, policy, base, progress)
    finally:
        gc.set_threshold(*old)


def _run_policy(cfg: SimConfig, policy: str, base: Settings | None,
                progress: Callable[[float], None] | None) -> dict:
    s = settings_for(policy, base or Settings())
    name, plain = parse_policy(policy)
    sched = Scheduler(s, policy=name, seed=cfg.seed + 3, pools=not plain)
    images = make_images(cfg)
    n_nodes = cluster_size(cfg)
    names = [f"n{i}" for i in range(n_nodes)]
    for nid in names:
        sched.upsert_node(nid, cfg.node_cpu, cfg.node_memory, cfg.node_disk, isolation=("container", "gvisor"))
    for im in images:
        sched.register_image(im.name, im.layers, version="v1")
    img_index = {im.name: k for k, im in enumerate(images)}
    img_bytes = [sum(sz for _, sz in im.layers) for im in images]
    node_idx = {nid: i for i, nid in enumerate(names)}
    caches = [SimLayerCache(cfg.cache_max_images, cfg.cache_max_bytes) for _ in range(n_nodes)]
    use = [0.0] * n_nodes
    epoch = [0] * n_nodes
    down = [False] * n_nodes
    overloaded = [False] * n_nodes
    pull_free = [0.0] * n_nodes
    start_slots: list[list[float]] = [[] for _ in range(n_nodes)]
    sbs: dict[str, _Sb] = {}
    by_rid: dict[str, Arrival] = {}
    remaining: dict[str, float] = {}  # preempted sandbox -> episode time left
    preempted: dict[str, Arrival] = {}
    placed_at: dict[str, float] = {}
    waits, starts = array("d"), array("d")
    m = dict(layer_lookups=0, layer_hits=0, bytes_pulled=0, bytes_wanted=0, creates=0, warm=0, user_placed=0,
             overload_incidents=0, overload_samples=0, lost=0, node_failures=0, resubmits_429=0, failed=0,
             decision_s=0.0, decision_cpu_s=0.0, decisions=0)
    series: list[dict] = []
    heap: list[tuple] = []
    nxt = itertools.count(1).__next__  # event sequence: FIFO among equal times
    heappush, heappop = heapq.heappush, heapq.heappop
    horizon = cfg.hours * 3600.0
    bw = s.batch_window_s
    batch_at = -1.0

    def push(t: float, kind: int, data: object) -> None:
        heappush(heap, (t, nxt(), kind, data))

    def want_batch(t: float) -> None:
        nonlocal batch_at
        t = math.ceil(t / bw - 1e-9) * bw
        if batch_at < 0 or t < batch_at:
            batch_at = t
            push(t, BATCH, None)

    for t, idx in node_failures(cfg, n_nodes):
        push(t, FAIL, idx)
    push(0.0, USAGE, None)

    def submit(a: Arrival, now: float) -> None:
        im = images[a.image]
        req = Request(a.rid, a.tenant, im.name, im.cpu, im.memory, im.disk, a.priority, im.isolation,
                      ttl=cfg.duration_max_s * 2)
        try:
            sched.submit(req, now)
        except Overloaded as e:
            m["resubmits_429"] += 1
            push(now + float(e.details["retry_after"]), ARRIVE, a)
            return
        by_rid[a.rid] = a
        want_batch(now)

    def kill(sid: str) -> _Sb | None:
        sb = sbs.pop(sid, None)
        if sb is not None:
            use[sb.node] -= sb.use
            caches[sb.node].release(images[sb.image].layers)
        return sb

    def batch(now: float) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        out = sched.next_batch(now)
        m["decision_s"] += time.perf_counter() - t0
        # CPU time too: wall clock inside next_batch swings with the machine's load.
        m["decision_cpu_s"] += time.thread_time() - c0
        plim = sched.parallel_limit()  # fixed until the next scheduler call that moves the queue
        for p in out:
            if p.kind == "destroy":
                kill(p.sandbox_id)  # type: ignore[arg-type]
                continue
            m["decisions"] += 1
            req = p.request
            assert req is not None
            if p.kind == "warm":
                a, dur = take_arrival(req)
                sb = sbs[p.sandbox_id]  # type: ignore[index]
                t_in = first_submit(req, a)
                waits.append(now - t_in)
                starts.append(now + cfg.handoff_latency_s - t_in)
                im = images[sb.image]
                sb.use, sb.arrival, sb.end = a.usage * im.cpu, a, now + cfg.handoff_latency_s + dur
                use[sb.node] += sb.use
                m["warm"] += 1
                m["user_placed"] += 1
                push(sb.end, END, p.sandbox_id)
                continue
            i = node_idx[p.node_id]
            for sid in p.evict + p.preempt:
                sb = kill(sid)
                if sb is not None and sb.arrival is not None:
                    remaining[sid] = max(1.0, sb.end - now)
                    preempted[sid] = sb.arrival
            k = img_index[req.image]
            im = images[k]
            hits, pulled, added = caches[i].use(im.name, im.layers, now)
            m["layer_lookups"] += len(im.layers)
            m["layer_hits"] += hits
            m["bytes_pulled"] += pulled
            m["bytes_wanted"] += img_bytes[k]
            if added:
                sched.layers_changed(p.node_id, added)
            gone = caches[i].maybe_evict(now)
            if gone:
                sched.layers_changed(p.node_id, (), gone)
            ready = now
            if pulled:
                pull_free[i] = max(now, pull_free[i]) + pulled / cfg.pull_bandwidth
                ready = pull_free[i]
            # At most parallel_limit() starts run at once per node (raised under backpressure):
            # a start takes the earliest free slot.
            slots = start_slots[i]
            while len(slots) < plim:
                heappush(slots, 0.0)
            ready = max(ready, heappop(slots))
            ready += cfg.start_latency_s + (cfg.gvisor_extra_s if im.isolation == "gvisor" else 0.0)
            heappush(slots, ready)
            m["creates"] += 1
            if p.kind == "create":
                m["user_placed"] += 1
                placed_at[req.request_id] = now
                a = by_rid.get(req.request_id)
                ok = not (a is not None and a.fail and req.attempts == 0)
            else:
                ok = True
            push(ready, CREATED, (req.request_id, i, epoch[i], ok, k))
        if len(sched.queues) and out:
            want_batch(now + bw)
        # Nothing placeable: capacity changes (END, CREATED failure, usage sample, node back)
        # trigger the next batch; polling every window would only burn wall time.
        if sched.delayed:
            want_batch(max(now + bw, sched.delayed[0][0]))

    def first_submit(req: Request, a: Arrival) -> float:
        # Waits count from the client's first submit: a request refused with 429 and
        # resubmitted after Retry-After waited all along. A preempted sandbox's resumption
        # counts from its re-queueing.
        return req.submitted_at if req.resume_of is not None else a.t

    def take_arrival(req: Request) -> tuple[Arrival, float]:
        if req.resume_of is not None:  # a preempted sandbox, re-queued by the scheduler
            return preempted.pop(req.resume_of), remaining.pop(req.resume_of)
        a = by_rid.pop(req.request_id)
        return a, a.duration

    arr_iter = arrivals(cfg)
    chunk: list[Arrival] = []
    ci = 0
    next_series = 0.0
    while True:
        if ci >= len(chunk):
            chunk = next(arr_iter, [])
            ci = 0
        t_arr = chunk[ci].t if chunk else math.inf
        if heap and heap[0][0] <= t_arr:
            now, _, kind, data = heappop(heap)
        elif chunk:
            now, kind, data = t_arr, ARRIVE, chunk[ci]
            ci += 1
        else:
            break
        if now > horizon:
            break
        if kind == ARRIVE:
            submit(data, now)  # type: ignore[arg-type]
        elif kind == BATCH:
            if batch_at == now:
                batch_at = -1.0
                batch(now)
        elif kind == CREATED:
            rid, i, ep, ok, k = data  # type: ignore[misc]
            if ep != epoch[i]:
                continue  # the node died meanwhile; the scheduler already retried it
            if not ok:
                caches[i].release(images[k].layers)
                tk = sched.on_failed(rid, now, "injected create failure")
                if tk is not None and tk.state == "failed":
                    m["failed"] += 1
                want_batch(now)
                continue
            sid = f"s-{rid}"
            r = sched.on_created(rid, sid, now)
            if r.pool:
                sbs[sid] = _Sb(i, k, 0.0, math.inf, ep, None)
                continue
            req = r.request
            assert req is not None
            a, dur = take_arrival(req)
            t_in = first_submit(req, a)
            waits.append(placed_at.pop(rid) - t_in)
            starts.append(now - t_in)
            sb = sbs[sid] = _Sb(i, k, a.usage * images[k].cpu, now + dur, ep, a)
            use[i] += sb.use
            push(sb.end, END, sid)
        elif kind == END:
            sb = sbs.get(data)  # type: ignore[arg-type]
            if sb is None or sb.end != now:
                continue
            del sbs[data]  # = kill(data), inlined: one END per sandbox
            use[sb.node] -= sb.use
            caches[sb.node].release(images[sb.image].layers)
            sched.on_released(data, now)  # type: ignore[arg-type]
            if len(sched.queues):
                want_batch(now)
        elif kind == USAGE:
            for i in range(n_nodes):
                if down[i]:
                    continue
                frac = use[i] / cfg.node_cpu
                sched.usage_sample(names[i], now, frac)
                if frac > 1.0:
                    m["overload_samples"] += 1
                    if not overloaded[i]:
                        m["overload_incidents"] += 1
                overloaded[i] = frac > 1.0
            if now >= next_series:
                next_series += SERIES_EVERY_S
                nl = sched.cluster.node_list
                cap = sum(n.cpu for n in nl)
                series.append(dict(t=now, queue=sched.depth(), alloc=sum(n.used_cpu for n in nl) / cap,
                                   used=sum(use) / cap, pool=sched.pools.size() if sched.pools else 0,
                                   pulled=m["bytes_pulled"]))
                if progress is not None:
                    progress(now / horizon)
            push(now + cfg.usage_interval_s, USAGE, None)
            want_batch(now)  # lets the pool planner run even when no request is queued
        elif kind == FAIL:
            i = data  # type: ignore[assignment]
            if down[i]:
                continue
            down[i] = True
            m["node_failures"] += 1
            epoch[i] += 1
            lost = sched.node_lost(names[i], now)
            for sid in [x for x, sb in sbs.items() if sb.node == i]:
                sb = sbs.pop(sid)
                if sb.arrival is not None and any(r.sandbox_id == sid for r in lost):
                    m["lost"] += 1
                    a = sb.arrival
                    push(now, ARRIVE, Arrival(now, a.rid + "~lost", a.tenant, a.image, a.priority,
                                              max(1.0, sb.end - now), a.usage, False))
            sched.layers_changed(names[i], (), sorted(sched.cluster.nodes[names[i]].layers))
            caches[i].clear()
            use[i] = 0.0
            overloaded[i] = False
            push(now + cfg.node_repair_s, BACK, i)
            want_batch(now)
        elif kind == BACK:
            down[data] = False  # type: ignore[index]
            sched.set_node_health(names[data], True)  # type: ignore[index]
            want_batch(now)
    if progress is not None:
        progress(1.0)
    return _summary(cfg, policy, sched, m, waits, starts, series, n_nodes)


def _pct(xs: array, q: float) -> float:
    return float(np.percentile(np.frombuffer(xs, dtype=np.float64), q)) if len(xs) else 0.0


def _summary(cfg: SimConfig, policy: str, sched: Scheduler, m: dict, waits: array, starts: array,
             series: list[dict], n_nodes: int) -> dict:
    st = sched.stats
    return {
        "policy": policy,
        "nodes": n_nodes,
        "requests_placed": m["user_placed"],
        "queue_wait_p50_s": _pct(waits, 50), "queue_wait_p99_s": _pct(waits, 99),
        "start_latency_p50_s": _pct(starts, 50), "start_latency_p99_s": _pct(starts, 99),
        "decisions": m["decisions"],
        "decisions_per_s": m["decisions"] / m["decision_s"] if m["decision_s"] else 0.0,
        "decisions_per_cpu_s": m["decisions"] / m["decision_cpu_s"] if m["decision_cpu_s"] else 0.0,
        "layer_hit_rate": m["layer_hits"] / m["layer_lookups"] if m["layer_lookups"] else 0.0,
        "byte_hit_rate": 1 - m["bytes_pulled"] / m["bytes_wanted"] if m["bytes_wanted"] else 0.0,
        "bytes_pulled": m["bytes_pulled"],
        "warm_pool_hit_rate": m["warm"] / m["user_placed"] if m["user_placed"] else 0.0,
        "creates": m["creates"],
        "utilisation_alloc_mean": float(np.mean([x["alloc"] for x in series])) if series else 0.0,
        "utilisation_used_mean": float(np.mean([x["used"] for x in series])) if series else 0.0,
        "overload_incidents": m["overload_incidents"],
        "preemptions": st["preemptions"], "pool_evictions": st["evictions"],
        "rejected_429": m["resubmits_429"], "failed_requests": m["failed"], "retries": st["retries"],
        "node_failures": m["node_failures"], "sandboxes_lost_to_node_failures": m["lost"],
        "pool_misses": dict(sched.pools.misses) if sched.pools else {},
        "pool_destroyed": dict(sched.pools.destroyed) if sched.pools else {},
        "series": series,
    }
