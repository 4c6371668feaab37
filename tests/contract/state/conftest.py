"""Backends for the StateStore contract suite: SQLite (temp file) and a real redis-server."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from dsec.state import SqliteStateStore, StateStore
from dsec.state.redis_store import RedisStateStore
from dsec.testing.redis_server import RedisServer, redis_server


@pytest.fixture(scope="session")
def redis_srv() -> Iterator[RedisServer]:
    """One real redis-server for the session (free loopback port, own temp dir, stopped by PID)."""
    with redis_server() as srv:
        yield srv


def make_store(kind: str, tmp_path, redis_srv: RedisServer | None, prefix: str | None = None) -> StateStore:
    if kind == "sqlite":
        return SqliteStateStore(tmp_path / "state.db")
    assert redis_srv is not None
    # A fresh key prefix per test: tests share the server, never each other's keys.
    return RedisStateStore(redis_srv.url, prefix=prefix or f"t{uuid.uuid4().hex[:10]}:", timeout_s=1.0)


@pytest.fixture(params=["sqlite", "redis"])
async def store(request, tmp_path) -> AsyncIterator[StateStore]:
    srv = request.getfixturevalue("redis_srv") if request.param == "redis" else None
    s = make_store(request.param, tmp_path, srv)
    await s.open()
    yield s
    await s.close()


@pytest.fixture
def new_store():
    """Open another store object (tests of what a second server would see)."""
    return make_store
