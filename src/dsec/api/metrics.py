"""Prometheus metrics of one API app, on a private ``CollectorRegistry``.

Labels are bounded: route templates (never raw paths), error codes, lifecycle states,
isolation kinds. No series is ever keyed by sandbox id or tenant-supplied strings.
Counters owned by other components (image cache, leak reaper) are read at scrape time
from whatever the node agent / image store exposes, so they are aggregated locally and
never pushed per event.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

# Buckets spanning a warm-pool hit (~ms) to a cold image pull (~tens of s).
_CREATE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
_EXEC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)
_API_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0)


class _ComponentCounters(Collector):
    """Cumulative counters owned by other components, exported with counter semantics."""

    def __init__(self) -> None:
        self.cache: dict[tuple[str, str], float] = {}
        self.leaks_reaped: float | None = None

    def collect(self) -> Iterator[Metric]:
        cache = CounterMetricFamily("dsec_image_cache_events", "Image/layer cache hits and misses",
                                    labels=["kind", "result"])
        for (kind, result), v in sorted(self.cache.items()):
            cache.add_metric([kind, result], v)
        yield cache
        leaks = CounterMetricFamily("dsec_leaks_reaped", "Leaked or expired sandboxes force-cleaned")
        if self.leaks_reaped is not None:
            leaks.add_metric([], self.leaks_reaped)
        yield leaks


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.create_seconds = Histogram("dsec_sandbox_create_seconds", "Sandbox create latency (API view)",
                                        ["isolation"], buckets=_CREATE_BUCKETS, registry=r)
        self.creates = Counter("dsec_sandbox_creates", "Sandbox creates by result (ok or error code)",
                               ["result"], registry=r)
        self.exec_seconds = Histogram("dsec_exec_seconds", "Exec latency (API view, whole command)",
                                      ["mode"], buckets=_EXEC_BUCKETS, registry=r)
        self.execs = Counter("dsec_execs", "Execs by result (ok, nonzero, timeout or error code)",
                             ["result"], registry=r)
        self.sandboxes = Gauge("dsec_sandboxes", "Live sandboxes by lifecycle state", ["state"], registry=r)
        self.api_seconds = Histogram("dsec_api_request_seconds", "API request latency",
                                     ["method", "route", "status"], buckets=_API_BUCKETS, registry=r)
        self.components = _ComponentCounters()
        r.register(self.components)
        self.audit_records = Counter("dsec_audit_records", "Audit records written", registry=r)
        self.gc_pause = Histogram("dsec_gc_pause_seconds", "Python cyclic-GC pauses of the API process "
                                  "(they stop the event loop)", ["generation"], buckets=_API_BUCKETS, registry=r)
        self.loop_lag = Histogram("dsec_event_loop_lag_seconds", "How late the API event loop runs a timer "
                                  "(blocking work on the loop shows here)", buckets=_API_BUCKETS, registry=r)
        self.inflight_creates = Gauge("dsec_inflight_creates", "Sandbox creates in flight", registry=r)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, memoised: ``labels()`` takes a lock and checks its
        arguments on every call (~5-10 us, three per exec; issue 15). Label values are
        bounded (module docstring), so this map is too."""
        key = (id(metric), values)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(*values)
        return got

    def set_states(self, counts: dict[str, int], all_states: list[str]) -> None:
        for state in all_states:
            self.sandboxes.labels(state=state).set(counts.get(state, 0))

    def absorb_stats(self, stats: dict[str, Any]) -> None:
        """Copy cumulative counters from component ``stats()`` dicts (bounded keys only).

        Recognised keys: ``{layer,image}_cache_{hits,misses}`` and ``leaks_reaped``.
        """
        for kind in ("layer", "image"):
            for key, result in (("hits", "hit"), ("misses", "miss")):
                v = stats.get(f"{kind}_cache_{key}")
                if isinstance(v, int | float):
                    self.components.cache[(kind, result)] = float(v)
        v = stats.get("leaks_reaped")
        if isinstance(v, int | float):
            self.components.leaks_reaped = float(v)

    def render(self) -> bytes:
        return generate_latest(self.registry)
