"""The direct data path (dsec.cluster.dataplane) in one process, no Ray, no root: the
proxy over a ``NodeAgentServer`` wrapping the fake agent (``LocalHandle`` stands in for
the actor handle), talking TCP on loopback."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec import errors
from dsec.cluster import dataplane as dp
from dsec.cluster.ray import LocalHandle, NodeAgentServer, NodeCallError, RayNodeProxy
from dsec.models import ExecEvent, ExecRequest, ExecResult, SandboxSpec

SPEC = SandboxSpec(image="busybox", cpu=0.5, memory="128M", disk="64M")


async def _proxy(tmp_path: Path, **over: Any) -> tuple[NodeAgentServer, RayNodeProxy]:
    srv = NodeAgentServer("fake", {"home": tmp_path, "node_id": "f1", **over})
    p = RayNodeProxy("f1", LocalHandle(srv))
    await p.start()
    return srv, p


async def _eof_within(reader: asyncio.StreamReader, s: float) -> bool:
    """True when the peer closed the connection within ``s`` seconds."""
    try:
        while await asyncio.wait_for(reader.read(65536), s):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


def test_frames_round_trip_and_bad_headers_are_refused() -> None:
    """A frame parses back to what was framed; a cut or unknown header is a FrameError."""
    f = dp.frame(7, dp.CALL, "exec", b'{"a":1}')
    (n,) = struct.unpack(">I", f[:4])
    assert n == len(f) - 4 == dp.frame_size("exec", 7)
    assert dp.parse(f[4:]) == (7, dp.CALL, "exec", b'{"a":1}')
    for bad in (b"\x00\x00", struct.pack(">IBB", 1, 99, 0), struct.pack(">IBB", 1, dp.CALL, 200) + b"x"):
        with pytest.raises(dp.FrameError):
            dp.parse(bad)


async def test_read_frame_refuses_oversized_length_before_reading_and_times_out_partial_frames() -> None:
    """A length prefix over the limit is refused at once (the body is never read or
    allocated); a frame whose rest does not arrive in time is a FrameError, not a hang."""
    r = asyncio.StreamReader()
    r.feed_data(struct.pack(">I", 1 << 31))  # "2 GiB follow", and nothing does
    with pytest.raises(dp.FrameError, match="over the limit"):
        await asyncio.wait_for(dp.read_frame(r, 1024, 5.0), 1.0)
    r = asyncio.StreamReader()
    r.feed_data(dp.frame(1, dp.CALL, "get", b"x" * 100)[:50])  # half a frame
    with pytest.raises(dp.FrameError, match="not complete"):
        await dp.read_frame(r, 1024, 0.2)


def test_codecs_cover_every_protocol_method_with_json() -> None:
    """Every forwarded method has a codec from the protocol's signature; bytes travel
    base64 inside JSON, models as their JSON, keyword-only arguments stay keywords."""
    from dsec.node.api import NODE_METHODS

    for m in (*NODE_METHODS, "exec_stream"):
        assert dp.codec(m).method == m
    c = dp.codec("write_file")
    body = c.encode_args(("sb-1", "/work/x", b"\xff\x00"), {})
    assert b"\"data\":\"_wA=\"" in body  # base64 (url-safe alphabet), not raw bytes
    assert c.decode_args(body) == (("sb-1", "/work/x", b"\xff\x00", 0o644), {})
    c = dp.codec("create")
    args, kw = c.decode_args(c.encode_args((SPEC,), {"tenant": "t1", "pooled": True}))
    assert args == (SPEC,) and kw["tenant"] == "t1" and kw["pooled"] is True and kw["restore"] is None
    assert dp.codec("read_file").decode_result(dp.codec("read_file").encode_result(b"\x00\xff")) == b"\x00\xff"
    for args, kw in ((("sb", "/p", b"", 1, 2), {}), (("sb",), {"nope": 1}), (("sb",), {"sandbox_id": "sb"})):
        with pytest.raises(TypeError):  # as a Python call with these arguments would
            dp.codec("write_file").encode_args(args, kw)


async def test_proxy_uses_the_direct_path_and_keeps_error_classes_and_details(tmp_path: Path) -> None:
    """Calls go over the data endpoint (not the actor call); a node error arrives as the
    same dsec.errors class with the same message and details as through the Ray path."""
    srv, p = await _proxy(tmp_path)
    try:
        info = await p.create(SPEC, tenant="t1")
        assert (await p.exec(info.id, ExecRequest(cmd="echo hi"))).stdout == "hi\n"
        await p.write_file(info.id, "/work/b", b"\x00\xff")
        assert await p.read_file(info.id, "/work/b") == b"\x00\xff"
        events = [e async for e in p.exec_stream(info.id, ExecRequest(cmd="echo hi"))]
        assert events[-1].kind == "exit" and events[0].data == "hi\n"
        with pytest.raises(errors.NotFound) as direct:
            await p.get("sb-nope")
        via_ray = await srv.call("get", ("sb-nope",), {})
        assert isinstance(via_ray, NodeCallError)
        ray_err = via_ray.error()
        assert (type(direct.value), direct.value.message, direct.value.details) == \
            (type(ray_err), ray_err.message, ray_err.details)
        assert p.stats["ray"] == 0 and p.stats["direct"] == 6
    finally:
        await p.close()
        await srv.close()


async def test_wrong_token_is_refused_and_the_connection_closed(tmp_path: Path) -> None:
    """A client with a wrong token gets Unauthorized and a closed connection before any
    call is read; the right token still works."""
    srv, p = await _proxy(tmp_path)
    try:
        ep = p._endpoint
        assert ep is not None
        bad = dp.DataClient(ep.model_copy(update={"token": "x" * 43}), lambda r: errors.NodeLost(r))
        with pytest.raises(dp.Refused, match="Unauthorized"):
            await bad.connect(2.0)
        assert srv._data is not None and srv._data.refused == 1
        reader, writer = await asyncio.open_connection(ep.host, ep.port)
        writer.write(dp.frame(0, dp.HELLO, "", b"wrong") + dp.frame(1, dp.CALL, "list", b"{}"))
        assert await _eof_within(reader, 2.0)  # no answer to the call, the connection is closed
        writer.close()
        good = dp.DataClient(ep, lambda r: errors.NodeLost(r))
        await good.connect(2.0)
        kind, body = await good.call("list", b"{}")
        assert (kind, body) == (dp.OK, b"[]")
        good.close()
    finally:
        await p.close()
        await srv.close()


async def test_silent_or_oversized_peers_are_dropped(tmp_path: Path) -> None:
    """A connection that never says hello is closed after the read timeout; an
    authenticated peer announcing a frame over the limit is disconnected at once."""
    srv, p = await _proxy(tmp_path, cluster_data_read_timeout_s=0.3)
    try:
        ep = p._endpoint
        assert ep is not None
        reader, writer = await asyncio.open_connection(ep.host, ep.port)
        assert await _eof_within(reader, 3.0)
        writer.close()
        reader, writer = await asyncio.open_connection(ep.host, ep.port)
        writer.write(dp.frame(0, dp.HELLO, "", ep.token.encode()))
        assert dp.parse((await reader.readexactly(4 + 6))[4:])[1] == dp.WELCOME
        writer.write(struct.pack(">I", ep.max_frame + 1))
        assert await _eof_within(reader, 2.0)
        writer.close()
    finally:
        await p.close()
        await srv.close()


async def test_results_and_arguments_over_the_frame_limit_go_through_the_actor(tmp_path: Path) -> None:
    """A write larger than a frame is sent through Ray; a result larger than a frame stays
    on the node and is fetched once through Ray (no second execution)."""
    srv, p = await _proxy(tmp_path, cluster_data_max_frame_bytes=64 * 1024)
    try:
        info = await p.create(SPEC)
        big = bytes(range(256)) * 400  # 100 KiB: over the limit raw and as base64
        await p.write_file(info.id, "/work/big", big)
        assert p.stats["ray"] == 1
        assert await p.read_file(info.id, "/work/big") == big
        assert p.stats == {"direct": 2, "ray": 1}  # create, read_file (VIA_RAY) / write_file
        assert srv._data is not None and srv._data._stash == {}  # taken
        with pytest.raises(errors.NotFound):
            srv._data.take("nope")
    finally:
        await p.close()
        await srv.close()


async def test_mark_lost_fails_calls_in_flight_and_new_ones_at_once(tmp_path: Path) -> None:
    """A node judged lost: a direct call waiting on it ends with NodeLost right away (not
    when the call would have finished), and so does every new call."""
    srv, p = await _proxy(tmp_path)
    started = asyncio.Event()

    async def hang(sandbox_id: str, req: ExecRequest) -> ExecResult:
        started.set()
        await asyncio.sleep(3600)
        raise AssertionError

    srv.agent.exec = hang
    try:
        info = await p.create(SPEC)
        call = asyncio.ensure_future(p.exec(info.id, ExecRequest(cmd="sleep 1h")))
        await asyncio.wait_for(started.wait(), 5)
        p.mark_lost()
        with pytest.raises(errors.NodeLost) as e:
            await asyncio.wait_for(call, 1.0)
        assert e.value.http_status == 410 and "f1" in e.value.message
        with pytest.raises(errors.NodeLost):
            await asyncio.wait_for(p.get(info.id), 1.0)
        p.mark_back()
        assert (await p.get(info.id)).id == info.id  # reconnects once the node is back
    finally:
        await p.close()
        await srv.close()


async def test_dead_endpoint_is_node_lost_and_a_restarted_agent_is_reached_again(tmp_path: Path) -> None:
    """The agent goes away with a call in flight: that call is NodeLost (not a hang);
    while nothing listens, calls are NodeLost; the agent that replaces it serves a new
    endpoint and token, and the proxy reconnects to it by itself."""
    srv, p = await _proxy(tmp_path)
    started = asyncio.Event()

    async def hang(sandbox_id: str, req: ExecRequest) -> ExecResult:
        started.set()
        await asyncio.sleep(3600)
        raise AssertionError

    srv.agent.exec = hang
    handle = p.handle
    assert isinstance(handle, LocalHandle)
    old = p._endpoint
    assert old is not None
    try:
        info = await p.create(SPEC)
        call = asyncio.ensure_future(p.exec(info.id, ExecRequest(cmd="sleep 1h")))
        await asyncio.wait_for(started.wait(), 5)
        await srv.close()  # the endpoint and its connections go (as with a killed agent process)
        with pytest.raises(errors.NodeLost):
            await asyncio.wait_for(call, 2.0)
        # Nothing listens at the old endpoint and the "actor" hands out none: NodeLost.

        async def gone(host: str | None = None) -> Any:
            raise errors.NodeLost("agent restarting", node="f1")

        srv.data_endpoint = gone  # type: ignore[method-assign]
        with pytest.raises(errors.NodeLost):
            await asyncio.wait_for(p.list(), 2.0)
        new = NodeAgentServer("fake", {"home": tmp_path / "b", "node_id": "f1"})
        handle.server = new  # Ray restarted the actor: a new process, a new endpoint
        assert await asyncio.wait_for(p.list(), 5.0) == []
        assert p._endpoint is not None and (p._endpoint.port, p._endpoint.token) != (old.port, old.token)
        assert p.stats["ray"] == 0
        await new.close()
    finally:
        await p.close()
        await srv.close()


async def test_unreachable_endpoint_of_a_live_agent_falls_back_to_the_actor(tmp_path: Path) -> None:
    """An agent that answers Ray but whose endpoint cannot be reached (a firewall between
    machines) is not a lost node: calls go through the actor, and the proxy does not pay a
    failed connect on every call."""
    srv, p = await _proxy(tmp_path)
    ep = p._endpoint
    assert ep is not None
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = ep.model_copy(update={"port": s.getsockname()[1]})

    async def elsewhere(host: str | None = None) -> dp.DataEndpoint:
        return closed

    srv.data_endpoint = elsewhere  # type: ignore[method-assign]
    p._set_endpoint(closed)
    try:
        assert await p.list() == [] and p.stats == {"direct": 0, "ray": 1}
        assert await asyncio.wait_for(p.list(), 0.5) == [] and p.stats == {"direct": 0, "ray": 2}
    finally:
        await p.close()
        await srv.close()


async def test_stream_keeps_back_pressure_and_an_early_exit_stops_it_on_the_node(tmp_path: Path) -> None:
    """The node runs at most a window of events ahead of a slow reader, and a reader that
    stops early cancels the stream on the node."""
    srv, p = await _proxy(tmp_path)
    produced = 0
    stopped = asyncio.Event()

    async def chatty(sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        nonlocal produced
        try:
            for i in range(10_000):
                produced += 1
                yield ExecEvent(kind="stdout", data=f"{i}\n")
        finally:
            stopped.set()

    srv.agent.exec_stream = chatty
    try:
        info = await p.create(SPEC)
        stream = p.exec_stream(info.id, ExecRequest(cmd="yes"))
        got = [await stream.__anext__() for _ in range(3)]
        assert [e.data for e in got] == ["0\n", "1\n", "2\n"]
        await asyncio.sleep(0.3)  # give the node time to run ahead if it could
        assert produced <= dp.STREAM_WINDOW + 1, produced
        await stream.aclose()
        await asyncio.wait_for(stopped.wait(), 2.0)
        assert produced < 10_000
    finally:
        await p.close()
        await srv.close()


async def test_agent_without_direct_endpoint_uses_the_actor(tmp_path: Path) -> None:
    """cluster_data_direct off: the agent serves no endpoint and every call is an actor call."""
    srv, p = await _proxy(tmp_path, cluster_data_direct=False)
    try:
        assert p._endpoint is None and srv._data is None
        assert (await p.list()) == [] and p.stats == {"direct": 0, "ray": 1}
    finally:
        await p.close()
        await srv.close()


async def test_router_learns_driver_placements_so_the_first_exec_asks_one_node(tmp_path: Path) -> None:
    """A sandbox the scheduler driver creates or claims on a node's proxy directly is known
    to the cluster router at once: its first exec goes to that node only, no `get` to
    every node to find it (an extra round trip on the create -> first exec path)."""
    from dsec.cluster.router import ClusterRouter

    srv_a, a = await _proxy(tmp_path / "a")
    srv_b = NodeAgentServer("fake", {"home": tmp_path / "b", "node_id": "f2"})
    b = RayNodeProxy("f2", LocalHandle(srv_b))
    await b.start()
    router = ClusterRouter({"f1": a, "f2": b})
    try:
        info = await a.create(SPEC)  # as the driver does: on the agent, not through the router
        before = dict(b.stats)
        assert (await router.exec(info.id, ExecRequest(cmd="echo hi"))).stdout == "hi\n"
        assert b.stats == before and router.where[info.id] == "f1"
    finally:
        for p, s in ((a, srv_a), (b, srv_b)):
            await p.close()
            await s.close()
