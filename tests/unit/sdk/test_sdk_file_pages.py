"""files/list pages (issue 18 #11) through the SDK: the route returns one page and an
X-Next-Cursor header; ``sb.files.list`` follows the pages and returns every entry."""

from __future__ import annotations

from pathlib import Path

import httpx

from dsec.api.app import create_app
from dsec.api.services import Services
from dsec.config import Settings
from dsec.sdk import AsyncClient, AsyncSandbox
from dsec.state.sqlite import SqliteStateStore
from dsec.testing import FakeNodeAgent


async def test_async_list_follows_pages(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, api_list_max_entries=3, api_audit_flush_s=0.05)
    services = Services.build(settings, FakeNodeAgent(settings), SqliteStateStore(tmp_path / "state.db"))
    _, token = await services.auth.create_tenant("t1")
    await services.start()
    app = create_app(services, manage_lifecycle=False)
    transport = httpx.ASGITransport(app=app)
    c = AsyncClient("http://dsec", token, transport=transport)
    try:
        async with await AsyncSandbox.create(image="busybox", client=c) as sb:
            for i in range(7):
                await sb.files.write(f"/w/f{i}", b"x")
            assert [e.name for e in await sb.files.list("/w")] == [f"f{i}" for i in range(7)]
            async with httpx.AsyncClient(transport=transport, base_url="http://dsec",
                                         headers={"authorization": f"Bearer {token}"}) as h:
                page = await h.get(f"/v1/sandboxes/{sb.id}/files/list", params={"path": "/w"})
                assert [e["name"] for e in page.json()] == ["f0", "f1", "f2"]
                nxt = await h.get(f"/v1/sandboxes/{sb.id}/files/list",
                                  params={"path": "/w", "cursor": page.headers["x-next-cursor"], "limit": 2})
                assert [e["name"] for e in nxt.json()] == ["f3", "f4"]
    finally:
        await c.aclose()
        await services.close()
