"""The Scheduler facade: validation, idempotency, backpressure, retries, pools, preemption, leases."""

from __future__ import annotations

import pytest

from dsec.control.tenants import Quota
from dsec.control.types import HIGH, LOW
from dsec.errors import InvalidArgument, NotFound, Overloaded, QuotaExceeded

from .helpers import GIB, req, sched


def place_all(s, now: float) -> list:  # type: ignore[no-untyped-def]
    out = s.next_batch(now)
    for p in out:
        if p.kind in ("create", "pool"):
            s.on_created(p.request.request_id, f"sb-{p.request.request_id}", now)
    return out


@pytest.mark.parametrize("kw,match", [
    ({"cpu": 64}, "largest node: cpu=16"),
    ({"gpu": "mig-7g.80gb"}, "GPU type 'mig-7g.80gb' exists on no node"),
    ({"isolation": "kata"}, "unknown isolation tier 'kata'"),
    ({"image": "nope"}, "unknown image 'nope'"),
    ({"selector": {"zone": "mars"}}, "no node can ever hold"),
])
def test_impossible_requests_rejected_at_submit(kw: dict, match: str) -> None:
    """Requests no node could ever run fail at submit with the reason, never queue forever."""
    s = sched()
    with pytest.raises(InvalidArgument, match=match):
        s.submit(req("r1", **kw), 0.0)
    assert len(s.queues) == 0


def test_over_quota_names_the_quota() -> None:
    """A request above the tenant's cpu quota is refused naming that quota."""
    s = sched()
    s.set_quota("t1", Quota(10, cpu=1.0, memory=100 * GIB))
    with pytest.raises(QuotaExceeded, match="cpu quota"):
        s.submit(req("r1", cpu=2), 0.0)


def test_idempotent_by_request_id() -> None:
    """Submitting the same request id twice yields one placement and one sandbox."""
    s = sched()
    s.submit(req("r1"), 0.0)
    s.submit(req("r1"), 0.01)
    out = place_all(s, 0.05)
    assert len(out) == 1
    s.submit(req("r1"), 1.0)
    assert s.next_batch(1.05) == [] and s.ticket("r1").state == "created"
    assert s.stats["duplicates"] == 2


def test_backpressure_refuses_low_and_medium_but_queues_high() -> None:
    """Above the high watermark non-high requests get Overloaded with a Retry-After."""
    s = sched(nodes=1, cpu=1, queue_capacity=10)
    for i in range(8):
        s.submit(req(f"r{i}", cpu=1), 0.0)
    with pytest.raises(Overloaded) as e:
        s.submit(req("late", cpu=1), 0.0)
    assert e.value.details["retry_after"] > 0
    assert s.submit(req("vip", cpu=1, priority=HIGH), 0.0).state == "queued"
    assert s.parallel_limit() == int(s.s.node_parallel_creates * s.s.backpressure_parallel_boost)


def test_failed_create_retried_on_another_node_then_gives_up() -> None:
    """A failure excludes the node, retries after backoff, and fails after max attempts."""
    s = sched(nodes=4, retry_max_attempts=2)
    s.submit(req("r1"), 0.0)
    (p,) = s.next_batch(0.05)
    first = p.node_id
    t = s.on_failed("r1", 0.1, "boom")
    assert t.state == "queued"  # type: ignore[union-attr]
    assert s.next_batch(0.11) == []  # backoff not over
    (p2,) = s.next_batch(1.0)
    assert p2.node_id != first
    t = s.on_failed("r1", 1.1, "boom again")
    assert t.state == "failed" and "2 attempts" in t.error  # type: ignore[union-attr]
    assert all(n.used_cpu == 0 and n.inflight == 0 for n in s.cluster.node_list)


def test_warm_pool_hit_and_ttl_starts_at_handover() -> None:
    """Demand creates pool members; the next request takes one and its TTL starts then."""
    s = sched(pools=True)
    s.submit(req("r1"), 0.0)
    out = place_all(s, 0.05)
    assert [p.kind for p in out].count("pool") >= 1
    s.submit(req("r2", ttl=100.0), 50.0)
    (p,) = [x for x in s.next_batch(50.05) if x.kind == "warm"]
    r = s.running[p.sandbox_id]  # type: ignore[index]
    assert r.expires_at == pytest.approx(150.05) and r.request_id == "r2" and not r.pool
    assert s.ticket("r2").state == "created" and s.stats["warm_hits"] == 1


def test_pool_members_expire_when_image_version_changes() -> None:
    """A new image version turns existing pool members into destroy decisions."""
    s = sched(pools=True, warm_pool_plan_interval_s=1.0)
    s.submit(req("r1"), 0.0)
    place_all(s, 0.05)
    members = s.pools.size()  # type: ignore[union-attr]
    assert members > 0
    s.register_image("img", [("base", 1), ("new", 2)], version="v2")
    out = s.next_batch(5.0)
    assert sum(p.kind == "destroy" for p in out) == members


def test_node_lost_retries_pending_and_frees_running() -> None:
    """Losing a node retries its pending creations elsewhere and reports its sandboxes lost."""
    s = sched(nodes=2)
    s.submit(req("a"), 0.0)
    place_all(s, 0.05)
    node = s.ticket("a").node_id
    s.submit(req("b", selector={}), 0.1)
    (pb,) = s.next_batch(0.15)
    lost = s.node_lost(node, 0.2)  # type: ignore[arg-type]
    assert [r.request_id for r in lost] == ["a"]
    if pb.node_id == node:
        assert s.ticket("b").state == "queued"
    assert s.cluster.nodes[node].used_cpu == 0  # type: ignore[index]


def test_preemption_requeues_victim_for_resumption() -> None:
    """With no capacity a high request preempts a low one; the victim is re-queued with resume_of."""
    s = sched(nodes=1, cpu=4, overcommit_ratio=1.0)
    s.submit(req("low", cpu=4, priority=LOW), 0.0)
    place_all(s, 0.05)
    s.submit(req("vip", cpu=4, priority=HIGH), 1.0)
    (p,) = s.next_batch(1.05)
    assert p.preempt == ["sb-low"] and s.stats["preemptions"] == 1
    resumed = [r for r in s.pending.values() if r.resume_of == "sb-low"]
    assert len(resumed) == 1 and resumed[0].priority == LOW


def test_medium_never_preempts_and_low_waits() -> None:
    """Equal or higher priority sandboxes are never preempted."""
    s = sched(nodes=1, cpu=4, overcommit_ratio=1.0)
    s.submit(req("m1", cpu=4), 0.0)
    place_all(s, 0.05)
    s.submit(req("m2", cpu=4), 1.0)
    assert s.next_batch(1.05) == [] and s.ticket("m2").state == "queued"


def test_reaper_ttl_and_silent_owner() -> None:
    """TTL expiry and a silent lease owner both produce reap decisions; heartbeats keep alive."""
    s = sched(heartbeat_interval_s=10, heartbeat_misses=3)
    s.heartbeat("run-1", 0.0)
    s.submit(req("a", ttl=100.0, owner="run-1"), 0.0)
    s.submit(req("b", ttl=1000.0, owner="run-1"), 0.0)
    place_all(s, 0.05)
    assert s.reap(20.0) == []
    assert {(d.sandbox_id, d.reason) for d in s.reap(101.0)} == {("sb-a", "ttl"), ("sb-b", "lease_expired")}
    s.heartbeat("run-1", 100.0)
    assert [d.reason for d in s.reap(101.0)] == ["ttl"]
    assert [d.sandbox_id for d in s.reap_labels({"x": "y"})] == []


def test_ticket_position_eta_cancel_and_unknown() -> None:
    """Queued tickets carry a position; cancel withdraws and forgets the id (so it can be
    submitted again), refuses once placed; unknown ids are NotFound."""
    s = sched(nodes=1, cpu=2, overcommit_ratio=1.0)
    s.submit(req("a", cpu=2), 0.0)
    place_all(s, 0.05)
    s.submit(req("b", cpu=2), 0.1)
    s.submit(req("c", cpu=2), 0.1)
    s.next_batch(0.15)
    assert s.ticket("c").position == 1
    assert s.cancel("c")
    with pytest.raises(NotFound):
        s.ticket("c")
    assert s.depth() == 1 and not s.cancel("a")
    assert s.submit(req("c", cpu=2), 0.2).state == "queued"
    with pytest.raises(NotFound):
        s.ticket("zzz")


def test_rightsizing_applied_at_submit_and_abnormal_flagged() -> None:
    """After enough observed usage, a task type's requests are resized at submit."""
    s = sched(rightsize_min_samples=2)
    for i in range(3):
        s.rightsizer.observe("unit-tests", 9.0, 1 * GIB)
    s.submit(req("a", cpu=2, task_type="unit-tests"), 0.0)
    r = s.pending["a"]
    assert r.cpu == 4.0 and r.abnormal and s.stats["abnormal"] == 1


def test_pool_floor_builds_members_before_any_demand_and_survives_plans() -> None:
    """An operator-declared floor makes the pool pre-create that many members of the shape
    with no demand seen, keeps them across full plans, and 0 removes the floor."""
    s = sched(pools=True, warm_pool_plan_interval_s=1.0)
    s.set_pool_floor(req("shape"), 3)
    out = place_all(s, 0.05)
    assert [p.kind for p in out].count("pool") == 3 and s.pools.size() == 3  # type: ignore[union-attr]
    assert not [p for p in s.next_batch(5.0) if p.kind == "destroy"]
    s.set_pool_floor(req("shape"), 0)
    assert [p.kind for p in s.next_batch(10.0)].count("destroy") == 3


def test_take_warm_now_only_when_nobody_of_the_shape_waits_ahead() -> None:
    """The warm fast path hands a member over at submit, but never jumps a request of the
    same shape already queued (it came first: batching and fair share decide)."""
    s = sched(pools=True)
    s.set_pool_floor(req("shape"), 2)
    place_all(s, 0.05)
    s.submit(req("a"), 1.0)
    p = s.take_warm_now("a", 1.0)
    assert p is not None and p.kind == "warm" and s.ticket("a").state == "created"
    s.submit(req("b"), 1.1)
    s.submit(req("c"), 1.1)
    assert s.take_warm_now("c", 1.1) is None  # b of the same shape is queued ahead
    assert s.take_warm_now("b", 1.1) is None  # two of a shape waiting: the batch orders them
    assert s.ticket("b").state == "queued"


def test_task_label_without_history_keeps_the_declared_pool_shape() -> None:
    """A request naming a task type with no usage history is not re-rounded by the right-
    sizer, so it still matches (and takes from) a pool declared for its exact shape."""
    s = sched(pools=True)
    s.set_pool_floor(req("shape", cpu=0.125), 1)
    place_all(s, 0.05)
    s.submit(req("a", cpu=0.125, task_type="fib"), 1.0)
    p = s.take_warm_now("a", 1.0)
    assert p is not None and p.kind == "warm"


def test_right_sized_request_still_takes_from_the_pool_of_its_asked_shape() -> None:
    """Pools are keyed by what was asked: once a task type's history lowers its
    reservations, its requests still hit the pool declared (or grown) for the asked shape."""
    s = sched(pools=True, rightsize_min_samples=1)
    s.rightsizer.observe_cpu("fib", 0.01)
    s.set_pool_floor(req("shape"), 1)
    place_all(s, 0.05)
    s.submit(req("a", task_type="fib"), 1.0)
    assert s.pending["a"].cpu < 2 and s.pending["a"].asked == (2, 4 * GIB)
    p = s.take_warm_now("a", 1.0)
    assert p is not None and p.kind == "warm"
