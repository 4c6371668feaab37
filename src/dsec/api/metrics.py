"""Prometheus metrics of one API app, on a private ``CollectorRegistry``.

Labels are bounded: route templates (never raw paths), error codes, lifecycle states,
isolation kinds. No series is ever keyed by sandbox id or tenant-supplied strings.
Counters owned by other components (image cache, leak reaper) are read at scrape time
from whatever the node agent / image store exposes, so they are aggregated locally and
never pushed per event.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets spanning a warm-pool hit (~ms) to a cold image pull (~tens of s).
_CREATE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
_EXEC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)
_API_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0)


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
        self.image_cache = Gauge("dsec_image_cache_events", "Image/layer cache hits and misses (cumulative)",
                                 ["kind", "result"], registry=r)
        self.leaks_reaped = Gauge("dsec_leaks_reaped", "Leaked or expired sandboxes force-cleaned (cumulative)",
                                  registry=r)
        self.audit_records = Counter("dsec_audit_records", "Audit records written", registry=r)
        self.inflight_creates = Gauge("dsec_inflight_creates", "Sandbox creates in flight", registry=r)

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
                    self.image_cache.labels(kind=kind, result=result).set(v)
        v = stats.get("leaks_reaped")
        if isinstance(v, int | float):
            self.leaks_reaped.set(v)

    def render(self) -> bytes:
        return generate_latest(self.registry)
