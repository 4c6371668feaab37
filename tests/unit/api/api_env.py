"""Test environment: the real FastAPI app over SQLite state and the shared in-memory FakeNodeAgent."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from dsec.api.app import create_app
from dsec.api.services import Services
from dsec.config import Settings
from dsec.state.sqlite import SqliteStateStore
from dsec.testing import FakeNodeAgent


@dataclass
class Env:
    services: Services
    node: FakeNodeAgent
    admin: httpx.AsyncClient
    alice: httpx.AsyncClient
    bob: httpx.AsyncClient
    anon: httpx.AsyncClient
    alice_token: str


def make_settings(tmp_path: Path, **over: object) -> Settings:
    return Settings(home=tmp_path, api_audit_flush_s=0.05, api_prune_interval_s=3600, **over)  # type: ignore[arg-type]


async def make_env(tmp_path: Path, **over: object) -> Env:
    settings = make_settings(tmp_path, **over)
    node = FakeNodeAgent(settings)
    services = Services.build(settings, node, SqliteStateStore(tmp_path / "state.db"))
    await services.start()
    app = create_app(services, manage_lifecycle=False)
    _, admin_tok = await services.auth.create_tenant("admin", admin=True)
    _, alice_tok = await services.auth.create_tenant("alice", max_sandboxes=2, max_cpu=6)
    _, bob_tok = await services.auth.create_tenant("bob", images=["busybox*"])

    def client(tok: str | None) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {tok}"} if tok else {}
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dsec", headers=headers)

    return Env(services, node, client(admin_tok), client(alice_tok), client(bob_tok), client(None), alice_tok)


async def until(cond: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0) -> None:
    """Wait (real time: state writes hop to the store's thread, and a loaded box is slow)
    until ``cond`` holds; the caller's assert then says what was expected."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        got = cond()
        if await got if isinstance(got, Awaitable) else got:
            return
        await asyncio.sleep(0.005)
