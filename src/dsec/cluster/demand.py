"""Pending demand for an autoscaler: what the cluster cannot place now, by resource shape.

A create waits in the scheduler's queue only when no ready node has room for it (a
placeable one leaves the queue within one batch window, ~ms), so the requests that have
waited at least ``cluster_demand_min_age_s`` are the demand the current nodes cannot
meet. It is exposed in two forms (``GET /v1/scheduler`` -> ``pending_demand``, and the
``dsec_scheduler_pending_demand`` gauge, one series per shape):

- ``shapes``: ``[{"cpu", "memory", "disk", "isolation", "gpu", "count"}]``, largest count
  first (memory/disk in bytes, cpu in cores as reserved by the scheduler): for any
  autoscaler — add nodes until ``count`` sandboxes of each shape fit.
- ``ray_bundles``: the same as Ray's autoscaler resource-demand bundles, one
  ``{"CPU": cpu, "memory": bytes}`` (plus ``"GPU"``) per pending sandbox, ready for
  ``ray.autoscaler.sdk.request_resources(bundles=...)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, Field

MAX_SHAPES = 50  # bounded: the metric's label values and the response size


class DemandShape(BaseModel):
    cpu: float = Field(..., description="Cores one sandbox of this shape reserves")
    memory: int = Field(..., description="Bytes of memory one sandbox reserves")
    disk: int = Field(..., description="Bytes of disk one sandbox reserves")
    isolation: str
    gpu: str | None = None
    count: int = Field(..., description="Sandboxes of this shape waiting for room")


def pending_demand(requests: Iterable[Any], now: float, min_age_s: float) -> list[DemandShape]:
    """Pure: queued requests older than ``min_age_s`` grouped by shape, largest count
    first (ties: larger cpu, then memory), at most MAX_SHAPES shapes."""
    counts: dict[tuple[float, int, int, str, str | None], int] = {}
    for r in requests:
        if now - r.submitted_at < min_age_s:
            continue
        key = (round(float(r.cpu), 3), int(r.memory), int(r.disk), r.isolation, r.gpu)
        counts[key] = counts.get(key, 0) + 1
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], -kv[0][0], -kv[0][1], kv[0][3], kv[0][2]))
    return [DemandShape(cpu=k[0], memory=k[1], disk=k[2], isolation=k[3], gpu=k[4], count=n)
            for k, n in ordered[:MAX_SHAPES]]


def ray_bundles(shapes: list[DemandShape]) -> list[dict[str, float]]:
    """Ray autoscaler resource-demand bundles: one per pending sandbox."""
    out = []
    for s in shapes:
        b: dict[str, float] = {"CPU": s.cpu, "memory": float(s.memory)}
        if s.gpu:
            b["GPU"] = 1.0
        out += [dict(b) for _ in range(s.count)]
    return out
