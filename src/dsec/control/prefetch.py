"""Image prefetch decisions (issue 12, "Prefetch"). Pure: the executor is
``dsec.cluster.prefetch``.

Every ``image_prefetch_interval_s`` the scheduler leader asks three questions:

1. **Which images are popular?** ``ImageDemand`` counts creates per image over the last
   ``image_prefetch_window_s``; ``popular`` keeps the ``image_prefetch_top_images`` with
   at least ``image_prefetch_min_creates`` of them.
2. **Which nodes will the scheduler use next for it?** ``likely_nodes``: the scheduler's
   own ranking (``placement.rank``: the same score as ``OursPolicy.choose``: layer
   coverage, load, predicted load; only nodes with room for the image's last requested
   shape), its first ``image_prefetch_nodes``. Nodes already holding the image rank
   first, so this names the holders plus the next-best nodes that would be picked once
   the holders fill up.
3. **Which layers does each of those nodes lack, in what order?** ``layer_order``: the
   image's layers in the order sandboxes first needed them (the image store's
   ``access_order`` record, reported by the nodes in their layer index), unrecorded ones
   after, base first.

``plan`` turns the answers into at most ``image_prefetch_max_inflight`` jobs, one per
node at a time, never for a (node, image) tried within ``image_prefetch_retry_s``: a node
whose own cache eviction or the cluster GC dropped a prefetched image is not refilled
in a loop (and a node that failed to fetch is not hammered).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, Field

from dsec.control.placement import ClusterView, OursPolicy, rank
from dsec.control.types import Image, Node, Request


class ImageDemand:
    """Creates per image over a sliding window, and each image's last request (its shape
    is what "room for it" means when choosing nodes)."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError("image_prefetch_window_s must be > 0")
        self.window_s = window_s
        self.times: dict[str, deque[float]] = {}
        self.last: dict[str, Request] = {}

    def observe(self, image: str, now: float, req: Request) -> None:
        q = self.times.setdefault(image, deque())
        q.append(now)
        while q[0] <= now - self.window_s:  # bounded by the window even if nobody reads counts()
            q.popleft()
        self.last[image] = req

    def counts(self, now: float) -> dict[str, int]:
        """Creates per image within the window (images with none are forgotten)."""
        out: dict[str, int] = {}
        for image in list(self.times):
            q = self.times[image]
            while q and q[0] <= now - self.window_s:
                q.popleft()
            if q:
                out[image] = len(q)
            else:
                del self.times[image]
                self.last.pop(image, None)
        return out


def popular(counts: Mapping[str, int], top_n: int, min_creates: int) -> list[str]:
    """The ``top_n`` images with the most creates (at least ``min_creates``), most first;
    ties by name (deterministic)."""
    hot = [(n, image) for image, n in counts.items() if n >= max(1, min_creates)]
    hot.sort(key=lambda t: (-t[0], t[1]))
    return [image for _, image in hot[:max(0, top_n)]]


def layer_order(layers: Sequence[tuple[str, int]], access: Sequence[str]) -> list[tuple[str, int]]:
    """``layers`` (base first) in recorded first-demand order; layers with no record keep
    their manifest order, after the recorded ones."""
    pos = {d: i for i, d in enumerate(dict.fromkeys(access))}
    idx = {d: i for i, (d, _) in enumerate(layers)}
    return sorted(layers, key=lambda ds: (pos.get(ds[0], len(pos)), idx[ds[0]]))


def probe_request(last: Request) -> Request:
    """A copy of an image's last request to rank nodes with: same shape and constraints,
    none of the scheduler's per-attempt state (excluded nodes, retries)."""
    return dataclasses.replace(last, request_id=f"prefetch-{last.image}", excluded=set(), attempts=0,
                               not_before=0.0, payload=None, labels=dict(last.labels),
                               selector=dict(last.selector))


def likely_nodes(policy: OursPolicy, req: Request, image: Image, cluster: ClusterView, n: int) -> list[Node]:
    """The first ``n`` nodes the scheduler would rank for ``req`` now (with room for it)."""
    return [node for node, _ in rank(policy, req, image, cluster)[:max(0, n)]]


class PrefetchJob(BaseModel):
    """Fetch ``image``'s layers that ``node`` lacks, in ``layers`` order (first-demand)."""

    node: str
    image: str
    layers: list[str] = Field(..., description="Digests the node lacks, in the order to fetch them")
    bytes: int = Field(..., description="Their compressed size")


def plan(hot: Sequence[str], images: Mapping[str, Image], likely: Mapping[str, Sequence[Node]],
         access: Mapping[str, Sequence[str]], busy: Iterable[str], recent: Iterable[tuple[str, str]],
         max_jobs: int) -> list[PrefetchJob]:
    """Jobs for this pass: popular images in order; for each, its likely nodes in rank
    order that lack some of its layers. One job per node (``busy``: nodes with one in
    flight); none for a (node, image) in ``recent``; at most ``max_jobs``."""
    taken = set(busy)
    skip = set(recent)
    out: list[PrefetchJob] = []
    for name in hot:
        image = images.get(name)
        if image is None:
            continue
        ordered = layer_order(image.layers, access.get(name, ()))
        for node in likely.get(name, ()):
            if len(out) >= max_jobs:
                return out
            if node.node_id in taken or (node.node_id, name) in skip:
                continue
            lack = [(d, s) for d, s in ordered if d not in node.layers]
            if not lack:
                continue
            taken.add(node.node_id)
            out.append(PrefetchJob(node=node.node_id, image=name, layers=[d for d, _ in lack],
                                   bytes=sum(s for _, s in lack)))
    return out
