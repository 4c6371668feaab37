"""Pure parts of the Ray cluster code, and the actor's dispatcher run in-process (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec import errors
from dsec.cluster.local import node_env, plan
from dsec.cluster.nodes import row
from dsec.cluster.ray import NodeAgentServer, NodeCallError, parse_address
from dsec.models import ExecRequest, SandboxSpec
from dsec.node.api import LayerIndex, NodeCapacity, NodeHealth


def test_parse_address() -> None:
    """ray://HOST:PORT and HOST:PORT are accepted; anything else is InvalidArgument naming the field."""
    assert parse_address("ray://127.0.0.2:6379") == "127.0.0.2:6379"
    assert parse_address(" 10.0.0.1:1234 ") == "10.0.0.1:1234"
    for bad in ("", "ray://", "host", "ray://host:port", "h:70000", "http://h:1"):
        with pytest.raises(errors.InvalidArgument) as e:
            parse_address(bad)
        assert e.value.details["field"] == "cluster"


def test_node_env_makes_ray_auth_mode_explicit() -> None:
    """A local cluster's `ray start` gets RAY_AUTH_MODE=disabled unless the user chose a mode:
    with the mode unset, Ray enables token auth on the head as soon as ~/.ray/auth_token
    exists (any bare ray.init() writes it) and the API server's driver is then refused."""
    node = plan(Path("/x"), 1, "t1")[0]
    assert node_env(node, base={})["RAY_AUTH_MODE"] == "disabled"
    assert node_env(node, base={"RAY_AUTH_MODE": "token"})["RAY_AUTH_MODE"] == "token"


def test_plan_gives_every_node_its_own_home_cgroup_range_and_address() -> None:
    """Local nodes never share a DSEC_HOME, run dir, cgroup parent, sandbox range or address."""
    nodes = plan(Path("/x"), 3, "t1")
    for attr in ("node_id", "home", "run_dir", "cgroup_parent", "net_cidr", "ip"):
        assert len({getattr(n, attr) for n in nodes}) == 3, attr
    assert nodes[0].ip == "127.0.0.2" and [n.node_id for n in nodes] == ["n0", "n1", "n2"]
    with pytest.raises(errors.InvalidArgument):
        plan(Path("/x"), 0, "t")


def test_error_crosses_as_a_value_and_keeps_its_class() -> None:
    """A DSecError raised on the node comes back as the same class with message and details;
    other exceptions become SandboxFailure; an unknown class name cannot pick a non-error."""
    e = NodeCallError.of(errors.NotFound("sandbox x not found", sandbox_id="x")).error()
    assert type(e) is errors.NotFound and e.message == "sandbox x not found" and e.details == {"sandbox_id": "x"}
    assert type(NodeCallError.of(ValueError("boom")).error()) is errors.SandboxFailure
    assert type(NodeCallError(cls="Settings", message="m").error()) is errors.SandboxFailure


def test_node_row_states() -> None:
    """ready when the agent answers healthy, unhealthy when it names problems, lost when
    the Ray node is dead or its agent does not answer."""
    cap = NodeCapacity(node_id="n1", cpu=2, memory=4 << 30, disk=1 << 30, max_sandboxes=10, isolation=["container"])
    ok = NodeHealth(node_id="n1", ok=True, pid=7)
    sick = NodeHealth(node_id="n1", ok=False, pid=7, problems=["no OCI runtime found"])
    idx = LayerIndex(node_id="n1")
    assert row("n1", "127.0.0.3", True, ok, cap, [], idx, 7, 1.5)["state"] == "ready"
    assert row("n1", "127.0.0.3", True, sick, cap, [], idx, 7, 1.5)["state"] == "unhealthy"
    assert row("n1", "127.0.0.3", False, ok, cap, [], idx, 7, 1.5)["state"] == "lost"
    r = row("n1", "127.0.0.3", True, None, None, [], None, None, 1.5)
    assert r["state"] == "lost" and r["cpu_bound"] == 0 and r["problems"] == ["agent unreachable"]
    assert row("n1", "a", True, ok, cap, [], idx, 7, 1.5)["cpu_bound"] == 3.0


async def test_server_dispatch_over_the_fake(tmp_path: Path) -> None:
    """The actor's dispatcher forwards protocol methods only, returns errors as values, and
    streams exec events ending the stream with None."""
    srv = NodeAgentServer("fake", {"home": tmp_path, "node_id": "nX"})
    cap = await srv.start()
    assert cap.node_id == "nX"
    info = await srv.call("create", (SandboxSpec(image="busybox"),), {"tenant": "t"})
    assert info.node == "nX"
    err = await srv.call("get", ("sb-nope",), {})
    assert isinstance(err, NodeCallError) and err.cls == "NotFound"
    refused = await srv.call("close", (), {})  # lifecycle is not a remote node method
    assert isinstance(refused, NodeCallError) and refused.cls == "InvalidArgument"
    sid = await srv.stream_open(info.id, ExecRequest(cmd="echo hi"))
    items: list = []
    while not items or items[-1] is not None:
        items += await srv.stream_next(sid)
    assert items[0].data == "hi\n" and items[-2].kind == "exit" and items[-1] is None
    gone = await srv.stream_next(sid)
    assert isinstance(gone[0], NodeCallError) and gone[-1] is None
    with pytest.raises(errors.InvalidArgument):
        NodeAgentServer("weird", {"home": tmp_path})
    await srv.close()


def test_cluster_capacity_is_what_one_sandbox_may_ask() -> None:
    """A sandbox never spans nodes: limits are the largest node's, isolations the union,
    the sandbox cap the sum; no nodes is CapacityExhausted (retry), not a crash."""
    from dsec.cluster.router import cluster_capacity, least_loaded

    a = NodeCapacity(node_id="a", cpu=2, memory=8, disk=100, max_sandboxes=10, isolation=["container"])
    b = NodeCapacity(node_id="b", cpu=4, memory=4, disk=50, max_sandboxes=5, isolation=["container", "gvisor"])
    c = cluster_capacity([a, b])
    assert (c.cpu, c.memory, c.disk, c.max_sandboxes, c.isolation) == (4, 8, 100, 15, ["container", "gvisor"])
    with pytest.raises(errors.CapacityExhausted):
        cluster_capacity([])
    assert least_loaded({"n2": 1, "n0": 3, "n1": 1}) == "n1"


async def test_router_routes_by_sandbox_and_spreads(tmp_path: Path) -> None:
    """Sandboxes created through the router spread over its nodes; every later call goes
    to the node that holds the sandbox, also for an id the router never saw (found by
    asking every node once)."""
    from dsec.cluster.router import ClusterRouter
    from dsec.config import Settings
    from dsec.testing import FakeNodeAgent

    fakes = {n: FakeNodeAgent(Settings(home=tmp_path), node_id=n) for n in ("n0", "n1", "n2")}
    r = ClusterRouter(fakes)
    await r.start()
    infos = [await r.create(SandboxSpec(image="busybox")) for _ in range(6)]
    assert {i.node for i in infos} == {"n0", "n1", "n2"}
    direct = await fakes["n2"].create(SandboxSpec(image="busybox"), sandbox_id="sb-direct")
    assert (await r.get("sb-direct")).node == "n2" and r.where["sb-direct"] == "n2"
    await r.write_file(direct.id, "/a", b"x")
    assert fakes["n2"].files[direct.id] == {"/a": b"x"}
    await r.destroy(direct.id)
    assert "sb-direct" not in fakes["n2"].sandboxes
    with pytest.raises(errors.NotFound):
        await r.exec("sb-nowhere", ExecRequest(cmd="echo"))


async def test_router_list_survives_a_lost_node(tmp_path: Path) -> None:
    """A lost node (its calls raise NodeLost) drops out of the cluster listing instead of
    failing it; its own sandboxes answer NodeLost; other errors still surface."""
    from dsec.cluster.router import ClusterRouter
    from dsec.config import Settings
    from dsec.testing import FakeNodeAgent

    ok, gone = FakeNodeAgent(Settings(home=tmp_path), node_id="ok"), FakeNodeAgent(Settings(home=tmp_path),
                                                                                   node_id="gone")
    r = ClusterRouter({"ok": ok, "gone": gone})
    a = await ok.create(SandboxSpec(image="busybox"))
    b = await gone.create(SandboxSpec(image="busybox"))
    await r.list()

    async def lost(*_a: object, **_k: object) -> None:
        raise errors.NodeLost("node gone does not answer", node="gone")

    gone.list = lost  # type: ignore[method-assign]
    gone.exec = lost  # type: ignore[method-assign]
    assert [i.id for i in await r.list()] == [a.id]
    with pytest.raises(errors.NodeLost):
        await r.exec(b.id, ExecRequest(cmd="echo"))

    async def broken(*_a: object, **_k: object) -> None:
        raise errors.SandboxFailure("disk on fire")

    gone.list = broken  # type: ignore[method-assign]
    with pytest.raises(errors.SandboxFailure):
        await r.list()


async def test_driver_builds_a_restore_on_the_node_it_placed(tmp_path: Path) -> None:
    """A routed RestoreCreator is built by the scheduler driver as agent.create(restore=...)
    on the node the scheduler chose (capacity is accounted where the sandbox really is),
    from a checkpoint another node captured into the shared store."""
    from dsec.cluster.checkpoints import RestoreCreator
    from dsec.cluster.router import ClusterRouter
    from dsec.config import Settings
    from dsec.control.driver import SchedulerDriver
    from dsec.control.scheduler import Scheduler
    from dsec.node.api import RestoreSource
    from dsec.testing import FakeCheckpointStore, FakeNodeAgent

    s = Settings(home=tmp_path, batch_window_s=0.01)
    shared = FakeCheckpointStore()
    fakes = {n: FakeNodeAgent(s, node_id=n, checkpoints=shared) for n in ("n0", "n1")}
    src = await fakes["n0"].create(SandboxSpec(image="busybox"), tenant="t1")
    await fakes["n0"].write_file(src.id, "/w", b"7")
    ck = await fakes["n0"].checkpoint(src.id, "t1")
    called: list[str] = []

    class Spy(RestoreCreator):
        async def __call__(self, spec: SandboxSpec, sandbox_id: str, tenant: str):  # type: ignore[no-untyped-def]
            called.append(sandbox_id)  # the driver must not use the router's own placement
            return await super().__call__(spec, sandbox_id, tenant)

    d = SchedulerDriver(Scheduler(s), fakes, s)
    await d.start()
    try:
        via = Spy(ClusterRouter(fakes), RestoreSource(tenant="t1", checkpoint_id=ck.id))
        spec = SandboxSpec(image="busybox", cpu=1, memory="1G", disk="1G")
        info = await d.route(via)(spec, "sb-restored", "t1")
        assert info.id == "sb-restored" and not called
        assert d.sched.running[info.id].node_id == info.node
        assert await fakes[info.node].read_file(info.id, "/w") == b"7"  # type: ignore[index]
    finally:
        await d.close()


def test_agent_server_makes_new_loops_plain_asyncio(tmp_path: Path) -> None:
    """Ray workers run with uvloop's policy; the node agent (pyroute2 opens its own loops on
    netlink sockets, which uvloop refuses) must get plain asyncio loops there."""
    import asyncio

    uvloop = pytest.importorskip("uvloop")
    before = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        NodeAgentServer("fake", {"home": tmp_path, "node_id": "f1"})
        loop = asyncio.new_event_loop()
        assert type(loop).__module__.startswith("asyncio"), type(loop)
        loop.close()
    finally:
        asyncio.set_event_loop_policy(before)
