"""Redis-only faults: unreachable at start, lost while running, back again."""

from __future__ import annotations

import socket

import pytest

from dsec import errors
from dsec.state.redis_store import RedisStateStore, redacted
from dsec.testing.redis_server import RedisServer


async def test_unreachable_at_start_names_the_url() -> None:
    """Opening a store nobody listens on fails at once with the URL in the message."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        st = RedisStateStore(f"redis://127.0.0.1:{port}/3", timeout_s=0.5)
        with pytest.raises(errors.StateUnavailable, match=f"127.0.0.1:{port}/3"):
            await st.open()
        await st.close()


def test_password_never_in_url() -> None:
    assert redacted("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert "secret" not in RedisStateStore("redis://:secret@127.0.0.1:1/0").url


async def test_lost_while_running_then_recovers(redis_srv: RedisServer) -> None:
    """Redis gone mid-run: calls raise StateUnavailable (HTTP 503 + Retry-After), nothing is
    half-written; when it is back the same store object works again."""
    st = RedisStateStore(redis_srv.url, prefix="faults:", timeout_s=0.5, retry_after=2.0)
    await st.open()
    await st.put_doc("pool", "p", {"n": 1})
    redis_srv.pause()
    try:
        with pytest.raises(errors.StateUnavailable) as ei:
            await st.claim_episode("k")
        assert ei.value.http_status == 503 and ei.value.details["retry_after"] == 2.0
        assert redis_srv.url in str(ei.value)
    finally:
        redis_srv.resume()
    assert await st.get_doc("pool", "p") == {"n": 1}
    assert await st.claim_episode("k") == 1
    await st.close()


async def test_many_calls_at_once_wait_for_a_connection(redis_srv: RedisServer) -> None:
    """More calls in flight than the connection pool holds (a bulk kill of 200 sandboxes
    makes ~3 state calls each) all succeed: they queue for a connection. Before, the
    default pool failed the excess at once ("Too many connections" -> 503)."""
    import asyncio

    from dsec.state.redis_store import REDIS_MAX_CONNECTIONS

    st = RedisStateStore(redis_srv.url, prefix="burst:", timeout_s=2.0)
    await st.open()
    try:
        got = await asyncio.gather(*(st.list_docs("pool") for _ in range(3 * REDIS_MAX_CONNECTIONS)),
                                   return_exceptions=True)
        assert [g for g in got if isinstance(g, BaseException)] == []
    finally:
        await st.close()
