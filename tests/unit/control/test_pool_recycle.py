"""Recycling in the scheduler (issue 15): a released sandbox of a pool shape the pool wants
becomes a pool member being made on the same node, holding the same allocation, instead
of a destroy plus a cold refill; otherwise nothing changes (the usual destroy path)."""

from __future__ import annotations

from .helpers import req, sched
from .test_scheduler import place_all


def _user_sandbox(s, rid: str, now: float):  # type: ignore[no-untyped-def]
    s.submit(req(rid), now)
    p = s.take_warm_now(rid, now)
    assert p is not None and p.kind == "warm"
    return s.running[p.sandbox_id]


def test_released_sandbox_refills_its_pool_with_the_same_allocation() -> None:
    """The user's charge ends, the node's allocation stays (now the pool request's), and
    on_created of the new id makes it a free member: no cold create is planned."""
    s = sched(pools=True)
    s.set_pool_floor(req("shape"), 2)
    place_all(s, 0.05)
    r = _user_sandbox(s, "a", 1.0)
    node = s.cluster.nodes[r.node_id]
    used = (node.used_cpu, node.used_memory, node.used_disk)
    pool_req = s.recycle(r.sandbox_id, 1.1)
    assert pool_req is not None and pool_req.tenant == "__pool__" and pool_req.shape == r.shape
    assert r.sandbox_id not in s.running and s.queues.tenants["t1"].cpu == 0  # the user holds nothing
    assert (node.used_cpu, node.used_memory, node.used_disk) == used and node.inflight == 1
    assert not [p for p in s.next_batch(1.2) if p.kind == "pool"]  # the recycled one is in flight
    s.on_created(pool_req.request_id, "sb-new", 1.3)
    assert s.pools.size() == 2 and s.running["sb-new"].pool  # type: ignore[union-attr]
    assert _user_sandbox(s, "b", 1.4).sandbox_id == "sb-new"  # handed out like any member (newest first)


def test_not_recycled_when_the_pool_is_full_or_the_shape_is_not_poolable() -> None:
    """A pool already at target, a gVisor or networked shape: recycle() says no and leaves
    every account as it was (the caller destroys the sandbox as before)."""
    s = sched(pools=True)
    s.set_pool_floor(req("shape"), 1)
    place_all(s, 0.05)
    r = _user_sandbox(s, "a", 1.0)
    place_all(s, 1.05)  # the pool refilled to its floor meanwhile
    assert s.pools.size() == 1  # type: ignore[union-attr]
    before = (s.cluster.nodes[r.node_id].used_cpu, s.queues.tenants["t1"].cpu)
    assert s.recycle(r.sandbox_id, 1.1) is None
    assert r.sandbox_id in s.running and (s.cluster.nodes[r.node_id].used_cpu, s.queues.tenants["t1"].cpu) == before
    for kw in ({"isolation": "gvisor"}, {"network": True}):
        s2 = sched(pools=True)
        s2.set_pool_floor(req("shape", **kw), 2)
        place_all(s2, 0.05)
        s2.submit(req("a", **kw), 1.0)
        p = s2.take_warm_now("a", 1.0)
        assert p is not None and s2.recycle(p.sandbox_id, 1.1) is None


def test_cold_created_sandboxes_are_not_recycled() -> None:
    """Only a member the pool handed out goes back: a sandbox created cold (a burst beyond
    the pool) is destroyed as before, so a burst never turns into a pool holding the node."""
    s = sched(pools=True)
    s.set_pool_floor(req("shape"), 2)
    place_all(s, 0.05)
    s.submit(req("cold", cold=True), 1.0)
    placed = place_all(s, 1.05)
    sid = next(f"sb-{p.request.request_id}" for p in placed if p.kind == "create")
    assert s.running[sid].shape == req("shape").shape and s.recycle(sid, 1.1) is None
    assert sid in s.running


def test_declared_floor_takes_room_from_demand_driven_members() -> None:
    """A node full of demand-driven members of one shape (as recycling leaves it at once)
    does not starve an operator's declared pool of another shape: members above their own
    floor are destroyed to make room for it."""
    s = sched(nodes=1, cpu=2, pools=True, warm_pool_max_per_node=1000)
    s.set_pool_floor(req("a", cpu=0.5), 10)  # 10 x 0.5 cpu: the 2-CPU node's whole bound (x1.3 = 2.6)
    place_all(s, 0.05)
    s.set_pool_floor(req("a", cpu=0.5), 0)  # now only demand-driven (no floor), still held
    assert s.pools.size() == 5  # type: ignore[union-attr]  # 5 x 0.5 = 2.5 of 2.6
    s.set_pool_floor(req("b", cpu=0.25), 2)
    out = place_all(s, 0.1)
    kinds = [p.kind for p in out]
    assert kinds.count("pool") == 2 and kinds.count("destroy") >= 1, kinds
    b = req("b", cpu=0.25).shape
    assert len(s.pools.free[b]) == 2  # type: ignore[union-attr]


def test_warm_fast_path_goes_ahead_only_with_members_to_spare() -> None:
    """One request of a shape waiting for the next batch no longer holds back every later
    request of that shape while the pool has members for all of them; with exactly as
    many members as requests waiting ahead, the later one still waits its turn."""
    s = sched(pools=True)
    s.set_pool_floor(req("shape"), 3)
    place_all(s, 0.05)
    s.submit(req("b"), 1.0)  # queued: its own fast path did not run (e.g. the pool was empty then)
    s.submit(req("c"), 1.0)
    p = s.take_warm_now("c", 1.0)
    assert p is not None and p.kind == "warm" and s.ticket("b").state == "queued"
    s.submit(req("d"), 1.1)
    s.submit(req("e"), 1.1)
    assert s.take_warm_now("e", 1.1) is None  # 2 members left, b and d ahead of it


def test_ready_member_goes_to_the_request_waiting_for_it() -> None:
    """When a member becomes ready while one request of its shape waits for the next
    batch, that request may take it at once (first_waiting + take_warm_now, as the driver
    does on every member that becomes ready); with two waiting, the batch orders them."""
    s = sched(pools=True)
    s.set_pool_floor(req("shape"), 1)
    place_all(s, 0.05)
    first = _user_sandbox(s, "a", 1.0)  # the only member is taken
    s.submit(req("b"), 1.1)
    assert s.take_warm_now("b", 1.1) is None  # no member
    pool_req = s.recycle(first.sandbox_id, 1.3)
    assert pool_req is not None
    s.on_created(pool_req.request_id, "sb-back", 1.4)
    rid = s.first_waiting(req("shape").shape)
    assert rid == "b"
    p = s.take_warm_now(rid, 1.4)
    assert p is not None and p.sandbox_id == "sb-back"
    second = s.running["sb-back"]
    s.submit(req("c"), 1.5)
    s.submit(req("d"), 1.5)
    s.on_created(s.recycle(second.sandbox_id, 1.6).request_id, "sb-again", 1.7)  # type: ignore[union-attr]
    assert s.take_warm_now(s.first_waiting(req("shape").shape), 1.7) is None  # type: ignore[arg-type]
