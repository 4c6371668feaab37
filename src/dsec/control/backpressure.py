"""Queue-depth backpressure with hysteresis, and the Retry-After a client is told. Pure.

Above ``queue_high_watermark`` x ``queue_capacity`` the scheduler turns backpressure on:
new low/medium requests are refused with ``Overloaded`` (HTTP 429 + Retry-After) and
per-node parallel creation is raised by ``backpressure_parallel_boost`` to drain faster.
It turns off only below ``queue_low_watermark`` (hysteresis: no flapping at the edge).
High-priority requests are still queued until the queue is completely full.
"""

from __future__ import annotations

import math

from dsec.config import Settings


class Backpressure:
    __slots__ = ("active", "capacity", "high", "incidents", "low")

    def __init__(self, s: Settings) -> None:
        if not 0 < s.queue_low_watermark < s.queue_high_watermark <= 1:
            raise ValueError(
                f"need 0 < queue_low_watermark ({s.queue_low_watermark}) < queue_high_watermark "
                f"({s.queue_high_watermark}) <= 1")
        if s.queue_capacity <= 0:
            raise ValueError(f"queue_capacity must be > 0, got {s.queue_capacity}")
        self.capacity = s.queue_capacity
        self.high = s.queue_high_watermark * s.queue_capacity
        self.low = s.queue_low_watermark * s.queue_capacity
        self.active = False
        self.incidents = 0  # times backpressure switched on

    def update(self, depth: int) -> bool:
        """Feed the current queue depth; returns whether backpressure is on."""
        if not self.active and depth >= self.high:
            self.active = True
            self.incidents += 1
        elif self.active and depth < self.low:
            self.active = False
        return self.active


def retry_after_s(depth: int, s: Settings, drain_rate: float) -> float:
    """Seconds a refused client should wait: time to drain the queue to the low watermark.

    ``drain_rate`` is the measured placements/s; with no measurement yet we answer the cap.
    The result is clamped to [retry_after_min_s, retry_after_max_s] and rounded up to a
    tenth of a second so clients do not come back in lockstep with the drain estimate.
    """
    excess = depth - s.queue_low_watermark * s.queue_capacity
    if drain_rate <= 0:
        return s.retry_after_max_s
    wait = max(0.0, excess) / drain_rate
    wait = min(max(wait, s.retry_after_min_s), s.retry_after_max_s)
    return math.ceil(wait * 10) / 10
