"""Backpressure, retries, leases/reaper, right-sizing, warm-pool sizing, preemption."""

from __future__ import annotations

import pytest

from dsec.control.backpressure import Backpressure, retry_after_s
from dsec.control.leases import Lease, LeasedSandbox, reap_by_labels, reap_decisions
from dsec.control.preemption import select_victims, victims_on_node
from dsec.control.retry import RetryBudget, backoff_s, should_retry
from dsec.control.rightsize import RightSizer
from dsec.control.types import HIGH, LOW, MEDIUM, Node, Running
from dsec.control.warmpool import Member, PoolDemand, plan_pools

from .helpers import GIB, req, settings

SHAPE = ("img", "container", 2.0, 4 * GIB, 10 * GIB, False)


def test_backpressure_hysteresis() -> None:
    """On at 80 % depth, stays on until below 60 %, then off; counts incidents."""
    bp = Backpressure(settings(queue_capacity=100))
    assert not bp.update(79)
    assert bp.update(80)
    assert bp.update(61)
    assert not bp.update(59)
    assert bp.update(85) and bp.incidents == 2


def test_backpressure_rejects_bad_watermarks() -> None:
    """Low watermark above high is a configuration error."""
    with pytest.raises(ValueError, match="queue_low_watermark"):
        Backpressure(settings(queue_low_watermark=0.9, queue_high_watermark=0.8))


def test_retry_after_is_time_to_drain_to_low_watermark() -> None:
    """Retry-After = (depth - low x capacity) / drain rate, clamped, rounded up to 0.1 s."""
    s = settings(queue_capacity=1000)
    assert retry_after_s(900, s, drain_rate=100.0) == 3.0
    assert retry_after_s(601, s, drain_rate=1e6) == s.retry_after_min_s
    assert retry_after_s(900, s, drain_rate=0.0) == s.retry_after_max_s
    assert retry_after_s(10**9, s, drain_rate=1.0) == s.retry_after_max_s


def test_backoff_doubles_and_caps() -> None:
    """Capped exponential backoff."""
    s = settings(retry_backoff_s=0.1, retry_backoff_max_s=0.3)
    assert [backoff_s(a, s) for a in (1, 2, 3, 4)] == [0.1, 0.2, 0.3, 0.3]


def test_retry_budget_limits_storms() -> None:
    """Beyond the minimum, retries are capped at ratio x first attempts."""
    s = settings(retry_budget_ratio=0.1, retry_max_attempts=5)
    b = RetryBudget(s, min_retries=2)
    for _ in range(10):
        b.first_attempt()
    assert [should_retry(1, True, b, s) is not None for _ in range(4)] == [True, True, False, False]
    assert should_retry(1, False, RetryBudget(s), s) is None
    assert should_retry(5, True, RetryBudget(s), s) is None


def test_reap_reasons() -> None:
    """TTL passed, owner silent for N heartbeats, and owner unknown are reaped; others kept."""
    s = settings(heartbeat_interval_s=10, heartbeat_misses=3)
    leases = {"alive": Lease("alive", 95.0), "silent": Lease("silent", 60.0)}
    sbs = [LeasedSandbox("ttl", "alive", 99.0), LeasedSandbox("ok", "alive", 200.0),
           LeasedSandbox("quiet", "silent", 200.0), LeasedSandbox("orphan", "gone", 200.0),
           LeasedSandbox("pool", None, None)]
    got = {d.sandbox_id: d.reason for d in reap_decisions(100.0, sbs, leases, s)}
    assert got == {"ttl": "ttl", "quiet": "lease_expired", "orphan": "no_lease"}


def test_bulk_reap_by_label_needs_selector() -> None:
    """Bulk reap selects by all labels and refuses an empty selector."""
    sbs = [LeasedSandbox("a", None, None, {"run": "r1", "task": "x"}), LeasedSandbox("b", None, None, {"run": "r2"})]
    assert [d.sandbox_id for d in reap_by_labels(sbs, {"run": "r1"})] == ["a"]
    with pytest.raises(ValueError, match="selector"):
        reap_by_labels(sbs, {})


def test_rightsizing_lowers_raises_and_flags() -> None:
    """p95 x headroom; lowered toward use (floored), raised at most 2x, then abnormal."""
    s = settings(rightsize_min_samples=3, rightsize_headroom=1.0)
    r = RightSizer(s)
    assert r.adjust("t", 4.0, 8 * GIB) == (4.0, 8 * GIB, False)  # no history yet
    for _ in range(5):
        r.observe("t", 1.0, 2 * GIB)
    assert r.adjust("t", 4.0, 8 * GIB) == (1.0, 2 * GIB, False)
    for _ in range(20):
        r.observe("big", 9.0, 1 * GIB)
    cpu, _, abnormal = r.adjust("big", 4.0, 8 * GIB)
    assert cpu == 8.0 and abnormal
    for _ in range(5):
        r.observe("tiny", 0.01, 1)
    assert r.adjust("tiny", 4.0, 8 * GIB)[0] == 4.0 * s.rightsize_min_fraction


def test_pool_target_is_peak_times_factor() -> None:
    """Target = ceil(peak acquisitions per refill bucket over the window x 1.2)."""
    d = PoolDemand(settings(warm_pool_refill_s=5, warm_pool_window_s=60, warm_pool_factor=1.2))
    for i in range(10):
        d.observe(1.0 + i * 0.1, SHAPE, "t")
    for i in range(3):
        d.observe(12.0 + i, SHAPE, "t")
    assert d.targets(20.0) == {SHAPE: 12}
    assert d.targets(65.0) == {SHAPE: 4}  # the 10-burst left the window
    assert d.targets(200.0) == {}


def test_pool_factor_zero_turns_demand_pools_off_but_keeps_floors() -> None:
    """warm_pool_factor=0 means no demand-driven members (it gave 1 per shape seen); an
    operator's declared floor still holds."""
    d = PoolDemand(settings(warm_pool_factor=0.0))
    for i in range(10):
        d.observe(1.0 + i * 0.1, SHAPE, "t")
    assert not any(d.targets(2.0).values()) and d.target(2.0, SHAPE) == 0
    d.set_floor(SHAPE, 2)
    assert d.target(2.0, SHAPE) == 2


def test_pool_demand_bounded_per_tenant_and_total() -> None:
    """One tenant's demand counts at most warm_pool_max_per_tenant; the total is capped."""
    d = PoolDemand(settings(warm_pool_max_per_tenant=2, warm_pool_factor=1.0, warm_pool_max_total=3))
    for i in range(10):
        d.observe(0.0, SHAPE, "greedy")
    assert d.targets(0.0) == {SHAPE: 2}
    other = ("b",) + SHAPE[1:]
    d.observe(0.0, other, "x")
    d.observe(0.0, other, "y")
    assert sum(d.targets(0.0).values()) <= 3


def test_plan_expires_idle_and_changed_members_and_trims_surplus() -> None:
    """Idle-expired and old-version members are destroyed; surplus oldest first; gaps created."""
    s = settings(warm_pool_max_idle_s=100)
    ms = [Member("old", "n", SHAPE, 0.0, "v1"), Member("stale", "n", SHAPE, 150.0, "v0"),
          Member("a", "n", SHAPE, 150.0, "v1"), Member("b", "n", SHAPE, 160.0, "v1")]
    plan = plan_pools(200.0, {SHAPE: 1}, {SHAPE: ms}, {}, {"img": "v1"}, s)
    assert sorted(plan.destroy) == [("a", "surplus"), ("old", "idle_expired"), ("stale", "image_changed")]
    plan = plan_pools(200.0, {SHAPE: 5}, {SHAPE: ms[2:]}, {SHAPE: 1}, {"img": "v1"}, s)
    assert plan.create == {SHAPE: 2} and not plan.destroy


def _running(sid: str, prio: int, started: float, pool: bool = False, cpu: float = 4) -> Running:
    return Running(sid, "n0", "t", prio, cpu, 4 * GIB, 10 * GIB, None, started, pool=pool)


def test_victims_pool_first_then_lowest_priority_newest() -> None:
    """Idle pool members go first, then low before medium, newest first; never equal/higher."""
    node = Node("n0", 8, 64 * GIB, 500 * GIB, used_cpu=12, count=3, used_memory=12 * GIB, used_disk=30 * GIB)
    res = [_running("pool", LOW, 0, pool=True), _running("low-old", LOW, 1), _running("low-new", LOW, 2),
           _running("med", MEDIUM, 3)]
    node.used_cpu = 16
    v = victims_on_node(node, req("h", cpu=4, priority=HIGH), res, 1.0, True)
    assert [r.sandbox_id for r in v] == ["pool", "low-new", "low-old"]  # type: ignore[union-attr]
    assert victims_on_node(node, req("m", cpu=4, priority=MEDIUM), res, 1.0, False) is None
    assert victims_on_node(node, req("l", cpu=4, priority=LOW), res, 1.0, True) is None


def test_select_victims_prefers_node_with_fewest_running_victims() -> None:
    """A node freed by evicting pool members beats one needing a preemption; hot nodes are skipped."""
    a = Node("a", 4, 64 * GIB, 500 * GIB, used_cpu=4, count=1)
    b = Node("b", 4, 64 * GIB, 500 * GIB, used_cpu=4, count=1)
    hot = Node("hot", 4, 64 * GIB, 500 * GIB, used_cpu=4, count=1, predicted=0.9)
    res = {"a": {"x": _running("x", LOW, 0)}, "b": {"p": _running("p", LOW, 0, pool=True)},
           "hot": {"q": _running("q", LOW, 0, pool=True)}}
    node, v = select_victims(req("h", cpu=4, priority=HIGH), [hot, a, b], res, 1.0, 0.85, True)  # type: ignore[misc]
    assert node.node_id == "b" and [r.sandbox_id for r in v] == ["p"]


def test_plan_trims_only_beyond_hysteresis() -> None:
    """A target dipping a little below the pool size destroys nothing (no rebuild churn)."""
    s = settings(warm_pool_trim_factor=1.5)
    ms = [Member(f"m{i}", "n", SHAPE, 10.0 + i, "v1") for i in range(5)]
    assert plan_pools(20.0, {SHAPE: 4}, {SHAPE: ms}, {}, {"img": "v1"}, s).destroy == []
    assert [d for d, _ in plan_pools(20.0, {SHAPE: 2}, {SHAPE: ms}, {}, {"img": "v1"}, s).destroy] == ["m0", "m1"]
