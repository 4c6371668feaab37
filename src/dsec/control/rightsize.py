"""Elastic right-sizing from per-task-type usage history. Pure.

After ``rightsize_min_samples`` observations of a task type, its next requests ask for
observed p95 x ``rightsize_headroom``: lowered toward real use (never below
``rightsize_min_fraction`` of what was asked), or raised at most ``rightsize_max_factor``
x; a type whose need exceeds that is flagged abnormal (capped, reported) rather than
raised without bound.
"""

from __future__ import annotations

from collections import deque

from dsec.config import Settings

_HISTORY = 256  # samples kept per task type; enough for a stable p95


def _p95(xs: deque[float]) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(0.95 * len(ys)))]


class RightSizer:
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.cpu: dict[str, deque[float]] = {}
        self.memory: dict[str, deque[float]] = {}

    def observe(self, task_type: str, cpu_peak: float, memory_peak: int) -> None:
        if cpu_peak < 0 or memory_peak < 0:
            raise ValueError(f"task type {task_type!r}: usage must be >= 0")
        self.cpu.setdefault(task_type, deque(maxlen=_HISTORY)).append(cpu_peak)
        self.memory.setdefault(task_type, deque(maxlen=_HISTORY)).append(float(memory_peak))

    def observe_cpu(self, task_type: str, cpu_used: float) -> None:
        """CPU use only (the real server: memory requests stay as asked, since a pool member's
        memory limit is its shape's)."""
        if cpu_used < 0:
            raise ValueError(f"task type {task_type!r}: usage must be >= 0")
        self.cpu.setdefault(task_type, deque(maxlen=_HISTORY)).append(cpu_used)

    def _one(self, hist: deque[float] | None, asked: float) -> tuple[float, bool]:
        s = self.s
        if hist is None or len(hist) < s.rightsize_min_samples:
            return asked, False
        want = _p95(hist) * s.rightsize_headroom
        hi = asked * s.rightsize_max_factor
        lo = asked * s.rightsize_min_fraction
        if want > hi:
            return hi, True
        return max(lo, want), False

    def adjust(self, task_type: str | None, cpu: float, memory: int) -> tuple[float, int, bool]:
        """Right-sized (cpu, memory, abnormal) for a request of ``task_type``."""
        if task_type is None:
            return cpu, memory, False
        c, ab1 = self._one(self.cpu.get(task_type), cpu)
        m, ab2 = self._one(self.memory.get(task_type), float(memory))
        # Round a changed CPU to 1/100 so right-sized requests still group into few pool
        # shapes; an unchanged request keeps its exact shape (it must match declared pools).
        return (cpu if c == cpu else round(c, 2)), (memory if m == memory else int(m)), ab1 or ab2
