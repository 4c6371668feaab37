"""The async driver's own logic (batching, retry on another node, warm hand-over, reaping,
release) against an in-memory NodeAgent.

The node is the shared in-memory ``dsec.testing.FakeNodeAgent``, held to the same
contract suite (tests/contract/node/) as the real agent.
"""

from __future__ import annotations

import asyncio

import pytest

from dsec.control.driver import POOL_LABEL, SchedulerDriver, cpu_request
from dsec.control.scheduler import Scheduler
from dsec.errors import Overloaded, SandboxFailure
from dsec.models import SandboxInfo, SandboxSpec, SandboxState
from dsec.testing import FakeNodeAgent

from .helpers import settings


def mem_agent(node_id: str, fail_creates: int = 0) -> FakeNodeAgent:
    """The shared fake node (dsec.testing), 8 CPUs, with a create that takes ~10 ms."""
    return FakeNodeAgent(settings(), node_id=node_id, fail_creates=fail_creates, create_delay_s=0.01,
                         isolation=("container",))


def spec(**kw: object) -> SandboxSpec:
    return SandboxSpec(image="busybox", cpu=1, memory="1G", disk="1G", **kw)  # type: ignore[arg-type]


async def _driver(agents: list[FakeNodeAgent], pools: bool = False, **kw: object) -> SchedulerDriver:
    s = settings(batch_window_s=0.01, retry_backoff_s=0.01, reaper_interval_s=0.02, **kw)
    d = SchedulerDriver(Scheduler(s, pools=pools), {a.node_id: a for a in agents}, s)
    await d.start()
    return d


async def test_create_via_creator_seam_and_idempotent() -> None:
    """create() places on a node and returns its info; the same request id returns the same sandbox."""
    a = mem_agent("n0")
    d = await _driver([a])
    try:
        info = await d.create(spec(request_id="job-1"), "sb-x", "t1")
        again = await d.create(spec(request_id="job-1"), "sb-y", "t1")
        assert info.id == again.id == "sb-x" and len(a.sandboxes) == 1
    finally:
        await d.close()


async def test_failed_create_retried_on_other_node() -> None:
    """A create failing on one node is retried on the other and succeeds."""
    bad, good = mem_agent("n0", fail_creates=10), mem_agent("n1")
    d = await _driver([bad, good], retry_max_attempts=3)
    try:
        infos = await asyncio.gather(*(d.create(spec(), f"sb-{i}", "t1") for i in range(4)))
        assert {i.node for i in infos} == {"n1"}
    finally:
        await d.close()


async def test_fails_cleanly_after_attempts() -> None:
    """When every node fails, the caller gets SandboxFailure naming the attempts."""
    d = await _driver([mem_agent("n0", fail_creates=99)], retry_max_attempts=2)
    try:
        with pytest.raises(SandboxFailure, match="2 attempts"):
            await d.create(spec(), "sb-1", "t1")
        assert d.sched.cluster.nodes["n0"].used_cpu == 0
    finally:
        await d.close()


async def test_warm_pool_hand_over_and_reaper() -> None:
    """A pool member built for the shape is handed over (TTL set then); TTL expiry reaps it."""
    a = mem_agent("n0")
    d = await _driver([a], pools=True)
    try:
        first = await d.create(spec(timeout=0.2), "sb-1", "t1")
        for _ in range(100):
            if any(i.labels.get(POOL_LABEL) for i in a.sandboxes.values()):
                break
            await asyncio.sleep(0.01)
        member = next(i.id for i in a.sandboxes.values() if i.labels.get(POOL_LABEL))
        second = await d.create(spec(timeout=0.2), "sb-2", "t1")
        assert second.id == member and second.timeout == 0.2 and second.tenant == "t1"
        assert second.state == SandboxState.idle and second.labels.get(POOL_LABEL) is None
        assert d.sched.stats["warm_hits"] == 1
        for _ in range(500):  # 0.2 s TTL, reaper every 0.02 s; a stalled loop only delays it
            if first.id in a.destroyed and second.id in a.destroyed:
                break
            await asyncio.sleep(0.01)
        assert first.id in a.destroyed and second.id in a.destroyed
    finally:
        await d.close()


async def test_release_frees_capacity() -> None:
    """release() destroys on the node and returns the allocation (the CPU request, a
    fraction of the sandbox's CPU cap)."""
    a = mem_agent("n0")
    d = await _driver([a])
    try:
        info = await d.create(spec(), "sb-1", "t1")
        assert d.sched.cluster.nodes["n0"].used_cpu == cpu_request(1, d.s) < 1
        await d.release(info.id)
        assert a.destroyed == ["sb-1"] and d.sched.cluster.nodes["n0"].used_cpu == 0
    finally:
        await d.close()


async def test_create_without_room_is_withdrawn_with_429() -> None:
    """A create that finds no room within api_create_wait_s answers Overloaded (429 with
    Retry-After), is taken out of the queue, and is never created later; the same request
    id may be submitted again afterwards."""
    a = mem_agent("n0")
    d = await _driver([a], api_create_wait_s=0.2, overcommit_ratio=1.0)
    try:
        big = SandboxSpec(image="busybox", cpu=8 / d.s.cpu_request_ratio, memory="1G", disk="1G")
        first = await d.create(big, "sb-1", "t1")
        with pytest.raises(Overloaded, match="withdrawn") as e:
            await d.create(big.model_copy(update={"request_id": "again"}), "sb-2", "t1")
        assert e.value.details.get("retry_after", 0) > 0 and d.sched.depth() == 0
        await d.release(first.id)
        await asyncio.sleep(0.1)
        assert set(a.sandboxes) == set()
        second = await d.create(big.model_copy(update={"request_id": "again"}), "sb-3", "t1")
        assert second.id == "sb-3"
    finally:
        await d.close()


async def test_failed_warm_claim_places_the_request_anew() -> None:
    """A pool member that fails its hand-over is destroyed and the request is placed again,
    so the caller still gets a sandbox instead of a hung call."""
    a = mem_agent("n0")

    async def broken_claim(sandbox_id: str, spec: SandboxSpec, tenant: str | None) -> SandboxInfo:
        raise SandboxFailure(f"{sandbox_id}: init died")

    a.claim = broken_claim  # type: ignore[attr-defined]
    d = await _driver([a], pools=True)
    try:
        await d.create(spec(), "sb-1", "t1")
        for _ in range(100):
            if any(i.labels.get(POOL_LABEL) for i in a.sandboxes.values()):
                break
            await asyncio.sleep(0.02)
        member = next(i.id for i in a.sandboxes.values() if i.labels.get(POOL_LABEL))
        got = await asyncio.wait_for(d.create(spec(), "sb-2", "t1"), 5)
        assert got.id == "sb-2" and member in a.destroyed
    finally:
        await d.close()


async def test_start_adopts_existing_and_sync_releases_vanished() -> None:
    """At start the driver accounts sandboxes the node already runs (capacity stays true
    after a restart) and destroys leftover pool members; sandboxes the node dropped on its
    own are released from the scheduler at the next sync."""
    a = mem_agent("n0")
    kept = await a.create(SandboxSpec(image="busybox", cpu=2, memory="1G", disk="1G"), tenant="t1")
    await a.create(SandboxSpec(image="busybox", cpu=1, memory="1G", disk="1G", labels={POOL_LABEL: "1"}), pooled=True)
    d = await _driver([a], node_sync_interval_s=0.05)
    try:
        node = d.sched.cluster.nodes["n0"]
        assert set(a.sandboxes) == {kept.id} and node.used_cpu == cpu_request(2, d.s)
        await a.destroy(kept.id)  # behind the scheduler's back (e.g. the node's TTL reaper)
        for _ in range(100):
            if node.used_cpu == 0:
                break
            await asyncio.sleep(0.02)
        assert node.used_cpu == 0 and kept.id not in d.sched.running
    finally:
        await d.close()


async def test_preemption_checkpoints_stops_and_resumes_under_the_same_id() -> None:
    """A high-priority request on a full node preempts a low-priority sandbox: the victim
    is checkpointed before it is stopped, reported as preempted meanwhile, and re-created
    from its checkpoint under the same id once capacity returns."""
    a = mem_agent("n0")
    d = await _driver([a])
    saved: dict[str, str] = {}

    async def checkpoint(tenant: str, sid: str) -> str:
        saved[sid] = f"ck-{sid}"
        return saved[sid]

    async def resume(tenant: str, ck: str, sid: str) -> SandboxInfo:
        assert saved[sid] == ck
        return await a.create(SandboxSpec(image="busybox", memory="24G"), sandbox_id=sid, tenant=tenant)

    d.enable_preemption(checkpoint, resume)
    try:
        low = await d.create(SandboxSpec(image="busybox", memory="24G", priority="low"), "sb-low", "t1")
        high = await d.create(SandboxSpec(image="busybox", memory="24G", priority="high"), "sb-high", "t2")
        assert saved == {"sb-low": "ck-sb-low"} and "sb-low" in a.destroyed
        assert d.preempted("sb-low") is not None and set(a.sandboxes) == {high.id}
        await d.release(high.id)
        for _ in range(200):
            if "sb-low" in a.sandboxes:
                break
            await asyncio.sleep(0.01)
        assert low.id in a.sandboxes and d.preempted("sb-low") is None
    finally:
        await d.close()


async def test_no_preemption_without_checkpoints_and_failed_checkpoint_keeps_victim() -> None:
    """Without checkpoint hooks the driver never preempts (a victim could not be brought
    back); if a victim's checkpoint fails it keeps running and is accounted again."""
    a = mem_agent("n0")
    d = await _driver([a], api_create_wait_s=0.3)
    try:
        await d.create(SandboxSpec(image="busybox", memory="24G", priority="low"), "sb-low", "t1")
        with pytest.raises(Overloaded):
            await d.create(SandboxSpec(image="busybox", memory="24G", priority="high"), "sb-high", "t2")
        assert "sb-low" in a.sandboxes

        async def broken(tenant: str, sid: str) -> str:
            raise SandboxFailure("disk full")

        async def never(tenant: str, ck: str, sid: str) -> SandboxInfo:
            raise AssertionError("nothing to resume")

        d.enable_preemption(broken, never)
        with pytest.raises((Overloaded, SandboxFailure)):
            await d.create(SandboxSpec(image="busybox", memory="24G", priority="high"), "sb-high2", "t2")
        assert "sb-low" in a.sandboxes and "sb-low" in d.sched.running and d.preempted("sb-low") is None
    finally:
        await d.close()


async def test_owner_lease_survives_a_restart_and_release_reaps() -> None:
    """A sandbox created under an owner carries the owner as a label, so a restarted driver
    adopts it with a fresh grace period (not reaped as lease-less); releasing the owner
    kills what it holds."""
    a = mem_agent("n0")
    d = await _driver([a])
    try:
        info = await d.create(spec(owner="run-1"), "sb-1", "t1")
        assert info.labels["dsec.owner"] == "run-1" and d.sched.owned_by("t1/run-1") == ["sb-1"]
    finally:
        await d.close()
    d2 = await _driver([a])
    try:
        assert "t1/run-1" in d2.sched.leases and d2.sched.owned_by("t1/run-1") == ["sb-1"]
        assert not d2.sched.reap(d2.clock())
        assert await d2.release_owner("t1/run-1") == ["sb-1"] and "sb-1" not in a.sandboxes
    finally:
        await d2.close()


async def test_right_sizing_from_observed_cpu_on_release() -> None:
    """Sandboxes of a task type that barely used their CPU make the next request of that
    type reserve less (never below rightsize_min_fraction of what was asked); the CPU cap
    the user asked for is unchanged."""
    a = mem_agent("n0")

    async def cpu_used(sandbox_id: str) -> float:
        return 0.01

    a.cpu_used = cpu_used  # type: ignore[attr-defined]
    d = await _driver([a], rightsize_min_samples=3)
    try:
        for i in range(3):
            info = await d.create(spec(labels={"task": "grep"}), f"sb-{i}", "t1")
            await d.release(info.id)
        info = await d.create(spec(labels={"task": "grep"}), "sb-next", "t1")
        r = d.sched.running[info.id]
        asked = cpu_request(1, d.s)
        assert r.cpu == round(asked * d.s.rightsize_min_fraction, 2) < asked and info.cpu == 1
    finally:
        await d.close()


async def test_routed_creator_is_queued_accounted_and_never_warm() -> None:
    """A per-call creator (a restore) goes through the scheduler: it is placed like any
    create (capacity accounted, same sandbox id) and built by that creator, never handed
    a warm pool member."""
    a = mem_agent("n0")
    d = await _driver([a], pools=True)
    built: list[str] = []

    async def restore(s: SandboxSpec, sid: str, tenant: str) -> SandboxInfo:
        built.append(sid)
        return await a.create(s, sandbox_id=sid, tenant=tenant)

    try:
        d.set_pool(spec(), 1)
        for _ in range(100):
            if d.sched.pools.size():  # type: ignore[union-attr]
                break
            await asyncio.sleep(0.02)
        info = await d.route(restore)(spec(), "sb-restored", "t1")
        assert info.id == "sb-restored" and built == ["sb-restored"]
        assert "sb-restored" in d.sched.running and d.sched.stats["warm_hits"] == 0
    finally:
        await d.close()
