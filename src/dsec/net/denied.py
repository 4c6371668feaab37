"""Bounding a sandbox's denied connection attempts for its audit log (pure, no I/O).

A sandbox that scans ports or retries in a loop can be refused thousands of times; its
audit log must stay readable and small. ``DeniedTally`` turns the node's stream of
``DeniedAttempt`` into: one itemized record for the first attempt to each of the first
``max_distinct`` destinations (destination, protocol, port, target), plain counts for
repeats, one counter for everything past the cap, and a summary at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dsec.net.models import DeniedAttempt

Key = tuple[str, str, int | None, str]  # destination, protocol, port, target


def attempt_key(e: DeniedAttempt) -> Key:
    return (e.destination, e.protocol, e.port, e.target)


@dataclass
class DeniedTally:
    """Per-sandbox state; feed it with ``add`` (any order, repeats ignored by ``seq``)."""

    max_distinct: int
    last_seq: int = 0
    total: int = 0
    counts: dict[Key, int] = field(default_factory=dict)  # never more than max_distinct keys
    not_itemized: int = 0  # attempts to destinations past the cap

    def add(self, events: Iterable[DeniedAttempt]) -> list[DeniedAttempt]:
        """Count the attempts newer than ``last_seq``; return those to itemize (the first
        attempt to each destination not seen before, while under the cap)."""
        new: list[DeniedAttempt] = []
        for e in sorted(events, key=lambda a: a.seq):
            if e.seq <= self.last_seq:
                continue
            self.last_seq = e.seq
            self.total += 1
            k = attempt_key(e)
            if k in self.counts:
                self.counts[k] += 1
            elif len(self.counts) < self.max_distinct:
                self.counts[k] = 1
                new.append(e)
            else:
                self.not_itemized += 1
        return new

    def summary(self, top: int | None = None) -> dict[str, Any]:
        """Totals and per-destination counts, most refused first (at most ``top``)."""
        ranked = sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0][0], kv[0][2] or 0))
        return {
            "total": self.total,
            "destinations": len(self.counts),
            "not_itemized": self.not_itemized,
            "counts": [{"destination": d, "protocol": p, "port": port, "target": t, "count": n}
                       for (d, p, port, t), n in ranked[:top]],
        }


def itemized_fields(e: DeniedAttempt) -> dict[str, Any]:
    """The audit record of one itemized attempt."""
    return {"destination": e.destination, "port": e.port, "protocol": e.protocol, "target": e.target,
            "time": e.time}
