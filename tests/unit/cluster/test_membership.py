"""Node liveness on a cluster: the node state table, the lost judgement, and the
heartbeat pass over shared fake agents (a node that stops answering is lost, its
sandboxes answer NodeLost at once, the scheduler releases it; a node that comes back
destroys what was given up and is ready again)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from dsec import errors
from dsec.cluster.membership import NODE_TRANSITIONS, NodeState, can_transition, check_transition, is_lost
from dsec.models import ExecRequest, SandboxSpec

N = NodeState


def test_node_transition_table() -> None:
    """Exactly these moves: ready<->draining, ready/draining -> lost, lost -> ready (after
    reconcile). A lost node cannot be drained; every other move is Conflict naming the node."""
    allowed = {(a, b) for a, targets in NODE_TRANSITIONS.items() for b in targets}
    assert allowed == {(N.ready, N.draining), (N.ready, N.lost), (N.draining, N.ready), (N.draining, N.lost),
                       (N.lost, N.ready)}
    assert set(NODE_TRANSITIONS) == set(NodeState)
    for a in NodeState:
        for b in NodeState:
            assert can_transition(a, b) == ((a, b) in allowed)
    with pytest.raises(errors.Conflict) as e:
        check_transition("n3", N.lost, N.draining)
    assert "n3" in e.value.message and "lost" in e.value.message and e.value.details["node"] == "n3"


def test_is_lost() -> None:
    """Lost when Ray says its node is dead, or when no good heartbeat for lost_after_s;
    an unknown Ray view (None) judges by heartbeats alone."""
    assert not is_lost(True, last_ok=100.0, now=104.9, lost_after_s=5)
    assert is_lost(True, last_ok=100.0, now=105.1, lost_after_s=5)
    assert is_lost(False, last_ok=100.0, now=100.0, lost_after_s=5)
    assert not is_lost(None, last_ok=100.0, now=101.0, lost_after_s=5)
    assert is_lost(None, last_ok=100.0, now=106.0, lost_after_s=5)


async def test_heartbeat_loses_a_silent_node_and_reconciles_it_when_back(tmp_path: Path) -> None:
    """A node whose health hangs is lost after cluster_node_lost_after_s: its sandbox
    answers NodeLost (410) without waiting, the scheduler marks it unhealthy and frees its
    capacity, new creates go elsewhere. When it answers again it destroys the sandbox
    that was given up (nothing leaks) and is ready and placeable again."""
    from dsec.cluster.router import ClusterRouter
    from dsec.cluster.serve import Heartbeats
    from dsec.config import Settings
    from dsec.control.driver import SchedulerDriver
    from dsec.control.scheduler import Scheduler
    from dsec.testing import FakeNodeAgent

    # lost_after well above one beat (0.05 s timeout): a stalled loop must not lose a node early.
    s = Settings(home=tmp_path, cluster_heartbeat_timeout_s=0.05, cluster_node_lost_after_s=0.6,
                 batch_window_s=0.01, retry_backoff_s=0.01)
    a, b = FakeNodeAgent(s, node_id="a"), FakeNodeAgent(s, node_id="b")
    router = ClusterRouter({"a": a, "b": b})
    await router.start()
    driver = SchedulerDriver(Scheduler(s), router.agents, s)
    await driver.start()
    beats = Heartbeats(s, router, driver)
    router.heartbeats = beats

    async def no_ray() -> dict[str, bool]:
        return {}  # Ray's view unknown: judged by heartbeats alone

    beats._ray_alive = no_ray  # type: ignore[method-assign]
    try:
        on_b = await driver.create(SandboxSpec(image="busybox", cpu=1, memory="1G", disk="1G"), "sb-on-b", "t")
        assert on_b.node in ("a", "b")
        victim, other = (b, a) if on_b.node == "b" else (a, b)
        router.where[on_b.id] = victim.node_id
        await beats.beat()
        assert router.states == {"a": N.ready, "b": N.ready}

        hang = asyncio.Event()

        async def silent() -> None:
            await hang.wait()  # a dead raylet: the call never answers

        victim.health = silent  # type: ignore[method-assign, assignment]
        await beats.beat()
        assert router.states[victim.node_id] is N.ready  # one missed beat is not a loss
        await asyncio.sleep(0.65)
        await beats.beat()
        assert router.states[victim.node_id] is N.lost
        assert 0.6 < beats.detect_s[victim.node_id] < 3.0
        with pytest.raises(errors.NodeLost) as e:
            await asyncio.wait_for(router.exec(on_b.id, ExecRequest(cmd="true")), 0.1)
        assert e.value.http_status == 410 and "node lost" in e.value.message
        node = driver.sched.cluster.nodes[victim.node_id]
        assert not node.healthy and node.count == 0 and node.used_cpu == 0
        again = await driver.create(SandboxSpec(image="busybox", cpu=1, memory="1G", disk="1G"), "sb-2", "t")
        assert again.node == other.node_id
        assert [r["state"] for r in router.node_view() if r["id"] == victim.node_id] == ["lost"]

        del victim.health  # answers again: reconcile
        await beats.beat()
        assert router.states[victim.node_id] is N.ready
        assert on_b.id in victim.destroyed and on_b.id not in victim.sandboxes
        assert beats.reconciled[victim.node_id] == [on_b.id]
        assert driver.sched.cluster.nodes[victim.node_id].healthy
        hang.set()
    finally:
        await driver.close()
        await router.close()


def test_node_ls_takes_draining_and_lost_from_the_server() -> None:
    """`dsec node ls` rows (Ray's view) show draining / lost when the API server says so;
    without a server answer they are unchanged; a row Ray already shows lost stays lost."""
    from dsec.cluster.nodes import merge_server_states

    rows = [{"id": "n0", "state": "ready"}, {"id": "n1", "state": "ready"}, {"id": "n2", "state": "lost"}]
    server = [{"id": "n0", "state": "ready"}, {"id": "n1", "state": "draining"}, {"id": "n2", "state": "draining"}]
    assert [r["state"] for r in merge_server_states(rows, server)] == ["ready", "draining", "lost"]
    assert merge_server_states(rows, None) == rows
    assert [r["state"] for r in merge_server_states(rows, [{"id": "n0", "state": "lost"}])] == ["lost", "ready", "lost"]


async def test_lost_nodes_checkpointed_sandbox_is_restored_elsewhere_same_id(tmp_path: Path) -> None:
    """When a node is lost, a sandbox of it that has a checkpoint is restored through the
    scheduler on another node under the same id with the checkpoint's files (latest
    checkpoint); one without a checkpoint stays lost (NodeLost)."""
    from types import SimpleNamespace

    from fake_cluster import two_fake_nodes

    from dsec.cluster.serve import Heartbeats, LostRecovery
    from dsec.config import Settings

    class Ckpts:
        async def list(self, tenant: str, sandbox_id: str) -> list:  # type: ignore[type-arg]
            return [u.info for (t, _), u in store.units.items() if t == tenant and u.info.sandbox_id == sandbox_id]

        async def load(self, tenant: str, checkpoint_id: str) -> SimpleNamespace:
            return SimpleNamespace(spec=store.units[(tenant, checkpoint_id)].spec.model_dump())

    async def get_tenant(name: str) -> SimpleNamespace:
        return SimpleNamespace(uid="uid-" + name)

    s = Settings(home=tmp_path, cluster_heartbeat_timeout_s=0.05, cluster_node_lost_after_s=0.1,
                 batch_window_s=0.01, retry_backoff_s=0.01)
    shape = SandboxSpec(image="busybox", cpu=1, memory="1G", disk="1G")
    async with two_fake_nodes(s) as (store, a, b, router, driver):
        beats = Heartbeats(s, router, driver)
        beats.recovery = LostRecovery(router, driver, Ckpts(), get_tenant)

        async def no_ray() -> dict[str, bool]:
            return {}

        beats._ray_alive = no_ray  # type: ignore[method-assign]
        x = await driver.create(shape, "sb-x", "t")
        victim = {"a": a, "b": b}[x.node]
        other = b if victim is a else a
        y = await victim.create(shape, sandbox_id="sb-y", tenant="t")  # no checkpoint
        driver.sched.adopt(victim.node_id, y.id, "t", 1, 1 << 30, 1 << 30, driver.clock())
        router.where.update({x.id: victim.node_id, y.id: victim.node_id})
        await router.write_file(x.id, "/work/state", b"step 7")
        await victim.checkpoint(x.id, "uid-t")
        await beats.beat()

        async def silent() -> None:
            await asyncio.Event().wait()

        victim.health = silent  # type: ignore[method-assign, assignment]
        await asyncio.sleep(0.15)
        await beats.beat()
        assert router.states[victim.node_id] is N.lost
        await asyncio.gather(*beats._bg)
        assert beats.recovery.restored == {victim.node_id: {x.id: other.node_id}}
        assert x.id in other.sandboxes and await router.read_file(x.id, "/work/state") == b"step 7"
        with pytest.raises(errors.NodeLost):
            await router.exec(y.id, ExecRequest(cmd="true"))


async def test_lost_nodes_warm_members_are_rebuilt_on_other_nodes_at_once(tmp_path: Path) -> None:
    """A pool floor of 4 spread over two nodes; node a is lost (the heartbeat's judgement).
    Its ready members are rebuilt on b within a second, long before the next full pool
    plan (warm_pool_plan_interval_s = 60 s here): the pool target stays met cluster-wide."""
    from fake_cluster import two_fake_nodes

    from dsec.cluster.serve import Heartbeats
    from dsec.config import Settings

    s = Settings(home=tmp_path, batch_window_s=0.01, retry_backoff_s=0.01, warm_pool_plan_interval_s=60.0,
                 warm_pool_max_per_node=2)
    async with two_fake_nodes(s) as (_store, _a, _b, router, driver):
        beats = Heartbeats(s, router, driver)
        spec = SandboxSpec(image="busybox", cpu=1, memory="1G", disk="1G")

        def ready() -> dict[str, int]:
            pools = driver.sched.pools
            assert pools is not None
            out: dict[str, int] = {}
            for members in pools.free.values():
                for r in members:
                    out[r.node_id] = out.get(r.node_id, 0) + 1
            return out

        driver.set_pool(spec, 4)
        for _ in range(200):
            if ready() == {"a": 2, "b": 2}:
                break
            await asyncio.sleep(0.01)
        assert ready() == {"a": 2, "b": 2}
        s.warm_pool_max_per_node = 4  # room on b for the rebuilt members
        beats.last_ok["a"] = time.monotonic()
        beats._lose("a", time.monotonic())
        for _ in range(100):
            if ready() == {"b": 4}:
                break
            await asyncio.sleep(0.01)
        assert ready() == {"b": 4}, ready()
        assert len([i for i in await router.list() if i.node == "b"]) == 4


async def test_layer_sync_drops_what_a_node_removed_from_the_schedulers_coverage(tmp_path: Path) -> None:
    """The scheduler counts a node's layers for placement; when the node's own layer index
    no longer shows an image's layers (the cluster GC removed it there), the next layer
    sync takes them out of the scheduler's layer index, and adds what the node got. A
    layer the scheduler added itself (a placement whose pull is still to come) is left."""
    from dsec.cluster.router import ClusterRouter
    from dsec.cluster.serve import Membership, layer_changes
    from dsec.config import Settings
    from dsec.control.scheduler import Scheduler
    from dsec.testing import FakeNodeAgent
    from dsec.testing.fake_node import _image_layers

    s = Settings(home=tmp_path)
    a = FakeNodeAgent(s, node_id="a", known_images=("busybox", "python"))
    router = ClusterRouter({"a": a})
    sched = Scheduler(s)
    index = await a.layer_index()
    sched.upsert_node("a", 8, 32 << 30, 200 << 30, layers=index.digests())

    class Driver:
        pass

    driver = Driver()
    driver.sched = sched  # type: ignore[attr-defined]
    joins = Membership(s, router, driver)
    (py,), (bb,) = ([d for d, _ in _image_layers(n).layers] for n in ("python", "busybox"))
    optimistic = "sha256:" + "9" * 64
    assert await joins.sync_layers() == {}  # first look: the baseline
    sched.layers_changed("a", [optimistic])
    a.known_images = ("busybox", "gone-then-back")  # python removed, another image arrived
    new = _image_layers("gone-then-back").layers[0][0]
    assert await joins.sync_layers() == {"a": ([new], [py])}
    assert sched.cluster.nodes["a"].layers == {bb, new, optimistic}
    assert "a" not in (sched.cluster.layer_index.get(py) or ())
    assert layer_changes({"x", "y"}, {"y", "z"}) == (["z"], ["x"])
