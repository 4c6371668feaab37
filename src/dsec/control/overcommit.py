"""Overcommit: per-node usage windows and the admission rule.

Agents idle most of the time (waiting on the model), so requested CPU overstates real
use. A node therefore admits allocations up to ``overcommit_ratio`` x capacity while its
*predicted* usage stays below ``overcommit_threshold``; above it, nothing new is admitted.

predicted = max(mean of the last ``overcommit_window_s`` (sliding),
                mean of the last ``overcommit_predict_window_s`` x ``overcommit_predict_factor``)

The recent-window term is our addition to the seed rule: a sudden spike blocks admission
at once instead of after it has moved the 10-minute mean.
"""

from __future__ import annotations

from collections import deque

from dsec.config import Settings
from dsec.control.types import Node, Request


class UsageWindow:
    """Usage fraction samples of one node (0..1 of capacity, may exceed 1 when overloaded)."""

    __slots__ = (
        "_bucket_s",
        "_buckets",
        "_n",
        "_nbuckets",
        "_recent",
        "_recent_sum",
        "_sum",
        "factor",
        "predict_s",
        "window_s",
    )

    def __init__(self, window_s: float, predict_s: float, factor: float) -> None:
        if window_s <= 0 or predict_s < window_s:
            raise ValueError(f"need 0 < overcommit_window_s ({window_s}) <= predict window ({predict_s})")
        self.window_s = window_s
        self.predict_s = predict_s
        self.factor = factor
        self._recent: deque[tuple[float, float]] = deque()
        self._recent_sum = 0.0
        # Long window in buckets of window_s: index -> [sum, n].
        self._bucket_s = window_s
        self._nbuckets = max(1, round(predict_s / window_s))
        self._buckets: dict[int, list[float]] = {}
        self._sum = 0.0  # running totals over the live buckets
        self._n = 0.0

    @classmethod
    def from_settings(cls, s: Settings) -> UsageWindow:
        return cls(s.overcommit_window_s, s.overcommit_predict_window_s, s.overcommit_predict_factor)

    def add(self, now: float, frac: float) -> None:
        # Called for every node every sample period: locals, one dict probe per call.
        recent = self._recent
        recent.append((now, frac))
        rsum = self._recent_sum + frac
        cutoff = now - self.window_s
        while recent and recent[0][0] < cutoff:
            rsum -= recent.popleft()[1]
        self._recent_sum = rsum
        b = int(now // self._bucket_s)
        buckets = self._buckets
        cell = buckets.get(b)
        if cell is None:
            buckets[b] = cell = [0.0, 0.0]
            for old in [k for k in buckets if k <= b - self._nbuckets]:
                gone = buckets.pop(old)
                self._sum -= gone[0]
                self._n -= gone[1]
        cell[0] += frac
        cell[1] += 1
        self._sum += frac
        self._n += 1

    def recent_mean(self) -> float:
        return self._recent_sum / len(self._recent) if self._recent else 0.0

    def long_mean(self) -> float:
        return max(0.0, self._sum / self._n) if self._n else 0.0

    def predicted(self) -> float:
        # = max(recent_mean(), long_mean() * factor), inlined (hot: every node, every sample).
        recent = self._recent_sum / len(self._recent) if self._recent else 0.0
        n = self._n
        long = (max(0.0, self._sum / n) if n else 0.0) * self.factor
        return max(recent, long)


def fits(node: Node, req: Request, ratio: float, threshold: float) -> bool:
    """Can ``node`` admit ``req`` under the overcommit rule? Pure; hot path.

    CPU and memory may be allocated up to ``ratio`` x capacity while predicted usage is
    below ``threshold``; disk, GPU slices and the sandbox count are never overcommitted.
    """
    if node.predicted >= threshold:
        return False
    if node.used_cpu + req.cpu > node.cpu * ratio + 1e-9:
        return False
    if node.used_memory + req.memory > node.memory * ratio:
        return False
    if node.used_disk + req.disk > node.disk or node.count >= node.max_sandboxes:
        return False
    if req.gpu is not None and node.gpu_used.get(req.gpu, 0) >= node.gpus.get(req.gpu, 0):
        return False
    return True


def could_ever_fit(node: Node, req: Request, ratio: float) -> bool:
    """Would ``req`` fit on an empty, healthy ``node``? Used to reject impossible requests."""
    return (req.cpu <= node.cpu * ratio and req.memory <= node.memory * ratio
            and req.disk <= node.disk and req.isolation in node.isolation
            and (req.gpu is None or node.gpus.get(req.gpu, 0) > 0)
            and all(node.labels.get(k) == v for k, v in req.selector.items()))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}G" if abs(n) >= 2**30 else f"{n / 2**20:.0f}M"


def shortfalls(node: Node, req: Request, ratio: float, threshold: float) -> list[str]:
    """What ``node`` is short of for ``req``, each named with its figures and the setting
    that shapes it ([] = it fits by resources). Pure: the words of a 429."""
    out: list[str] = []
    if not node.healthy:
        out.append("health (node unhealthy)")
    if req.isolation not in node.isolation:
        out.append(f"isolation ({req.isolation!r} not available)")
    if node.predicted >= threshold:
        out.append(f"measured CPU load ({node.predicted:.0%} predicted; admission stops at {threshold:.0%}, "
                   "DSEC_OVERCOMMIT_THRESHOLD)")
    cpu_cap = node.cpu * ratio
    if node.used_cpu + req.cpu > cpu_cap + 1e-9:
        out.append(f"cpu ({req.cpu:g} asked, {max(0.0, cpu_cap - node.used_cpu):.3g} of {cpu_cap:.3g} left; "
                   "a sandbox reserves its cpu x DSEC_CPU_REQUEST_RATIO)")
    mem_cap = node.memory * ratio
    if node.used_memory + req.memory > mem_cap:
        out.append(f"memory ({_gib(req.memory)} asked, {_gib(max(0.0, mem_cap - node.used_memory))} of "
                   f"{_gib(mem_cap)} left; a sandbox reserves its memory x DSEC_MEMORY_REQUEST_RATIO)")
    if node.used_disk + req.disk > node.disk:
        out.append(f"disk ({_gib(req.disk)} asked, {_gib(max(0, node.disk - node.used_disk))} of "
                   f"{_gib(node.disk)} thin-provisioned left; a sandbox reserves its disk x DSEC_DISK_REQUEST_RATIO)")
    if node.count >= node.max_sandboxes:
        out.append(f"sandbox count ({node.count} of {node.max_sandboxes}, DSEC_NODE_MAX_SANDBOXES)")
    if req.gpu is not None and node.gpu_used.get(req.gpu, 0) >= node.gpus.get(req.gpu, 0):
        out.append(f"gpu {req.gpu!r} ({node.gpu_used.get(req.gpu, 0)} of {node.gpus.get(req.gpu, 0)} in use)")
    return out


def refusal_reason(req: Request, nodes: list[Node], ratio: float, threshold: float) -> str:
    """Why no node took ``req``: the shortfalls of the node closest to fitting (fewest)."""
    if not nodes:
        return "no node is registered"
    best = min(nodes, key=lambda n: len(shortfalls(n, req, ratio, threshold)))
    short = shortfalls(best, req, ratio, threshold)
    if not short:
        return f"node {best.node_id} had room by the time of this answer (retry now)"
    return f"{'node ' + best.node_id + ' ' if len(nodes) > 1 else ''}out of " + "; ".join(short)

