"""Scheduler leadership on both state stores (issue 13): one leader at a time, elected
through the ``scheduler`` lease, and a node fence that a deposed leader cannot pass.

Two ``SchedulerDriver``s (two API servers) share one store and one in-memory node
(``FakeNodeAgent``, which uses the node's own ``FenceGate``). Their clocks are separate
fakes, so a paused or skewed leader that still *believes* it leads can be staged exactly.
"""

from __future__ import annotations

import asyncio

import pytest

from dsec import errors
from dsec.config import Settings
from dsec.control.driver import SchedulerDriver
from dsec.control.leader import LEASE_NAME, LeaderElector, lease_still_valid, solo_start_time
from dsec.control.scheduler import Scheduler
from dsec.models import SandboxSpec
from dsec.state import StateStore
from dsec.state.store import Lease
from dsec.testing import FakeNodeAgent

TTL = 3.0


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _settings() -> Settings:
    return Settings(batch_window_s=0.01, scheduler_lease_ttl_s=TTL, scheduler_lease_renew_s=0.5)


async def _server(store: StateStore, node: FakeNodeAgent, clock: Clock, url: str,
                  pools: bool = False) -> SchedulerDriver:
    s = _settings()
    d = SchedulerDriver(Scheduler(s, pools=pools), {node.node_id: node}, s)
    d.attach_leader(LeaderElector(store, s, solo=False, clock=clock), None)
    await d.start()
    d.leader.holder = url  # type: ignore[union-attr]
    await d.leader.step()  # type: ignore[union-attr]  # one election step (the loop is not started)
    return d


def _spec(rid: str) -> SandboxSpec:
    return SandboxSpec(image="busybox", cpu=0.5, memory="256M", disk="1G", request_id=rid)


async def test_two_leaders_racing_the_fence_wins(store: StateStore) -> None:
    """A leads (token 1). A pauses past its lease; B takes over (token 2) and raises the
    fence on the node. A, whose clock says it still leads, tries to place and to destroy:
    the node refuses both with LeaderFenced, A steps down, nothing is made; B places."""
    node = FakeNodeAgent(node_id="n0", isolation=("container",))
    ca, cb = Clock(), Clock()
    a = await _server(store, node, ca, "http://a")
    b = await _server(store, node, cb, "http://b")
    try:
        assert a.leader.is_leader and a.leading() and a.leader.token == 1  # type: ignore[union-attr]
        assert not b.leader.is_leader and b.leader.leader_url == "http://a"  # type: ignore[union-attr]
        made = await a.place_here(_spec("r1"), "sb-a1", "t1")
        assert node.fence.highest == 1 and made.id == "sb-a1"

        cb.t += TTL + 0.1  # A renews no more (paused); its clock stands still: it believes it leads
        await b.leader.step()  # type: ignore[union-attr]
        assert b.leader.is_leader and b.leader.token == 2 and b.leading()  # type: ignore[union-attr]
        assert node.fence.highest == 2  # raised by B's takeover, before B placed anything
        assert a.leader.is_leader  # type: ignore[union-attr]  # the stale belief the fence is for

        with pytest.raises(errors.LeaderFenced, match="below 2"):
            await node.create(_spec("x"), sandbox_id="sb-direct", tenant="t1", fence=1)
        with pytest.raises(errors.NotLeader):
            await a.place_here(_spec("r2"), "sb-a2", "t1")  # refused on the node -> A steps down
        assert not a.leader.is_leader and not a.leading()  # type: ignore[union-attr]
        with pytest.raises(errors.LeaderFenced):
            await node.destroy("sb-a1", fence=1)
        assert set(node.sandboxes) == {"sb-a1"}  # A made nothing more and destroyed nothing

        info = await b.place_here(_spec("r3"), "sb-b1", "t1")
        assert info.id == "sb-b1" and set(node.sandboxes) == {"sb-a1", "sb-b1"}
        assert "sb-a1" in b.sched.running  # B's view was rebuilt from the node at takeover
    finally:
        await a.close()
        await b.close()


async def test_follower_takes_over_when_leader_stops_renewing(store: StateStore) -> None:
    """The leader's lease ends TTL after its last renewal: before that no other server can
    take it, right after it the next try does, and the takeover time is recorded."""
    node = FakeNodeAgent(node_id="n0", isolation=("container",))
    ca, cb = Clock(), Clock()
    a = await _server(store, node, ca, "http://a")
    b = await _server(store, node, cb, "http://b")
    try:
        cb.t += TTL - 0.5
        await b.leader.step()  # type: ignore[union-attr]
        assert not b.leader.is_leader  # type: ignore[union-attr]
        cb.t += 0.6
        await b.leader.step()  # type: ignore[union-attr]
        assert b.leader.is_leader and b.leader.view().leader == "http://b"  # type: ignore[union-attr]
        assert b.leader.last_takeover_s == pytest.approx(TTL + 0.1, abs=0.01)  # type: ignore[union-attr]
        assert (await store.lease_get(LEASE_NAME)).token == 2  # type: ignore[union-attr]
        ca.t = cb.t
        assert not a.leader.is_leader  # type: ignore[union-attr]  # its own clock: lease over
    finally:
        await a.close()
        await b.close()


async def test_solo_server_leads_at_once_over_a_dead_predecessor(store: StateStore) -> None:
    """The embedded single server leads from its start even when a previous process left
    an unexpired lease (its token is higher, so that process's calls would be fenced)."""
    await store.lease_acquire(LEASE_NAME, "old-process", 60.0, 1000.0)
    node = FakeNodeAgent(node_id="n0", isolation=("container",))
    s = _settings()
    d = SchedulerDriver(Scheduler(s, pools=False), {"n0": node}, s)
    d.attach_leader(LeaderElector(store, s, solo=True, clock=Clock(1001.0)), None)
    await d.start()
    try:
        assert d.leading() and d.leader.token == 2 and node.fence.highest == 2  # type: ignore[union-attr]
        assert (await d.create(_spec("r"), "sb-1", "t1")).id == "sb-1"
    finally:
        await d.close()


def test_lease_decisions_are_pure() -> None:
    assert lease_still_valid(102.9, 100.0, 3.0) and not lease_still_valid(103.0, 100.0, 3.0)
    old = Lease(name="scheduler", holder="x", token=4, expires_at=50.0)
    assert solo_start_time(10.0, old, "me") == pytest.approx(50.001)
    assert solo_start_time(10.0, old, "x") == 10.0 and solo_start_time(10.0, None, "me") == 10.0


async def test_control_records_outlive_the_leader(store: StateStore) -> None:
    """What a new leader cannot learn from the nodes comes from the state store: an owner
    heartbeating through a follower is not reaped by the leader; an owner released through
    a follower has its sandboxes reaped by the leader; a pool floor set on one server is
    applied by a leader elected later. (Before: all three lived in one process's memory.)"""
    from dsec.control.book import ControlBook
    from dsec.control.convert import lease_key

    node = FakeNodeAgent(node_id="n0", isolation=("container",))
    ca, cb = Clock(), Clock()
    a = await _server(store, node, ca, "http://a")
    b = await _server(store, node, cb, "http://b", pools=True)
    a.book, b.book = ControlBook(store), ControlBook(store)
    try:
        owner = lease_key("t1", "run-1")
        await a.place_here(_spec("r1").model_copy(update={"owner": "run-1"}), "sb-o1", "t1")
        assert a.sched.owned_by(owner) == ["sb-o1"]
        b.heartbeat(owner)  # reaches the follower only
        await asyncio.sleep(0.05)  # the follower's write is spawned
        a.sched.leases[owner].last_heartbeat = a.clock() - 1e6  # the leader itself heard nothing for ages
        await a._sync_book()
        assert a.clock() - a.sched.leases[owner].last_heartbeat < 60  # the follower's heartbeat counts
        assert not [d for d in a.sched.reap(a.clock()) if d.sandbox_id == "sb-o1"]

        assert await b.release_owner(owner) == []  # a follower leaves the reaping to the leader
        await a._sync_book()
        assert "sb-o1" not in node.sandboxes and not await a.book.owners()

        floor = SandboxSpec(image="busybox", cpu=0.5, memory="256M", disk="1G")
        b.set_pool(floor, 2)  # on the follower
        await asyncio.sleep(0.05)
        c = await _server(store, node, Clock(cb.t), "http://c", pools=True)  # a later server
        c.book = ControlBook(store)
        try:
            await c._sync_book()
            assert 2 in c.sched.pools.demand.floors.values()  # type: ignore[union-attr]
            b.set_pool(floor, 0)  # removed on another server: gone here too
            await asyncio.sleep(0.05)
            await c._sync_book()
            assert not any(c.sched.pools.demand.floors.values())  # type: ignore[union-attr]
        finally:
            await c.close()
    finally:
        await a.close()
        await b.close()


async def test_new_leader_queues_recorded_preemptions_again(store: StateStore) -> None:
    """A victim the previous leader checkpointed and stopped (its record in the store) is
    still answered as preempted by the new leader, which queues its resumption again."""
    from dsec.control.book import ControlBook, PreemptedDoc

    book = ControlBook(store)
    await book.preempted("sb-victim", PreemptedDoc(tenant="t1", checkpoint_id="ck-1",
                                                   spec=SandboxSpec(image="busybox", cpu=0.5, memory="256M")))
    node = FakeNodeAgent(node_id="n0", isolation=("container",))
    s = _settings()
    d = SchedulerDriver(Scheduler(s, pools=False), {"n0": node}, s)
    d.book = ControlBook(store)
    d.attach_leader(LeaderElector(store, s, solo=False, clock=Clock()), None)
    await d.start()
    try:
        d.leader.holder = "http://new"  # type: ignore[union-attr]
        await d.leader.step()  # type: ignore[union-attr]
        assert d.preempted("sb-victim") is not None
        assert [r.resume_of for r in d.sched.pending.values()] == ["sb-victim"]
        assert await d.forget_preempted("sb-victim") and not await book.all_preempted()
    finally:
        await d.close()


async def test_takeover_from_a_dead_leader_is_a_compare_and_set(store: StateStore) -> None:
    """A follower whose connection to the leader is refused takes the lease at once (no
    TTL wait), with a higher token; only from the holder it names, so of two followers
    racing to replace the same dead leader exactly one wins, and a stale name takes nothing."""
    await store.lease_acquire(LEASE_NAME, "http://a", 60.0, 1000.0)
    got = await asyncio.gather(store.lease_takeover(LEASE_NAME, "http://b", "http://a", 3.0, 1001.0),
                               store.lease_takeover(LEASE_NAME, "http://c", "http://a", 3.0, 1001.0))
    won = [g for g in got if g is not None]
    assert len(won) == 1 and won[0].token == 2
    assert (await store.lease_get(LEASE_NAME)).holder == won[0].holder  # type: ignore[union-attr]
    assert await store.lease_takeover(LEASE_NAME, "http://d", "http://a", 3.0, 1002.0) is None

    node = FakeNodeAgent(node_id="n0", isolation=("container",))
    clock = Clock(1002.0)
    d = await _server(store, node, clock, "http://e")
    try:
        assert not d.leader.is_leader  # type: ignore[union-attr]
        assert await d.leader.take_from_dead(won[0].holder)  # type: ignore[union-attr]
        assert d.leading() and d.leader.token == 3 and node.fence.highest == 3  # type: ignore[union-attr]
    finally:
        await d.close()


async def test_a_wiped_store_does_not_lock_the_leader_out_of_its_nodes(store: StateStore) -> None:
    """The nodes keep the highest token they saw (across restarts); a state store that was
    wiped starts the lease at 1. The new leader lifts its token above the node's and leads
    (before: every placement would be refused as from a deposed leader)."""
    node = FakeNodeAgent(node_id="n0", isolation=("container",))
    node.fence.check(7, "a leader of the store's previous life")
    d = await _server(store, node, Clock(), "http://a")
    try:
        assert d.leading() and d.leader.token == 8 and node.fence.highest == 8  # type: ignore[union-attr]
        assert (await store.lease_get(LEASE_NAME)).token == 8  # type: ignore[union-attr]
        assert (await d.place_here(_spec("r"), "sb-1", "t1")).id == "sb-1"
    finally:
        await d.close()
