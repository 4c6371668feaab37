"""Leases, TTLs and the reaper's decisions. Pure.

Every sandbox has a TTL (its wall-time budget, counted from hand-over to the user, not
from pre-creation in a warm pool) and an owner lease (a run id or client session) that
the owner renews with heartbeats. The reaper cleans what is past its TTL, whose owner
went silent for ``heartbeat_misses`` x ``heartbeat_interval_s``, or whose owner holds no
lease at all (leaked). Bulk reap selects by labels ("delete everything of run X").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsec.config import Settings, get_settings


@dataclass(slots=True)
class Lease:
    owner: str
    last_heartbeat: float


@dataclass(slots=True)
class LeasedSandbox:
    sandbox_id: str
    owner: str | None
    expires_at: float | None  # None: not handed out yet (pool member) -> no TTL yet
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class ReapDecision:
    sandbox_id: str
    reason: str  # ttl | lease_expired | no_lease | bulk


def reap_decisions(now: float, sandboxes: list[LeasedSandbox], leases: dict[str, Lease],
                   s: Settings | None = None) -> list[ReapDecision]:
    """Which sandboxes to clean now, and why (TTL first: it is the stronger reason)."""
    s = s or get_settings()
    silent = s.heartbeat_interval_s * s.heartbeat_misses
    out: list[ReapDecision] = []
    for sb in sandboxes:
        if sb.expires_at is not None and now >= sb.expires_at:
            out.append(ReapDecision(sb.sandbox_id, "ttl"))
        elif sb.owner is not None:
            lease = leases.get(sb.owner)
            if lease is None:
                out.append(ReapDecision(sb.sandbox_id, "no_lease"))
            elif now - lease.last_heartbeat > silent:
                out.append(ReapDecision(sb.sandbox_id, "lease_expired"))
    return out


def reap_by_labels(sandboxes: list[LeasedSandbox], selector: dict[str, str]) -> list[ReapDecision]:
    """Bulk reap: every sandbox whose labels contain all of ``selector``."""
    if not selector:
        raise ValueError("bulk reap needs a non-empty label selector (refusing to select everything)")
    return [ReapDecision(sb.sandbox_id, "bulk") for sb in sandboxes
            if all(sb.labels.get(k) == v for k, v in selector.items())]
