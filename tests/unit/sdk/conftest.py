"""SDK fixtures: the real app in-process (ASGITransport) and on loopback (uvicorn thread)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from dsec.api.app import create_app
from dsec.api.services import Services
from dsec.config import Settings
from dsec.sdk import AsyncClient
from dsec.state.sqlite import SqliteStateStore
from dsec.testing import FakeNodeAgent


async def _services(home: Path) -> tuple[Services, str]:
    settings = Settings(home=home, api_audit_flush_s=0.05, client_backoff_s=0.01)
    services = Services.build(settings, FakeNodeAgent(settings), SqliteStateStore(home / "state.db"))
    _, token = await services.auth.create_tenant("t1", max_sandboxes=50)
    return services, token


@pytest.fixture
async def aclient(tmp_path: Path) -> AsyncIterator[tuple[AsyncClient, Services]]:
    services, token = await _services(tmp_path)
    await services.start()
    app = create_app(services, manage_lifecycle=False)
    c = AsyncClient("http://dsec", token, transport=httpx.ASGITransport(app=app))
    yield c, services
    await c.aclose()
    await services.close()


@pytest.fixture
def live_server(tmp_path: Path) -> Iterator[tuple[str, str, Services]]:
    """uvicorn on 127.0.0.1:<free port> in a thread (the sync client needs a real socket)."""
    import uvicorn

    services, token = asyncio.run(_services(tmp_path))
    server = uvicorn.Server(uvicorn.Config(create_app(services), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="on"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and th.is_alive(), "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", token, services
    server.should_exit = True
    th.join(10)
