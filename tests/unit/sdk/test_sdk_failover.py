"""SDK failover between several API servers on one state (issue 13).

Two real uvicorn servers on loopback share one state store and one node (what the
cluster router gives every server); the client is given both URLs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec import errors
from dsec.api.app import create_app
from dsec.api.server import uvicorn_config
from dsec.api.services import Services
from dsec.config import Settings
from dsec.models import SandboxSpec
from dsec.sdk import AsyncClient, Client
from dsec.sdk._config import failover_url, resolve_config, split_urls
from dsec.state.sqlite import SqliteStateStore
from dsec.testing import FakeNodeAgent


def test_urls_from_a_comma_list_or_a_list() -> None:
    """DSEC_URL=a,b and url=[a, b] name the same servers, in order, once each."""
    assert split_urls("http://a:7070/, http://b:7070") == ("http://a:7070", "http://b:7070")
    assert split_urls(["http://a:1", "http://a:1", "http://b:2"]) == ("http://a:1", "http://b:2")
    with pytest.raises(errors.InvalidArgument, match="no server URL"):
        split_urls(" , ")
    cfg = resolve_config("http://a:1,http://b:2", "t")
    assert cfg.url == "http://a:1" and cfg.urls == ("http://a:1", "http://b:2")


def test_failover_moves_on_once() -> None:
    """A failure on the current server moves to the next (round robin); a late failure of
    a server already left behind does not move the client back; one server: nowhere to go."""
    cfg = resolve_config(["http://a:1", "http://b:2"], "t")
    assert failover_url(cfg, "http://a:1") == "http://b:2"
    assert failover_url(cfg, "http://b:2") is None  # not the current one: stay on a
    moved = resolve_config(["http://a:1", "http://b:2"], "t")
    moved = type(moved)(**{**moved.__dict__, "url": "http://b:2"})
    assert failover_url(moved, "http://b:2") == "http://a:1"
    assert failover_url(resolve_config("http://a:1", "t"), "http://a:1") is None


async def _serve(services: Services) -> tuple[object, asyncio.Task[None], str]:
    server = uvicorn_config(create_app(services), services.settings, "127.0.0.1", 0, "warning")
    import uvicorn

    srv = uvicorn.Server(server)
    task = asyncio.create_task(srv.serve())
    while not srv.started:
        assert not task.done(), "server did not start"
        await asyncio.sleep(0.01)
    return srv, task, f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"


@pytest.fixture
async def two_servers(tmp_path: Path) -> AsyncIterator[tuple[list[object], list[str], str, FakeNodeAgent]]:
    settings = Settings(home=tmp_path, api_audit_flush_s=0.05, client_backoff_s=0.01, api_loop_nice=0)
    state = SqliteStateStore(tmp_path / "state.db")
    node = FakeNodeAgent(settings)
    a, b = Services.build(settings, node, state), Services.build(settings, node, state)
    _, token = await a.auth.create_tenant("t1", max_sandboxes=50)
    servers = [await _serve(a), await _serve(b)]
    yield [s for s, _, _ in servers], [u for _, _, u in servers], token, node
    for srv, task, _ in servers:
        srv.should_exit = True  # type: ignore[attr-defined]
        await task
    await state.close()


async def test_async_client_fails_over_and_replays_the_request_id(two_servers) -> None:
    """Server A stops: the create is replayed on B with the same request id and answers the
    sandbox A made (one sandbox, not two); later calls stay on B; the token works on both."""
    servers, urls, token, node = two_servers
    async with AsyncClient(url=urls, token=token) as c:
        first = await c.create(SandboxSpec(image="busybox", request_id="r-1"))
        assert c.config.url == urls[0]
        servers[0].should_exit = True  # type: ignore[attr-defined]
        while True:  # until A no longer accepts connections
            try:
                await asyncio.open_connection("127.0.0.1", int(urls[0].rsplit(":", 1)[1]))
            except OSError:
                break
            await asyncio.sleep(0.02)
        again = await c.create(SandboxSpec(image="busybox", request_id="r-1"))
        assert again.id == first.id and c.config.url == urls[1]
        other = await c.create(SandboxSpec(image="busybox", request_id="r-2"))
        assert other.id != first.id and c.config.url == urls[1]
        assert sorted(i.id for i in await node.list()) == sorted([first.id, other.id])


async def test_sync_client_fails_over(two_servers) -> None:
    """The sync client (urllib3 driver) fails over the same way."""
    servers, urls, token, node = two_servers
    dead = f"http://127.0.0.1:{_free_port()}"  # nobody listens: connection refused

    def run() -> tuple[str, str]:
        with Client(url=[dead, urls[1]], token=token) as c:
            info = c.create(SandboxSpec(image="busybox", request_id="s-1"))
            return info.id, c.config.url

    sid, now = await asyncio.to_thread(run)
    assert now == urls[1] and [i.id for i in await node.list()] == [sid]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
