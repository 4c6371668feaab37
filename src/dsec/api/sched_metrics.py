"""Scheduler metrics, read from the driver at scrape time (no per-event pushes; labels are
node ids and fixed counter names, never sandbox ids or tenant strings)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Counter names exported from Scheduler.stats (a fixed set: bounded label values).
EXPORTED_STATS = ("submitted", "placements", "warm_hits", "warm_misses", "retries", "failed", "preemptions",
                  "evictions", "rejected_overload", "rejected_quota", "rejected_invalid", "cancelled", "recycled")


class SchedulerCollector(Collector):
    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def collect(self) -> Iterator[Metric]:
        sched = self.driver.sched
        depth = GaugeMetricFamily("dsec_scheduler_queue_depth", "Create requests waiting for placement")
        depth.add_metric([], sched.depth())
        yield depth
        bp = GaugeMetricFamily("dsec_scheduler_backpressure", "1 while backpressure (429) is on")
        bp.add_metric([], 1.0 if sched.bp.active else 0.0)
        yield bp
        events = CounterMetricFamily("dsec_scheduler_events", "Scheduler decisions and outcomes", labels=["event"])
        for name in EXPORTED_STATS:
            events.add_metric([name], float(sched.stats.get(name, 0)))
        yield events
        alloc = GaugeMetricFamily("dsec_node_cpu_allocated_ratio",
                                  "CPU reserved on a node / its overcommit bound (1.0 = full)", labels=["node"])
        warm = GaugeMetricFamily("dsec_node_warm_sandboxes", "Idle warm-pool members on a node", labels=["node"])
        load = GaugeMetricFamily("dsec_node_predicted_load", "Predicted CPU load used by the overcommit guard",
                                 labels=["node"])
        ratio = sched.s.overcommit_ratio
        for n in sched.cluster.node_list:
            alloc.add_metric([n.node_id], n.used_cpu / (n.cpu * ratio) if n.cpu else 0.0)
            warm.add_metric([n.node_id], float(n.warm_count))
            load.add_metric([n.node_id], float(n.predicted))
        yield alloc
        yield warm
        yield load
        from dsec.cluster.demand import pending_demand
        demand = GaugeMetricFamily("dsec_scheduler_pending_demand", "Creates the cluster cannot place now, by "
                                   "resource shape (autoscaler input; see docs/cluster.md)",
                                   labels=["cpu", "memory", "disk", "isolation", "gpu"])
        import time
        now = getattr(self.driver, "clock", time.monotonic)()  # the scheduler's clock (submitted_at)
        for d in pending_demand(list(sched.pending.values()), now, sched.s.cluster_demand_min_age_s):
            demand.add_metric([f"{d.cpu:g}", str(d.memory), str(d.disk), d.isolation, d.gpu or ""], float(d.count))
        yield demand
        yield from prefetch_metrics(getattr(self.driver, "prefetcher", None))


def prefetch_metrics(prefetcher: Any) -> Iterator[Metric]:
    """The leader's image prefetch counters (``Prefetcher.stats``); nothing when prefetch is
    off (no registry, or ``image_prefetch_enabled=false``)."""
    if prefetcher is None:
        return
    stats = prefetcher.stats
    jobs = CounterMetricFamily("dsec_image_prefetch_jobs", "Image prefetch jobs sent to nodes, by outcome "
                               "(started, done, skipped: the node had or was fetching it, failed)",
                               labels=["result"])
    for result, key in (("started", "jobs"), ("done", "done"), ("skipped", "skipped"), ("failed", "failed")):
        jobs.add_metric([result], float(stats.get(key, 0)))
    yield jobs
    moved = CounterMetricFamily("dsec_image_prefetch_bytes", "Layer bytes nodes fetched (peers or registry) "
                                "for prefetch jobs")
    moved.add_metric([], float(stats.get("bytes", 0)))
    yield moved
