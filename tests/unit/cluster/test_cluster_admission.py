"""Admission on a cluster judges the cluster view: tenant quotas count every node's
sandboxes, per-sandbox limits and group room come from the READY nodes' capacities.

The API's SandboxService over the real ClusterRouter and scheduler driver, two shared
fake node agents (no Ray); node loss goes through the real Heartbeats path."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec import errors
from dsec.api.services import Services
from dsec.cluster.membership import NodeState
from dsec.cluster.router import ClusterRouter
from dsec.cluster.serve import Heartbeats
from dsec.config import Settings
from dsec.control.driver import SchedulerDriver
from dsec.control.scheduler import Scheduler
from dsec.models import SandboxSpec
from dsec.state.sqlite import SqliteStateStore
from dsec.testing import FakeNodeAgent

SMALL = SandboxSpec(image="busybox", cpu=0.5, memory="64M", disk="64M")
BIG = SandboxSpec(image="busybox", cpu=6, memory="64M", disk="64M")  # above a's limit (2 CPUs x 1.3)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    s = Settings(home=tmp_path, api_audit_flush_s=0.05, api_prune_interval_s=3600, warm_pool_factor=0,
                 batch_window_s=0.01, api_create_wait_s=2)
    a, b = FakeNodeAgent(s, node_id="a", cpu=2), FakeNodeAgent(s, node_id="b", cpu=16)
    router = ClusterRouter({"a": a, "b": b})
    services = Services.build(s, router, SqliteStateStore(tmp_path / "state.db"))
    driver = SchedulerDriver(Scheduler(s), router.agents, s)
    services.attach_scheduler(driver)
    await services.start()
    beats = Heartbeats(s, router, driver)
    router.heartbeats = beats
    try:
        yield {"services": services, "router": router, "driver": driver, "a": a, "b": b, "beats": beats}
    finally:
        await services.close()


async def _tenant(services: Services, name: str, **quota: Any) -> Any:
    _, tok = await services.auth.create_tenant(name, **quota)
    return await services.auth.authenticate(f"Bearer {tok}")


async def test_tenant_quota_counts_sandboxes_on_every_node(cluster: dict[str, Any]) -> None:
    """max_sandboxes=3 holds across nodes: three creates land on both nodes, the fourth is
    refused naming the quota (the listing admission counts is the cluster's)."""
    svc = cluster["services"].sandboxes
    alice = await _tenant(cluster["services"], "alice", max_sandboxes=3)
    mid = SandboxSpec(image="busybox", cpu=0.5, memory="16G", disk="64M")  # a node (32 GiB x 1.3) holds two
    infos = [await svc.create(alice, mid) for _ in range(3)]
    assert {i.node for i in infos} == {"a", "b"}  # on both nodes
    with pytest.raises(errors.QuotaExceeded) as e:
        await svc.create(alice, SMALL)  # b has room for it: only the quota refuses
    assert e.value.details["quota"] == "max_sandboxes" and e.value.details["in_use"] == 3


async def test_limits_come_from_ready_nodes_only(cluster: dict[str, Any]) -> None:
    """A 6-CPU sandbox fits the cluster while b (16 CPUs) is ready. Once b is lost or
    draining, the cluster's largest ready node is a (2 CPUs): the same create is refused
    at once with 422 naming the cpu limit (before, b's capacity still counted: the create
    was admitted, queued for a node that could never take it, and withdrawn later).
    With no ready node at all the refusal is a retriable 429 naming each node's state."""
    services, router, beats = cluster["services"], cluster["router"], cluster["beats"]
    svc = services.sandboxes
    bob = await _tenant(services, "bob")
    await svc.create(bob, BIG)
    assert router.capacity().cpu == 16 and router.capacity().max_sandboxes == 200

    beats.last_ok["b"] = time.monotonic() - 3600
    beats._lose("b", time.monotonic())  # the heartbeat's verdict: b is lost
    assert router.states["b"] is NodeState.lost
    cap = router.capacity()
    assert (cap.cpu, cap.max_sandboxes) == (2, 100)
    t0 = time.monotonic()
    with pytest.raises(errors.InvalidArgument) as e:
        await svc.create(bob, BIG)
    assert time.monotonic() - t0 < 1.0
    assert e.value.details["field"] == "cpu" and e.value.http_status == 422
    assert (await svc.create(bob, SMALL)).node == "a"  # what fits a ready node still goes

    router.set_state("a", NodeState.draining)
    with pytest.raises(errors.CapacityExhausted) as c:
        await svc.create(bob, SMALL)
    assert c.value.http_status == 429 and "a: draining" in c.value.message and "b: lost" in c.value.message


async def test_group_room_counts_ready_nodes_only(cluster: dict[str, Any]) -> None:
    """A group that only fits with a lost node's capacity can never be admitted now: it
    is refused at once (422 naming n), not held until its deadline."""
    from dsec.api.groups import GroupAdmission

    services, beats = cluster["services"], cluster["beats"]
    groups = GroupAdmission(services.sandboxes)
    carol = await _tenant(services, "carol")
    spec = SandboxSpec(image="busybox", cpu=1, memory="64M", disk="64M")
    groups._check(carol, spec, 20)  # b alone holds 16 x 1 CPU (x overcommit): fits the cluster
    beats.last_ok["b"] = time.monotonic() - 3600
    beats._lose("b", time.monotonic())
    with pytest.raises(errors.InvalidArgument) as e:
        groups._check(carol, spec, 20)
    assert e.value.details["field"] == "n"
