"""Tenant level: priority classes, aging, weighted DRF, quotas, positions."""

from __future__ import annotations

import pytest

from dsec.control.tenants import Quota, TenantQueues
from dsec.control.types import HIGH, LOW, MEDIUM
from dsec.errors import QuotaExceeded

from .helpers import GIB, req, settings


def queues(**kw: object) -> TenantQueues:
    q = TenantQueues(settings(**kw))
    q.total_cpu, q.total_memory = 100.0, 400 * GIB
    return q


def test_higher_priority_first() -> None:
    """Within a tenant, high goes before medium before low."""
    q = queues()
    for rid, p in (("l", LOW), ("m", MEDIUM), ("h", HIGH)):
        q.push(req(rid, priority=p, submitted_at=0.0))
    assert [q.pop_next(1.0).request_id for _ in range(3)] == ["h", "m", "l"]  # type: ignore[union-attr]


def test_aging_promotes_waiting_low_priority() -> None:
    """A low request queued for 2 aging periods competes as high and, being older, wins."""
    q = queues(priority_aging_s=10.0)
    q.push(req("old-low", priority=LOW, submitted_at=0.0))
    q.push(req("new-high", priority=HIGH, submitted_at=19.0))
    assert q.pop_next(20.0).request_id == "old-low"  # type: ignore[union-attr]


def test_drf_picks_tenant_with_lowest_weighted_share() -> None:
    """The tenant using less of the cluster (per unit of weight) goes first."""
    q = queues()
    q.charge("big", 50, 10 * GIB, 1)
    q.charge("small", 5, 10 * GIB, 1)
    q.push(req("b1", tenant="big", submitted_at=0.0))
    q.push(req("s1", tenant="small", submitted_at=1.0))
    assert q.pop_next(2.0).request_id == "s1"  # type: ignore[union-attr]
    q.set_quota("big", Quota(100, 1000, 1000 * GIB, weight=20.0))
    q.push(req("s2", tenant="small", submitted_at=1.0))
    assert q.pop_next(2.0).request_id == "b1"  # type: ignore[union-attr]


def test_tenant_at_quota_waits_without_blocking_others() -> None:
    """A tenant at its concurrency quota is skipped; other tenants proceed."""
    q = queues()
    q.set_quota("a", Quota(max_sandboxes=1, cpu=100, memory=100 * GIB))
    q.charge("a", 2, 4 * GIB, 1)
    q.push(req("a1", tenant="a", submitted_at=0.0))
    q.push(req("b1", tenant="b", submitted_at=5.0))
    assert q.pop_next(6.0).request_id == "b1"  # type: ignore[union-attr]
    assert q.pop_next(6.0) is None
    q.charge("a", 2, 4 * GIB, -1)
    assert q.pop_next(6.0).request_id == "a1"  # type: ignore[union-attr]


def test_quota_errors_name_the_quota() -> None:
    """A request larger than the tenant's quota, or a full tenant queue, is refused clearly."""
    q = queues(tenant_max_queued=1)
    q.set_quota("a", Quota(10, cpu=4, memory=100 * GIB))
    with pytest.raises(QuotaExceeded, match="cpu quota") as e:
        q.check_quota(req("x", tenant="a", cpu=8))
    assert e.value.details["quota"] == "cpu"
    q.push(req("y", tenant="a"))
    with pytest.raises(QuotaExceeded, match="tenant_max_queued"):
        q.check_quota(req("z", tenant="a"))


def test_position_counts_higher_classes_and_sharing_tenants() -> None:
    """Queue position: everything of a higher class, plus own-queue rank x sharing tenants."""
    q = queues()
    q.push(req("h", tenant="b", priority=HIGH))
    mine = [req(f"m{i}", tenant="a") for i in range(3)]
    for r in mine:
        q.push(r)
    q.push(req("bm", tenant="b"))
    assert q.position(mine[0]) == 1
    assert q.position(mine[2]) == 1 + 2 * 2


def test_remove_and_weight_validation() -> None:
    """Cancelled requests leave the queue; a zero weight is refused."""
    q = queues()
    r = req("a")
    q.push(r)
    assert q.remove(r) and len(q) == 0 and not q.remove(r)
    with pytest.raises(ValueError, match="weight"):
        q.set_quota("t", Quota(1, 1, 1, weight=0))
